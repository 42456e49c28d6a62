package main

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/dlock-dev/dlock"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"google.golang.org/protobuf/proto"
)

// runFigures are what `dlock run --metrics-textfile` writes of one run.
type runFigures struct {
	acquired bool
	waited   time.Duration // from the start of the acquisition to its end
	held     time.Duration // from the acquisition to the release
	fence    uint64
}

// writeTextfile writes the figures of a run of key that exited with code to
// path, in the Prometheus text format, for node_exporter's textfile
// collector: to a temporary file in path's directory, renamed over path, so
// that the collector never reads half a file.
func writeTextfile(path, key string, f runFigures, code int, end time.Time) error {
	b2f := func(b bool) float64 {
		if b {
			return 1
		}
		return 0
	}
	var buf bytes.Buffer
	for _, g := range []struct {
		name, help string
		v          float64
	}{
		{"dlock_run_acquired", "1 if the run obtained the lock.", b2f(f.acquired)},
		{"dlock_run_wait_seconds", "How long the run waited for the lock.", f.waited.Seconds()},
		{"dlock_run_hold_seconds", "How long the run held the lock.", f.held.Seconds()},
		{"dlock_run_fence", "The fencing token of the run's lock (0 if not obtained).", float64(f.fence)},
		{"dlock_run_lost", "1 if the lock was lost while the command ran.", b2f(code == exitLockLost)},
		{"dlock_run_exit_code", "dlock's exit status.", float64(code)},
		{"dlock_run_end_timestamp_seconds", "When the run ended, in seconds since the epoch.", float64(end.UnixMilli()) / 1e3},
	} {
		mf := &dto.MetricFamily{
			Name: proto.String(g.name),
			Help: proto.String(g.help),
			Type: dto.MetricType_GAUGE.Enum(),
			Metric: []*dto.Metric{{
				Label: []*dto.LabelPair{{Name: proto.String("key"), Value: proto.String(key)}},
				Gauge: &dto.Gauge{Value: proto.Float64(g.v)},
			}},
		}
		if _, err := expfmt.MetricFamilyToText(&buf, mf); err != nil {
			return err
		}
	}
	dir, base := filepath.Split(path)
	if dir == "" {
		dir = "."
	}
	tmp, err := os.CreateTemp(dir, "."+base+".*.tmp")
	if err != nil {
		return err
	}
	_, err = tmp.Write(buf.Bytes())
	err = errors.Join(err, tmp.Chmod(0o644), tmp.Close())
	if err == nil {
		err = os.Rename(tmp.Name(), path)
	}
	if err != nil {
		os.Remove(tmp.Name())
	}
	return err
}

// textfileCode is the exit status main gives for run's err.
func textfileCode(err error) int {
	var ee *exitError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &ee):
		return ee.code
	}
	return exitUsage
}

// writeFigures writes --metrics-textfile, if asked, and says on stderr when
// it cannot (the run's exit status stays the command's).
func (r *runCmd) writeFigures(key string, err error) {
	if r.textfile == "" || dlock.ValidateKey(key) != nil {
		return
	}
	if werr := writeTextfile(r.textfile, key, r.fig, textfileCode(err), time.Now()); werr != nil {
		fmt.Fprintf(r.a.stderr, "dlock: --metrics-textfile: %v\n", werr)
	}
}

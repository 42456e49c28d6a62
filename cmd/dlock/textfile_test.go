package main

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// readTextfile parses path with the Prometheus text parser (as
// node_exporter's textfile collector does) and returns each gauge's value
// for key.
func readTextfile(t *testing.T, path, key string) map[string]float64 {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(f)
	if err != nil {
		t.Fatalf("the textfile does not parse: %v", err)
	}
	got := map[string]float64{}
	for name, mf := range families {
		if mf.GetType() != dto.MetricType_GAUGE || len(mf.Metric) != 1 {
			t.Errorf("%s: %s with %d series, want one gauge", name, mf.GetType(), len(mf.Metric))
			continue
		}
		m := mf.Metric[0]
		if len(m.Label) != 1 || m.Label[0].GetName() != "key" || m.Label[0].GetValue() != key {
			t.Errorf("%s: labels %v, want key=%q", name, m.Label, key)
		}
		got[name] = m.GetGauge().GetValue()
	}
	return got
}

// TestRunMetricsTextfile checks --metrics-textfile: a run that obtains the
// lock and one refused, each written whole, for the textfile collector.
func TestRunMetricsTextfile(t *testing.T) {
	e := embeddedEnv(t)
	key := uniqueKey(t)
	path := filepath.Join(t.TempDir(), "job.prom")
	before := time.Now()
	if r := run(t, e, "run", "--metrics-textfile", path, key, "--", "sh", "-c", "sleep 0.2; exit 3"); r.code != 3 {
		t.Fatalf("run: exit %d, want 3: %s", r.code, r.stderr)
	}
	got := readTextfile(t, path, key)
	for name, ok := range map[string]bool{
		"dlock_run_acquired":              got["dlock_run_acquired"] == 1,
		"dlock_run_exit_code":             got["dlock_run_exit_code"] == 3,
		"dlock_run_lost":                  got["dlock_run_lost"] == 0,
		"dlock_run_fence":                 got["dlock_run_fence"] >= 1,
		"dlock_run_hold_seconds":          got["dlock_run_hold_seconds"] >= 0.2,
		"dlock_run_wait_seconds":          got["dlock_run_wait_seconds"] >= 0 && got["dlock_run_wait_seconds"] < got["dlock_run_hold_seconds"]+60,
		"dlock_run_end_timestamp_seconds": got["dlock_run_end_timestamp_seconds"] >= float64(before.Unix()),
	} {
		if !ok {
			t.Errorf("after a run that held the lock: %s = %v (all: %v)", name, got[name], got)
		}
	}

	// Held by another run: not obtained, exit 75, and the file replaced.
	hold := startHolder(t, e, "run", key, "--", "sleep", "30")
	waitHeld(t, e, key, hold)
	if r := run(t, e, "run", "-n", "--metrics-textfile", path, key, "--", "true"); r.code != exitConflict {
		t.Fatalf("run while held: exit %d, want %d: %s", r.code, exitConflict, r.stderr)
	}
	got = readTextfile(t, path, key)
	if got["dlock_run_acquired"] != 0 || got["dlock_run_exit_code"] != exitConflict || got["dlock_run_fence"] != 0 || got["dlock_run_hold_seconds"] != 0 {
		t.Errorf("after a refused run: %v", got)
	}
	if len(got) != 7 {
		t.Errorf("%d metrics, want 7: %v", len(got), got)
	}
	entries, _ := os.ReadDir(filepath.Dir(path))
	if len(entries) != 1 {
		t.Errorf("the textfile's directory holds %d files, want 1 (no temporary file left)", len(entries))
	}
}

// TestTextfileEscapesKeys checks that a key with quotes, backslashes and a
// newline comes back whole from the Prometheus parser.
func TestTextfileEscapesKeys(t *testing.T) {
	key := "jobs/\"nightly\" \\ report\nline"
	path := filepath.Join(t.TempDir(), "x.prom")
	if err := writeTextfile(path, key, runFigures{acquired: true, fence: 7}, 0, time.Now()); err != nil {
		t.Fatal(err)
	}
	if got := readTextfile(t, path, key); got["dlock_run_fence"] != 7 {
		t.Errorf("fence %v", got["dlock_run_fence"])
	}
}

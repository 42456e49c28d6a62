package torture

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// collect reads the records of a finished run and checks them.
func (r *runner) collect(started, ended int64) (*RunReport, error) {
	in := checkInput{
		Name: r.m.name, Strategy: r.m.adapter.Name, TTL: r.cfg.TTL,
		NoFencing: r.m.noFencing, Control: r.m.control, SessionHeld: r.m.adapter.SessionHeld, PauseStallsStore: r.m.adapter.PauseStallsStore, Known: r.m.adapter.Known,
		Started: started, Ended: ended,
		Faults: r.faults, ModeKeys: r.modeKeys, Leader: r.leader, NoStoreRecord: r.m.failover,
	}
	in.Offset, in.OffsetSkew = r.clock.offset()
	if r.storeClock != nil {
		m, err := r.storeClock.mapping()
		if err != nil {
			in.Problems = append(in.Problems, err.Error())
		} else {
			in.StoreClock = m
		}
	}
	killedAt := map[string]int64{}
	for _, f := range r.faults {
		if f.Kind == FaultKill {
			killedAt[f.Worker] = f.Start
		}
	}
	for _, p := range r.all {
		p.mu.Lock()
		waitErr, killed, lateKill, termed := p.waitErr, p.killed, p.lateKill, p.termed
		p.mu.Unlock()
		evs, bad, err := readEvents(p.events)
		if notStarted(evs, err, waitErr, termed) {
			// Restarted just before the end of the run, the worker got the
			// final SIGTERM before it could record (or do) anything.
			continue
		}
		if err != nil {
			in.Problems = append(in.Problems, fmt.Sprintf("%s: %v", p.id, err))
		}
		if bad > 0 {
			in.Problems = append(in.Problems, fmt.Sprintf("%s: %d unreadable event lines", p.id, bad))
		}
		in.Workers = append(in.Workers, &workerLog{ID: p.id, Pid: p.pid(), Events: evs, Killed: killedAt[p.id]})
		errText, _ := os.ReadFile(filepath.Join(r.dir, p.id+".stderr"))
		races, known := dataRaces(errText)
		if known > 0 {
			in.KnownRaces += known
		}
		switch {
		case lateKill:
			in.Problems = append(in.Problems, fmt.Sprintf("%s did not exit within 10 s of SIGTERM", p.id))
		case waitErr != nil && !killed && !(races == known && known > 0 && raceExit(waitErr)):
			in.Problems = append(in.Problems, fmt.Sprintf("%s exited: %v (see %s.stderr)", p.id, waitErr, p.id))
		}
		if races > known {
			in.Problems = append(in.Problems, fmt.Sprintf("%s: %d data race(s) in %s.stderr; the first: %s", p.id, races-known, p.id, firstRace(errText)))
		}
		for _, bad := range []string{"panic:", "fatal error:"} {
			if bytes.Contains(errText, []byte(bad)) {
				in.Problems = append(in.Problems, fmt.Sprintf("%s: %q in %s.stderr", p.id, bad, p.id))
			}
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if stop := r.stopRecord; stop != nil {
		r.stopRecord = nil
		hist, err := stop(ctx)
		if err != nil {
			return nil, fmt.Errorf("read store record: %w", err)
		}
		in.HasHistory, in.History = true, hist
	} else if h := r.m.adapter.History; h != nil && !r.m.failover {
		// A failover loses part of the store's record (Config.Failover).
		hist, err := h(ctx, r.env, r.store)
		switch {
		case errors.Is(err, ErrNoHistory):
			// Not available here: the store checks are reported inconclusive.
		case err != nil:
			return nil, fmt.Errorf("read store history: %w", err)
		default:
			in.HasHistory, in.History = true, hist
		}
	}
	log, err := readResourceLog(ctx, r.env.DB, r.env.Tag)
	if err != nil {
		return nil, fmt.Errorf("read resource log: %w", err)
	}
	in.ResLog = log

	// The store's history and the run's clock, so that a finding can be
	// read again from the records (times as in faults.jsonl: relative to
	// the run's start, in ns; the store's instants are Unix µs, Mono() =
	// µs × 1000 − offset_ns).
	if f, err := os.Create(filepath.Join(r.dir, "history.jsonl")); err == nil {
		enc := json.NewEncoder(f)
		_ = enc.Encode(map[string]int64{"started_mono": started, "ended_mono": ended, "offset_ns": in.Offset})
		for _, e := range in.History {
			_ = enc.Encode(e)
		}
		f.Close()
	}
	if f, err := os.Create(filepath.Join(r.dir, "faults.jsonl")); err == nil {
		enc := json.NewEncoder(f)
		for _, fr := range r.faults {
			fr.Start -= started
			fr.End -= started
			_ = enc.Encode(fr)
		}
		f.Close()
	}
	rep := check(in)
	fmt.Fprintf(r.cfg.Log, "   %s: %s, %d acquisitions, %d handoffs, %d violations\n",
		r.m.name, rep.Verdict, rep.Acquisitions, rep.Handoffs, rep.ViolationCount)
	return rep, nil
}

// notStarted reports whether a worker ended by the harness's final SIGTERM
// before it recorded anything: its records are missing or empty, so it
// cannot have taken a lock (a worker records "start" before it opens its
// store, and catches SIGTERM from then on).
func notStarted(evs []Event, readErr, waitErr error, termed bool) bool {
	if !termed || waitErr == nil || len(evs) > 0 {
		return false
	}
	var ee *exec.ExitError
	if !errors.As(waitErr, &ee) {
		return false
	}
	ws, ok := ee.Sys().(syscall.WaitStatus)
	if !ok || !ws.Signaled() || ws.Signal() != syscall.SIGTERM {
		return false
	}
	return readErr == nil || errors.Is(readErr, fs.ErrNotExist)
}

// knownRaces are data races inside the store clients that dlock cannot
// avoid, as the pair of functions at the top of the two accesses' stacks.
// go-zookeeper v1.0.4 reads Conn.lastZxid when it re-sends watches on a
// reconnection while its receive loop writes it (go-zookeeper/zk#35,
// samuel/go-zookeeper#260; no release fixes it).
var knownRaces = [][2]string{
	{"github.com/go-zookeeper/zk.(*Conn).recvLoop()", "github.com/go-zookeeper/zk.(*Conn).sendSetWatches()"},
}

// dataRaces counts the race detector's reports in a worker's stderr, and
// those among them that are knownRaces.
func dataRaces(stderr []byte) (all, known int) {
	const head = "WARNING: DATA RACE\n"
	parts := strings.Split(string(stderr), head)
	for _, rep := range parts[1:] {
		all++
		if end := strings.Index(rep, "=================="); end >= 0 {
			rep = rep[:end]
		}
		tops := raceTops(rep)
		for _, k := range knownRaces {
			if len(tops) == 2 && (tops[0] == k[0] && tops[1] == k[1] || tops[0] == k[1] && tops[1] == k[0]) {
				known++
				break
			}
		}
	}
	return all, known
}

// firstRace is the first race report in stderr, its lines joined by " | "
// and cut to 4,000 bytes, for a report that outlives the records.
func firstRace(stderr []byte) string {
	const head = "WARNING: DATA RACE\n"
	s := string(stderr)
	i := strings.Index(s, head)
	if i < 0 {
		return ""
	}
	s = s[i+len(head):]
	if end := strings.Index(s, "=================="); end >= 0 {
		s = s[:end]
	}
	s = strings.Join(strings.Fields(strings.ReplaceAll(s, "\n", " | ")), " ")
	if len(s) > 4000 {
		s = s[:4000]
	}
	return s
}

// raceTops returns the top frame's function of each access in one race
// report: the line after each "… at 0x… by goroutine N:" line.
func raceTops(rep string) []string {
	var tops []string
	lines := strings.Split(rep, "\n")
	for i, l := range lines {
		if strings.Contains(l, " at 0x") && strings.HasSuffix(l, ":") && i+1 < len(lines) {
			tops = append(tops, strings.TrimSpace(lines[i+1]))
		}
	}
	return tops
}

// raceExit reports whether err is the exit status the race detector gives
// a process that reported races (66 unless GORACE says otherwise).
func raceExit(err error) bool {
	var ee *exec.ExitError
	return errors.As(err, &ee) && ee.ExitCode() == 66
}

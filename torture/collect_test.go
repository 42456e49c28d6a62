package torture

import (
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"strings"
	"testing"
)

func TestNotStarted(t *testing.T) {
	termErr := exec.Command("sh", "-c", "kill -TERM $$").Run()
	exitErr := exec.Command("sh", "-c", "exit 1").Run()
	if termErr == nil || exitErr == nil {
		t.Fatalf("sh: %v, %v", termErr, exitErr)
	}
	missing := &fs.PathError{Op: "open", Path: "w1.2.jsonl", Err: fs.ErrNotExist}
	started := []Event{{Ev: "start"}}
	for _, c := range []struct {
		name    string
		evs     []Event
		readErr error
		waitErr error
		termed  bool
		want    bool
	}{
		{"terminated before its records existed", nil, missing, termErr, true, true},
		{"terminated with empty records", nil, nil, termErr, true, true},
		{"terminated after recording", started, nil, termErr, true, false},
		{"SIGTERM not sent by the harness", nil, missing, termErr, false, false},
		{"failed on its own", nil, missing, exitErr, true, false},
		{"exited cleanly without records", nil, missing, nil, true, false},
		{"records unreadable", nil, errors.New("read: I/O error"), termErr, true, false},
	} {
		if got := notStarted(c.evs, c.readErr, c.waitErr, c.termed); got != c.want {
			t.Errorf("%s: notStarted = %v, want %v", c.name, got, c.want)
		}
	}
}

// TestDataRaces: a worker's race report is a problem of the run unless both
// its accesses are a known race inside a store client.
func TestDataRaces(t *testing.T) {
	known, err := os.ReadFile("testdata/race_known.stderr")
	if err != nil {
		t.Fatal(err)
	}
	if all, k := dataRaces(known); all != 1 || k != 1 {
		t.Errorf("go-zookeeper's lastZxid race: %d races, %d known; want 1, 1", all, k)
	}
	// The same report with one access in dlock's code is not known.
	ours := strings.Replace(string(known), "github.com/go-zookeeper/zk.(*Conn).sendSetWatches()", "github.com/dlock-dev/dlock/zklock.(*Backend).wait()", 1)
	if all, k := dataRaces([]byte(ours)); all != 1 || k != 0 {
		t.Errorf("a race with dlock's code: %d races, %d known; want 1, 0", all, k)
	}
	if all, k := dataRaces(append(known, ours...)); all != 2 || k != 1 {
		t.Errorf("both: %d races, %d known; want 2, 1", all, k)
	}
	if all, _ := dataRaces([]byte("time=… level=WARN msg=\"dlock: lock lost\"\n")); all != 0 {
		t.Errorf("no race: %d", all)
	}
	// The report names the first race's frames, on one line.
	if got := firstRace([]byte(ours)); !strings.Contains(got, "zklock.(*Backend).wait()") || strings.Contains(got, "\n") {
		t.Errorf("firstRace: %q", got)
	}
	if got := firstRace([]byte("no race\n")); got != "" {
		t.Errorf("firstRace without a race: %q", got)
	}
}

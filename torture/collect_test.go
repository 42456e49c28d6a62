package torture

import (
	"errors"
	"io/fs"
	"os/exec"
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

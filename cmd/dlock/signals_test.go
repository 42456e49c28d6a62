package main

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// signalOnceHeld starts cmd, a `dlock run` of key, and sends it sig once
// key is held.
func signalOnceHeld(t *testing.T, e env, key string, cmd *exec.Cmd, stderr *bytes.Buffer, sig syscall.Signal) *holder {
	t.Helper()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	h := watch(t, cmd, stderr, func() string { return stderr.String() })
	waitHeld(t, e, key, h)
	if err := cmd.Process.Signal(sig); err != nil {
		t.Fatal(err)
	}
	return h
}

// TestRunMaxTimeAfterAForwardedSignal: a signal forwarded to COMMAND (a
// SIGHUP it traps to reload, say) does not keep --max-time from ending a
// COMMAND that ignores SIGTERM with SIGKILL after --grace.
func TestRunMaxTimeAfterAForwardedSignal(t *testing.T) {
	e := embeddedEnv(t)
	key := uniqueKey(t)
	cmd, _, stderr := command(e, "run", "-q", "--max-time", "2s", "--grace", "1s", key, "--",
		"sh", "-c", `trap "" TERM; trap "echo reload" HUP; while :; do sleep 0.1; done`)
	h := signalOnceHeld(t, e, key, cmd, stderr, syscall.SIGHUP)
	if !h.exited(20 * time.Second) {
		t.Fatalf("dlock still runs 20 s after a --max-time of 2s (a SIGHUP was forwarded first): %s", stderr.String())
	}
	if code := cmd.ProcessState.ExitCode(); code != exitMaxTime {
		t.Errorf("exit %d, want %d: %s", code, exitMaxTime, stderr.String())
	}
}

// TestRunKeepsIgnoredSignalsIgnored: under nohup (SIGHUP ignored when dlock
// starts) a SIGHUP neither ends dlock nor reaches COMMAND.
func TestRunKeepsIgnoredSignalsIgnored(t *testing.T) {
	e := embeddedEnv(t)
	key := uniqueKey(t)
	nohup, err := exec.LookPath("nohup")
	if err != nil {
		t.Skip("no nohup")
	}
	cmd, _, stderr := command(e, "run", "-q", key, "--", "sh", "-c", "sleep 2; echo finished")
	cmd.Args = append([]string{nohup}, cmd.Args...)
	cmd.Path = nohup
	out := filepath.Join(t.TempDir(), "out")
	f, err := os.Create(out)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cmd.Stdout = f
	h := signalOnceHeld(t, e, key, cmd, stderr, syscall.SIGHUP)
	if !h.exited(30 * time.Second) {
		t.Fatal("dlock under nohup still runs 30 s after its start")
	}
	b, _ := os.ReadFile(out)
	if code := cmd.ProcessState.ExitCode(); code != 0 || !strings.Contains(string(b), "finished") {
		t.Errorf("under nohup, after a SIGHUP: exit %d, output %q, want 0 and the command finished: %s", code, b, stderr.String())
	}
}

// TestRunSurvivesAClosedStderr: a reader of dlock's stderr that goes away
// does not kill dlock with SIGPIPE; --max-time still ends COMMAND's whole
// group and the key is released.
func TestRunSurvivesAClosedStderr(t *testing.T) {
	e := embeddedEnv(t)
	key := uniqueKey(t)
	cmd, _, _ := command(e, "run", "--max-time", "1s", "--grace", "1s", key, "--", "sh", "-c", "sleep 30 & sleep 30")
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = w
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	w.Close()
	r.Close() // dlock's next message meets a closed pipe
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		cmd.Process.Kill()
		t.Fatal("dlock still runs 30 s after its start")
	}
	if code := cmd.ProcessState.ExitCode(); code != exitMaxTime {
		t.Errorf("exit %d (%s), want %d", code, cmd.ProcessState, exitMaxTime)
	}
	if res := run(t, e, "run", "-n", key, "--", "true"); res.code != 0 {
		t.Errorf("the key after the run: exit %d: %s", res.code, res.stderr)
	}
}

// TestRunStopsCommandWithItself: a SIGTSTP to dlock (Ctrl-Z at a shell,
// stdin not a terminal) stops COMMAND's group before dlock stops, so that
// COMMAND never runs on while dlock cannot renew; SIGCONT resumes both.
func TestRunStopsCommandWithItself(t *testing.T) {
	e := embeddedEnv(t)
	key := uniqueKey(t)
	ticks := filepath.Join(t.TempDir(), "ticks")
	cmd, _, stderr := command(e, "run", "-q", key, "--", "sh", "-c", "while :; do echo x >> "+ticks+"; sleep 0.05; done")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	h := watch(t, cmd, stderr, func() string { return stderr.String() })
	waitHeld(t, e, key, h)
	defer cmd.Process.Signal(syscall.SIGTERM)
	size := func() int64 {
		fi, err := os.Stat(ticks)
		if err != nil {
			return 0
		}
		return fi.Size()
	}
	for deadline := time.Now().Add(10 * time.Second); size() == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("COMMAND did not start")
		}
	}
	if err := cmd.Process.Signal(syscall.SIGTSTP); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond) // stopped by now
	before := size()
	time.Sleep(500 * time.Millisecond)
	if after := size(); after != before {
		t.Errorf("COMMAND went on while dlock was stopped (%d bytes, then %d)", before, after)
	}
	if err := cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond)
	if after := size(); after == before {
		t.Error("COMMAND did not go on after SIGCONT")
	}
}

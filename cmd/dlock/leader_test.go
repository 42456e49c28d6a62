package main

import (
	"bufio"
	"encoding/json"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestLeader checks dlock leader: exit 1 when nobody leads; the holder's
// fence and value (a dlock run's metadata) while it leads, in text and
// JSON; and with --watch, a line for the leader, then one with fence 0
// when it stops, until interrupted.
func TestLeader(t *testing.T) {
	e := embeddedEnv(t)
	key := uniqueKey(t)
	if r := run(t, e, "leader", key); r.code != exitNoLeader || !strings.Contains(r.stderr, "nobody leads") {
		t.Fatalf("nobody leading: exit %d, stderr %q", r.code, r.stderr)
	}
	cmd, _, _ := command(e, "leader", "--watch", "--json", key)
	cmd.Stdout = nil
	pipe, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	lines := make(chan jsonLeader)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(pipe)
		for sc.Scan() {
			var ld jsonLeader
			if err := json.Unmarshal(sc.Bytes(), &ld); err != nil {
				t.Errorf("watch line %q: %v", sc.Text(), err)
				return
			}
			lines <- ld
		}
	}()
	next := func(what string) jsonLeader {
		t.Helper()
		select {
		case ld, ok := <-lines:
			if !ok {
				t.Fatalf("watch ended before %s", what)
			}
			return ld
		case <-time.After(15 * time.Second):
			t.Fatalf("watch: %s not printed within 15 s", what)
		}
		return jsonLeader{}
	}
	if ld := next("nobody"); ld.Fence != 0 || ld.Key != key {
		t.Errorf("first watch line: %+v, want fence 0", ld)
	}
	h := startHolder(t, e, "run", key, "--", "sleep", "30")
	got := waitListed(t, e, key, 1)
	ld := next("the leader")
	if ld.Fence != got[0].Token || ld.Fence == 0 || ld.Since == nil || !strings.Contains(ld.Value, "sleep 30") {
		t.Errorf("watch line for the leader: %+v (listed %+v)", ld, got[0])
	}
	r := run(t, e, "leader", key)
	if r.code != 0 || !strings.Contains(r.stdout, "sleep 30") {
		t.Errorf("leader while held: exit %d, %q", r.code, r.stdout)
	}
	_ = h.cmd.Process.Signal(syscall.SIGTERM)
	if !h.exited(10 * time.Second) {
		t.Fatal("holder did not exit on SIGTERM")
	}
	if ld := next("nobody after the leader"); ld.Fence != 0 {
		t.Errorf("after the leader stopped: %+v, want fence 0", ld)
	}
	_ = cmd.Process.Signal(syscall.SIGINT)
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Error("dlock leader --watch did not end on SIGINT")
	}
}

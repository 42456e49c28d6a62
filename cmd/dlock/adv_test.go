package main

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestLockLossStopsWholeJob: when the lock is lost, the job gets SIGTERM
// and, after --grace, SIGKILL, also when COMMAND itself (a wrapper shell)
// dies of the SIGTERM at once while a process it started handles SIGTERM
// slowly: nothing of the job may run on without the lock.
func TestLockLossStopsWholeJob(t *testing.T) {
	e := mysqlStore(t)
	if e == nil {
		t.Skip("no MySQL store")
	}
	key, dir := uniqueKey(t), t.TempDir()
	pidFile, beat := filepath.Join(dir, "pid"), filepath.Join(dir, "beat")
	// The worker shuts down "gracefully" in 30 s; the wrapper shell, waiting
	// for it, dies of the SIGTERM at once.
	worker := `trap "sleep 30; exit 0" TERM; echo $$ > ` + pidFile + `; while :; do date +%s.%N >> ` + beat + `; sleep 0.1; done`
	h := startHolder(t, e, "run", "--ttl", "1s", "--grace", "500ms", key, "-c", `sh -c '`+worker+`' >/dev/null 2>&1 & wait`)
	waitHeld(t, e, key, h)
	var pid int
	for i := 0; pid == 0; i++ {
		if i == 200 {
			t.Fatal("the worker never wrote its pid")
		}
		time.Sleep(20 * time.Millisecond)
		data, _ := os.ReadFile(pidFile)
		pid, _ = strconv.Atoi(strings.TrimSpace(string(data)))
	}
	t.Cleanup(func() { syscall.Kill(pid, syscall.SIGKILL) })
	if r := run(t, e, "release", "--force", key); r.code != 0 {
		t.Fatalf("release --force: %d %s", r.code, r.stderr)
	}
	if !h.exited(10 * time.Second) {
		t.Fatal("dlock run did not exit after losing the lock")
	}
	t.Logf("dlock exited %d", h.cmd.ProcessState.ExitCode())
	time.Sleep(2 * time.Second) // four times --grace
	if syscall.Kill(pid, 0) == nil {
		// Another process may hold the lock now: show that it can.
		r := run(t, e, "run", "-n", key, "--", "true")
		t.Errorf("worker %d of the job still runs %s after dlock exited on losing the lock (--grace 500ms), while another dlock run got the lock: exit %d",
			pid, 2*time.Second, r.code)
	}
}

package main

import (
	"strings"
	"testing"
	"time"
)

// TestRunAtLeast checks --at-least: a command that ends at once leaves its
// key held for the rest of the minimum hold (a second run is refused), and
// the key is free after it.
func TestRunAtLeast(t *testing.T) {
	e := embeddedEnv(t)
	key := uniqueKey(t)
	const d = 2 * time.Second
	start := time.Now()
	if r := run(t, e, "run", "--at-least", d.String(), key, "--", "true"); r.code != 0 {
		t.Fatalf("first run: exit %d: %s", r.code, r.stderr)
	}
	if r := run(t, e, "run", "-n", key, "--", "true"); r.code != exitConflict {
		t.Fatalf("a run %s after a fast job with --at-least %s: exit %d, want %d (held): %s", time.Since(start).Round(time.Millisecond), d, r.code, exitConflict, r.stderr)
	}
	if r := run(t, e, "run", "-w", "30", key, "--", "true"); r.code != 0 {
		t.Fatalf("a run that waits: exit %d: %s", r.code, r.stderr)
	}
	if got := time.Since(start); got < d {
		t.Errorf("the key was free %s after the first run started, before --at-least %s", got, d)
	}
	if r := run(t, e, "run", "--at-least", "-1s", key, "--", "true"); r.code != exitUsage {
		t.Errorf("--at-least -1s: exit %d, want %d", r.code, exitUsage)
	}
}

// TestRunMaxTime checks --max-time: a command that runs past it gets
// SIGTERM (SIGKILL after --grace if it ignores that), dlock exits 124, and
// the key is free afterwards.
func TestRunMaxTime(t *testing.T) {
	e := embeddedEnv(t)
	for name, script := range map[string]string{
		"stops on SIGTERM": "sleep 60",
		"ignores SIGTERM":  `trap "" TERM; sleep 60 & wait $!; sleep 60`,
		"ends before it":   "exit 3",
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			key := uniqueKey(t)
			start := time.Now()
			r := run(t, e, "run", "--max-time", "1s", "--grace", "1s", key, "--", "sh", "-c", script)
			want := exitMaxTime
			if script == "exit 3" {
				want = 3
			}
			if r.code != want {
				t.Fatalf("exit %d, want %d: %s", r.code, want, r.stderr)
			}
			if got := time.Since(start); got > 30*time.Second {
				t.Errorf("dlock returned %s after the start, with --max-time 1s --grace 1s", got)
			}
			if r := run(t, e, "run", "-n", key, "--", "true"); r.code != 0 {
				t.Errorf("the key after the run: exit %d: %s", r.code, r.stderr)
			}
		})
	}
	if r := run(t, e, "run", "--max-time", "-1s", uniqueKey(t), "--", "true"); r.code != exitUsage {
		t.Errorf("--max-time -1s: exit %d, want %d", r.code, exitUsage)
	}
}

// TestRunLockDelay checks --lock-delay: a run that ends normally frees its
// key at once; a negative delay is a usage error, and so is a delay on a
// strategy whose locks end with their session.
func TestRunLockDelay(t *testing.T) {
	e := embeddedEnv(t)
	key := uniqueKey(t)
	if r := run(t, e, "run", "--lock-delay", "5s", key, "--", "true"); r.code != 0 {
		t.Fatalf("run with --lock-delay: exit %d: %s", r.code, r.stderr)
	}
	if r := run(t, e, "run", "-n", key, "--", "true"); r.code != 0 {
		t.Errorf("after a released run with --lock-delay: exit %d (a release frees the key at once): %s", r.code, r.stderr)
	}
	if r := run(t, e, "run", "--lock-delay", "-1s", key, "--", "true"); r.code != exitUsage {
		t.Errorf("--lock-delay -1s: exit %d, want %d", r.code, exitUsage)
	}
	if m := mysqlStore(t); m != nil {
		g := env{"DLOCK_DB=mysql://root@127.0.0.1:3306/test?table=dlock_cli_test&strategy=getlock"}
		if r := run(t, g, "run", "--lock-delay", "1s", key, "--", "true"); r.code != exitUsage || !strings.Contains(r.stderr, "--lock-delay") {
			t.Errorf("--lock-delay on getlock: exit %d, want %d: %s", r.code, exitUsage, r.stderr)
		}
		if r := run(t, g, "run", "--at-least", "1s", key, "--", "true"); r.code != exitUsage || !strings.Contains(r.stderr, "--at-least") {
			t.Errorf("--at-least on getlock: exit %d, want %d: %s", r.code, exitUsage, r.stderr)
		}
	}
}

package main

import (
	"strings"
	"testing"
	"time"
)

// TestRunAtLeast checks --at-least: a command that ends at once leaves its
// key held for the rest of the minimum hold (a second run is refused), and
// the key is free after it.
// On the session strategies (getlock, rowlock, advisory) the key's row
// keeps the hold, for runs without --shared.
func TestRunAtLeast(t *testing.T) {
	stores := map[string]env{"embedded": embeddedEnv(t)}
	if m := mysqlStore(t); m != nil {
		for _, strategy := range []string{"getlock", "rowlock"} {
			stores[strategy] = env{"DLOCK_DB=mysql://root@127.0.0.1:3306/test?table=dlock_cli_test&strategy=" + strategy}
		}
	}
	if p := postgresStore(t); p != nil {
		stores["advisory"] = env{p[0] + "&strategy=advisory"}
		if r := run(t, stores["advisory"], "run", "--shared", "--at-least", "1s", uniqueKey(t), "--", "true"); r.code != exitUsage || !strings.Contains(r.stderr, "--at-least") {
			t.Errorf("--shared --at-least on advisory: exit %d, want %d: %s", r.code, exitUsage, r.stderr)
		}
	}
	for name, e := range stores {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
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
		})
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
// key at once; a negative delay is a usage error. On the session
// strategies, a killed run's key stays held for the delay after the kill.
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
	sessions := map[string]env{}
	if m := mysqlStore(t); m != nil {
		for _, strategy := range []string{"getlock", "rowlock"} {
			sessions[strategy] = env{"DLOCK_DB=mysql://root@127.0.0.1:3306/test?table=dlock_cli_test&strategy=" + strategy}
		}
	}
	if p := postgresStore(t); p != nil {
		sessions["advisory"] = env{p[0] + "&strategy=advisory"}
	}
	for name, e := range sessions {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			const d = 2 * time.Second
			key := uniqueKey(t)
			if r := run(t, e, "run", "--lock-delay", d.String(), key, "--", "true"); r.code != 0 {
				t.Fatalf("run with --lock-delay: exit %d: %s", r.code, r.stderr)
			}
			if r := run(t, e, "run", "-n", key, "--", "true"); r.code != 0 {
				t.Errorf("after a released run with --lock-delay: exit %d (a release frees the key at once): %s", r.code, r.stderr)
			}
			h := startHolder(t, e, "run", "--lock-delay", d.String(), key, "--", "sleep", "60")
			waitHeld(t, e, key, h)
			h.cmd.Process.Kill()
			<-h.done
			killed := time.Now()
			if r := run(t, e, "run", "-n", key, "--", "true"); r.code != exitConflict {
				t.Errorf("a run just after a killed run with --lock-delay %s: exit %d, want %d (held): %s", d, r.code, exitConflict, r.stderr)
			}
			if r := run(t, e, "run", "--wait", "30s", key, "--", "true"); r.code != 0 {
				t.Fatalf("the lock-delay of a killed run ends: exit %d: %s", r.code, r.stderr)
			}
			if got := time.Since(killed); got < d {
				t.Errorf("the key of a killed run with --lock-delay %s was taken %s after the kill", d, got)
			}
		})
	}
}

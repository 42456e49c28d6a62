package main

import (
	"encoding/json"
	"strings"
	"syscall"
	"testing"
	"time"
)

// listsWaiters and listsKeys are the stores whose dlock list --waiters and
// --all work; on the others they must exit 64, never print an empty list.
// listsWaiters says what names a waiter: its owner, or the server's name
// for its session (the prefix of its Client: "connection ", "pid ").
var (
	listsWaiters = map[string]string{"etcd": "owner", "postgres": "owner", "mysql": "connection ", "mysql-getlock": "connection ", "postgres-advisory": "pid "}
	listsKeys    = map[string]bool{"embedded": true, "postgres": true, "mysql": true}
)

func TestListWaitersAndFreeKeys(t *testing.T) {
	for name, e := range stores(t) {
		t.Run(name, func(t *testing.T) {
			key := uniqueKey(t)
			h := startHolder(t, e, "run", "--ttl", "5s", "--owner", "alice", key, "--", "sleep", "60")
			waitHeld(t, e, key, h)
			if r := run(t, e, "list", "--all", key); listsKeys[name] && (r.code != 0 || !strings.Contains(r.stdout, "held:exclusive") || !strings.Contains(r.stdout, "alice")) {
				t.Errorf("list --all of a held key: exit %d, %q %q", r.code, r.stdout, r.stderr)
			}
			if by := listsWaiters[name]; by != "" {
				checkWaiters(t, e, key, h, by)
			} else {
				r := run(t, e, "list", "--waiters", key)
				if r.code != exitUsage || r.stdout != "" || !strings.Contains(r.stderr, "cannot list waiters") {
					t.Errorf("list --waiters on a store that cannot tell: exit %d, %q %q; want 64 and a message", r.code, r.stdout, r.stderr)
				}
			}
			if listsKeys[name] {
				checkFreeKeys(t, e, key)
			} else {
				r := run(t, e, "list", "--all", key)
				if r.code != exitUsage || r.stdout != "" || !strings.Contains(r.stderr, "cannot list free keys") {
					t.Errorf("list --all on a store that forgets keys: exit %d, %q %q; want 64 and a message", r.code, r.stdout, r.stderr)
				}
			}
		})
	}
}

// checkWaiters starts a run waiting for key, held by h, and checks that
// dlock list --waiters shows it (named by its owner, or its connection)
// until h ends and it takes the key.
func checkWaiters(t *testing.T, e env, key string, h *holder, by string) {
	t.Helper()
	w := startHolder(t, e, "run", "--ttl", "5s", "--owner", "bob", key, "--", "true")
	want := "bob"
	if by != "owner" {
		want = by
	}
	var last result
	for range 300 {
		if last = run(t, e, "list", "--waiters", key); strings.Contains(last.stdout, want) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if last.code != 0 || !strings.Contains(last.stdout, "WAITING") || !strings.Contains(last.stdout, want) || strings.Contains(last.stdout, "alice") {
		t.Fatalf("list --waiters never showed the waiter alone (%q): exit %d, %q %q", want, last.code, last.stdout, last.stderr)
	}
	r := run(t, e, "list", "--waiters", "--json", key)
	var ws []jsonWaiter
	if err := json.Unmarshal([]byte(r.stdout), &ws); err != nil || len(ws) != 1 || ws[0].Key != key || ws[0].Mode != "exclusive" ||
		by == "owner" && ws[0].Owner != "bob" || by != "owner" && !strings.HasPrefix(ws[0].Client, by) {
		t.Errorf("list --waiters --json: %v %q", err, r.stdout)
	}
	if err := h.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if !w.exited(30 * time.Second) {
		t.Fatal("the waiter did not take the key when its holder ended")
	}
	if code := w.cmd.ProcessState.ExitCode(); code != 0 {
		t.Fatalf("the waiter exited %d: %s", code, w.stderr)
	}
	if r := run(t, e, "list", "--waiters", "--json", key); r.code != 0 || strings.TrimSpace(r.stdout) != "[]" {
		t.Errorf("list --waiters once nobody waits: exit %d, %q %q; want []", r.code, r.stdout, r.stderr)
	}
}

// checkFreeKeys checks that dlock list --all shows a key a run held free,
// with its last holder and fence.
func checkFreeKeys(t *testing.T, e env, key string) {
	t.Helper()
	free := key + "/nightly-report"
	if r := run(t, e, "run", "--owner", "carol", free, "--", "true"); r.code != 0 {
		t.Fatalf("run: exit %d %q", r.code, r.stderr)
	}
	r := run(t, e, "list", "--all", free)
	if r.code != 0 || !strings.Contains(r.stdout, "released") || !strings.Contains(r.stdout, "carol") {
		t.Errorf("list --all of a released key: exit %d, %q %q", r.code, r.stdout, r.stderr)
	}
	r = run(t, e, "list", "--all", "--json", free)
	var ks []jsonKey
	if err := json.Unmarshal([]byte(r.stdout), &ks); err != nil || len(ks) != 1 {
		t.Fatalf("list --all --json: %v %q", err, r.stdout)
	}
	k := ks[0]
	if k.Key != free || k.State != "released" || k.Token == 0 || len(k.Holders) != 0 || k.Last == nil ||
		k.Last.Owner != "carol" || k.Last.Token != k.Token || k.FreedAt == nil || k.Expired {
		t.Errorf("list --all --json of a released key: %q", r.stdout)
	}
	if r := run(t, e, "list", "--waiters", "--all"); r.code != exitUsage {
		t.Errorf("list --waiters --all: exit %d, want 64", r.code)
	}
}

package main

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/memlock"
)

// listed is one holder in `dlock list --json`.
type listed struct {
	Key   string `json:"key"`
	Token uint64 `json:"token"`
	Mode  string `json:"mode"`
	Limit int    `json:"limit"`
}

func listJSON(t *testing.T, e env, prefix string) []listed {
	t.Helper()
	r := run(t, e, "list", "--json", prefix)
	var got []listed
	if err := json.Unmarshal([]byte(r.stdout), &got); err != nil {
		t.Fatalf("list --json: exit %d %v %q %q", r.code, err, r.stdout, r.stderr)
	}
	return got
}

// waitListed polls `dlock list --json key` until it shows n holders.
func waitListed(t *testing.T, e env, key string, n int) []listed {
	t.Helper()
	var got []listed
	for range 200 {
		if got = listJSON(t, e, key); len(got) == n {
			return got
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("dlock list never showed %d holders of %q: %+v", n, key, got)
	return nil
}

// TestRunShared checks --shared on the embedded store: shared runs overlap
// and show up in dlock list, a plain run is refused while they hold the key
// and, once it waits, holds new shared runs back, then gets the key when
// they leave.
func TestRunShared(t *testing.T) {
	e, dir := embeddedEnv(t), t.TempDir()
	key := uniqueKey(t)
	readers := []*holder{
		startHolder(t, e, "run", "--shared", "--owner", "r1", key, "--", "sleep", "30"),
		startHolder(t, e, "run", "--shared", "-n", "--owner", "r2", key, "--", "sleep", "30"),
	}
	got := waitListed(t, e, key, 2)
	for _, l := range got {
		if l.Mode != "shared" || l.Limit != 0 || l.Key != key {
			t.Errorf("list --json of a shared holder: %+v", l)
		}
	}
	if got[0].Token >= got[1].Token {
		t.Errorf("list --json: fences %d, %d; want them increasing", got[0].Token, got[1].Token)
	}
	if r := run(t, e, "list", key); strings.Count(r.stdout, " shared ") != 2 || !strings.Contains(r.stdout, "MODE") {
		t.Errorf("list: %q, want a MODE column and two shared holders", r.stdout)
	}
	if r := run(t, e, "run", "-n", key, "--", "true"); r.code != 75 || !strings.Contains(r.stderr, "held shared") {
		t.Errorf("a plain run next to shared holders: exit %d %q, want 75 saying it is held shared", r.code, r.stderr)
	}
	// That writer gave up: readers get in again once its mark lapses.
	if r := run(t, e, "run", "--shared", "--wait", "10s", key, "--", "true"); r.code != 0 {
		t.Errorf("a reader after a writer gave up: exit %d %q", r.code, r.stderr)
	}

	writer := startHolder(t, append(e, "D="+dir), "run", key, "--", "sh", "-c", `touch "$D/written"`)
	// Once the waiting writer has tried, new readers wait behind it.
	if !readerRefused(t, e, key, 15*time.Second) {
		t.Error("new --shared runs kept getting the key while a writer waited")
	}
	if writer.exited(0) {
		t.Fatalf("the writer ran next to readers: %s", writer.stderr)
	}
	for _, h := range readers {
		h.cmd.Process.Signal(syscall.SIGTERM)
	}
	if !writer.exited(20 * time.Second) {
		t.Fatal("the writer did not get the key within 20 s of the readers' end")
	}
	if code := writer.cmd.ProcessState.ExitCode(); code != 0 {
		t.Errorf("the writer exited %d: %s", code, writer.stderr)
	}
	if _, err := os.Stat(filepath.Join(dir, "written")); err != nil {
		t.Errorf("the writer's command did not run: %v", err)
	}
	if r := run(t, e, "run", "--shared", "-n", key, "--", "true"); r.code != 0 {
		t.Errorf("a reader after the writer left: exit %d %q", r.code, r.stderr)
	}
}

// readerRefused runs `dlock run --shared -n key` until it is refused (exit
// 75), for up to d, and reports whether it was.
func readerRefused(t *testing.T, e env, key string, d time.Duration) bool {
	t.Helper()
	for deadline := time.Now().Add(d); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		switch r := run(t, e, "run", "--shared", "-n", key, "--", "true"); r.code {
		case 75:
			return true
		case 0:
		default:
			t.Fatalf("a reader: exit %d %q", r.code, r.stderr)
		}
	}
	return false
}

// TestRunLimit checks --limit on the embedded store: of three runs of
// --limit 2, never more than two are inside at once, and two are.
func TestRunLimit(t *testing.T) {
	e, dir := embeddedEnv(t), t.TempDir()
	key := uniqueKey(t)
	// Each run takes one of two slot directories; a third inside at once
	// would find none (exit 99). One that finds the other slot taken
	// records the overlap.
	script := `if mkdir "$D/s0" 2>/dev/null; then s=s0; o=s1; elif mkdir "$D/s1" 2>/dev/null; then s=s1; o=s0; else exit 99; fi
[ -d "$D/$o" ] && touch "$D/overlap"; sleep 1; rmdir "$D/$s"`
	var wg sync.WaitGroup
	codes := make([]int, 3)
	for i := range codes {
		wg.Go(func() {
			r := run(t, append(e, "D="+dir), "run", "--limit", "2", key, "--", "sh", "-c", script)
			codes[i] = r.code
			if r.code != 0 {
				t.Logf("run %d: %s", i, r.stderr)
			}
		})
	}
	wg.Wait()
	for i, c := range codes {
		if c != 0 {
			t.Errorf("run %d exited %d (99: a third run was inside with two others)", i, c)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "overlap")); err != nil {
		t.Error("no two --limit 2 runs were ever inside at once")
	}
}

// TestRunLimitMismatch checks that a run disagreeing with the holders of a
// key on --limit is a usage error naming both, waiting or not, and that
// dlock list shows the limit.
func TestRunLimitMismatch(t *testing.T) {
	e := embeddedEnv(t)
	key := uniqueKey(t)
	h := startHolder(t, e, "run", "--limit", "2", key, "--", "sleep", "30")
	got := waitListed(t, e, key, 1)
	if got[0].Mode != "limited" || got[0].Limit != 2 {
		t.Errorf("list --json of a --limit 2 holder: %+v", got[0])
	}
	if r := run(t, e, "list", key); !strings.Contains(r.stdout, "limited:2") {
		t.Errorf("list: %q, want limited:2", r.stdout)
	}
	for _, args := range [][]string{
		{"--limit", "3", "-n"},
		{"--limit", "3", "--wait", "20s"},
		{"-n"},
		{"--shared"},
	} {
		start := time.Now()
		r := run(t, e, append(append([]string{"run"}, args...), key, "--", "true")...)
		if r.code != 64 || !strings.Contains(r.stderr, "limited to 2") {
			t.Errorf("run %q on a key held with --limit 2: exit %d %q, want 64 naming the limit", args, r.code, r.stderr)
		}
		if d := time.Since(start); d > 10*time.Second {
			t.Errorf("run %q: a mismatch took %s: it must not wait", args, d)
		}
	}
	if r := run(t, e, "run", "--limit", "2", "-n", key, "--", "true"); r.code != 0 {
		t.Errorf("the second slot of --limit 2: exit %d %q", r.code, r.stderr)
	}
	if h.exited(0) {
		t.Errorf("the holder ended: %s", h.stderr)
	}
}

// TestRunModeUsage checks the flags' own errors, before any store is
// touched.
func TestRunModeUsage(t *testing.T) {
	e := embeddedEnv(t)
	for _, args := range [][]string{
		{"--shared", "--limit", "2"},
		{"--limit", "0"},
		{"--limit", "-1"},
		{"--limit", "65537"},
		{"--limit", "two"},
		{"--limit"},
	} {
		r := run(t, e, append(append([]string{"run"}, args...), "k", "--", "true")...)
		if r.code != 64 || !strings.Contains(r.stderr, "limit") {
			t.Errorf("dlock run %q: exit %d %q, want 64 naming --limit", args, r.code, r.stderr)
		}
	}
}

// TestRunModesOnEveryStore checks that a store either grants --shared and
// --limit, or refuses them as a usage error that names the flag: never a
// store failure or a conflict.
func TestRunModesOnEveryStore(t *testing.T) {
	forEachStore(t, func(t *testing.T, e env) {
		for _, flags := range [][]string{{"--shared"}, {"--limit", "2"}} {
			key := uniqueKey(t)
			r := run(t, e, append(append([]string{"run", "-n"}, flags...), key, "--", "true")...)
			switch {
			case r.code == 0:
			case r.code == 64 && strings.Contains(r.stderr, "cannot take "+flags[0]+" locks"):
				t.Logf("%s: refused: %s", flags[0], strings.TrimSpace(r.stderr))
			default:
				t.Errorf("dlock run %s: exit %d %q, want 0 or 64 saying the store cannot take them", flags[0], r.code, r.stderr)
			}
		}
	})
}

// plainBackend hides every optional interface of the Backend it holds.
type plainBackend struct{ dlock.Backend }

// TestGuardPassesSharerThrough checks that the CLI's wrapper grants the
// modes its store grants, and refuses the others before any I/O.
func TestGuardPassesSharerThrough(t *testing.T) {
	ctx := context.Background()
	for _, c := range []struct {
		name  string
		b     dlock.Backend
		grant bool
	}{{"memlock", memlock.New(), true}, {"a Backend without Sharer", plainBackend{memlock.New()}, false}} {
		b, _ := newGuard(c.b, time.Second)
		l := dlock.New(b, nil)
		for _, opt := range []dlock.AcquireOption{dlock.Shared(), dlock.WithLimit(2)} {
			lk, err := l.TryAcquire(ctx, "k", opt)
			switch {
			case c.grant && err == nil:
				lk.Release(ctx)
			case !c.grant && errors.Is(err, dlock.ErrUnsupported):
			default:
				t.Errorf("%s behind the guard: %v (want granted: %v)", c.name, err, c.grant)
			}
		}
		l.Close(ctx)
	}
}

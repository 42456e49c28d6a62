package pglock_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/pglock"
	"github.com/jackc/pgx/v5/pgxpool"
)

// watchBackend is what both watchStrategies offer.
type watchBackend interface {
	dlock.Backend
	dlock.Watcher
	dlock.MetadataSetter
	dlock.Lister
}

var (
	_ watchBackend = (*pglock.Backend)(nil)
	_ watchBackend = (*pglock.Advisory)(nil)
)

// watchStrategies builds each strategy on a pool.
var watchStrategies = map[string]func(t testing.TB, pool *pgxpool.Pool) watchBackend{
	"lease":    func(t testing.TB, p *pgxpool.Pool) watchBackend { return newLease(t, p) },
	"advisory": func(t testing.TB, p *pgxpool.Pool) watchBackend { return newAdvisory(t, p) },
}

// watchBound is how long a watch may take to report a change: far longer
// than a NOTIFY takes.
const watchBound = 10 * time.Second

// sees waits for a receive on ch that reports what, then drops the late
// duplicates of that change.
func sees(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case _, open := <-ch:
		if !open {
			t.Fatalf("the watch was closed before %s was seen", what)
		}
	case <-time.After(watchBound):
		t.Fatalf("rule: a watch reports every change; %s not seen within %s", what, watchBound)
	}
	time.Sleep(100 * time.Millisecond)
	for {
		select {
		case _, open := <-ch:
			if open {
				continue
			}
		default:
		}
		return
	}
}

// closes waits for ch to be closed.
func closes(t *testing.T, ch <-chan struct{}, why string) {
	t.Helper()
	deadline := time.After(watchBound)
	for {
		select {
		case _, open := <-ch:
			if !open {
				return
			}
		case <-deadline:
			t.Fatalf("rule: a watch is closed %s; still open after %s", why, watchBound)
		}
	}
}

func watchKey(name string) string {
	return fmt.Sprintf("watch/%s/%d", name, time.Now().UnixNano())
}

func grant(t *testing.T, b dlock.Backend, req dlock.Request) {
	t.Helper()
	res, err := b.Acquire(t.Context(), req)
	if err != nil || !res.Acquired {
		t.Fatalf("Acquire %+v: %+v %v", req, res, err)
	}
}

// TestWatchClosedWhenItsConnectionBreaks ends the watching connection from
// the server's side: the watch can no longer see changes, so its channel
// is closed (not left open and silent), and a new watch sees changes again.
func TestWatchClosedWhenItsConnectionBreaks(t *testing.T) {
	admin := open(t, "")
	for name, build := range watchStrategies {
		t.Run(name, func(t *testing.T) {
			app := "dlock_watch_" + dlock.NewToken().String()[:8]
			w := build(t, open(t, app))
			other := build(t, nil)
			key := watchKey(name)
			ch, err := w.Watch(t.Context(), key)
			if err != nil {
				t.Fatal(err)
			}
			if n := terminate(t, admin, app); n == 0 {
				t.Fatal("found no connection to terminate")
			}
			closes(t, ch, "when its connection breaks")
			ch, err = w.Watch(t.Context(), key)
			if err != nil {
				t.Fatalf("Watch after a broken connection: %v", err)
			}
			req := dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 10 * time.Second}
			grant(t, other, req)
			sees(t, ch, "a grant after the watch was renewed")
			if err := other.Release(t.Context(), key, req.Token); err != nil {
				t.Fatal(err)
			}
			sees(t, ch, "a release after the watch was renewed")
		})
	}
}

// TestWatchDeadlineKeepsOthers ends one watch with its context: the other
// watches of the Backend (on the same listening connection) and its
// waiters go on.
func TestWatchDeadlineKeepsOthers(t *testing.T) {
	for name, build := range watchStrategies {
		t.Run(name, func(t *testing.T) {
			w := build(t, nil)
			other := build(t, nil)
			key := watchKey(name)
			short, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
			defer cancel()
			first, err := w.Watch(short, key)
			if err != nil {
				t.Fatal(err)
			}
			second, err := w.Watch(t.Context(), key)
			if err != nil {
				t.Fatal(err)
			}
			closes(t, first, "when its context ends")
			holder := dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 10 * time.Second}
			grant(t, other, holder)
			sees(t, second, "a grant after another watch ended")
			// A waiter of the watching Backend is woken by the release.
			waited := make(chan error, 1)
			go func() {
				req := dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 10 * time.Second}
				res, err := w.(dlock.Waiter).AcquireWait(t.Context(), req)
				if err == nil && !res.Acquired {
					err = errors.New("not acquired")
				}
				if err == nil {
					err = w.Release(context.Background(), key, req.Token)
				}
				waited <- err
			}()
			time.Sleep(200 * time.Millisecond)
			if err := other.Release(t.Context(), key, holder.Token); err != nil {
				t.Fatal(err)
			}
			sees(t, second, "a release")
			select {
			case err := <-waited:
				if err != nil {
					t.Fatalf("waiter: %v", err)
				}
			case <-time.After(watchBound):
				t.Fatal("the waiter did not get the released key")
			}
		})
	}
}

// TestWatchNeedsNoPoolConnection watches with a pool of one connection that
// the application holds: the watch has a connection of its own.
func TestWatchNeedsNoPoolConnection(t *testing.T) {
	for name, build := range watchStrategies {
		t.Run(name, func(t *testing.T) {
			pool := smallPool(t, 1)
			w := build(t, pool)
			other := build(t, nil)
			busy, err := pool.Acquire(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			defer busy.Release()
			key := watchKey(name)
			ctx, cancel := context.WithTimeout(t.Context(), watchBound)
			defer cancel()
			ch, err := w.Watch(ctx, key)
			if err != nil {
				t.Fatalf("Watch with the pool's only connection in use: %v", err)
			}
			req := dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 10 * time.Second}
			grant(t, other, req)
			sees(t, ch, "a grant")
			_ = other.Release(t.Context(), key, req.Token)
		})
	}
}

// TestWatchSharedHolders: a shared grant, its metadata change and its
// release are each seen, and the metadata is the holder's own.
func TestWatchSharedHolders(t *testing.T) {
	for name, build := range watchStrategies {
		t.Run(name, func(t *testing.T) {
			w := build(t, nil)
			b := build(t, nil)
			key := watchKey(name)
			ch, err := w.Watch(t.Context(), key)
			if err != nil {
				t.Fatal(err)
			}
			r1 := dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 10 * time.Second, Mode: dlock.ModeShared, Metadata: "a"}
			r2 := dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 10 * time.Second, Mode: dlock.ModeShared, Metadata: "b"}
			grant(t, b, r1)
			sees(t, ch, "a shared grant")
			grant(t, b, r2)
			sees(t, ch, "a second shared grant")
			if err := b.SetMetadata(t.Context(), key, r2.Token, "b2"); err != nil {
				t.Fatalf("SetMetadata of a shared holder: %v", err)
			}
			sees(t, ch, "a shared holder's metadata change")
			infos, err := w.List(t.Context(), key)
			if err != nil {
				t.Fatal(err)
			}
			got := map[dlock.Token]string{}
			for _, li := range infos {
				got[li.Token] = li.Metadata
			}
			if got[r1.Token] != "a" || got[r2.Token] != "b2" || len(got) != 2 {
				t.Errorf("rule: SetMetadata changes its holder's metadata only; List shows %v", infos)
			}
			if err := b.Release(t.Context(), key, r1.Token); err != nil {
				t.Fatal(err)
			}
			sees(t, ch, "a shared release")
			if err := b.SetMetadata(t.Context(), key, r1.Token, "x"); !errors.Is(err, dlock.ErrNotHeld) {
				t.Errorf("SetMetadata of a released shared holder: %v, want ErrNotHeld", err)
			}
			_ = b.Release(t.Context(), key, r2.Token)
		})
	}
}

// TestLeaseSetMetadataAfterExpiry: a lease that ran out is not held, even
// though its row still names its token.
func TestLeaseSetMetadataAfterExpiry(t *testing.T) {
	b := newLease(t, nil)
	for _, mode := range []dlock.Mode{dlock.ModeExclusive, dlock.ModeShared} {
		key := watchKey("expiry")
		req := dlock.Request{Key: key, Token: dlock.NewToken(), TTL: dlock.MinTTL, Mode: mode, Metadata: "v1"}
		grant(t, b, req)
		time.Sleep(dlock.MinTTL + 200*time.Millisecond)
		if err := b.SetMetadata(t.Context(), key, req.Token, "v2"); !errors.Is(err, dlock.ErrNotHeld) {
			t.Errorf("mode %v: SetMetadata of an expired lease: %v, want ErrNotHeld", mode, err)
		}
	}
}

// TestAdvisoryWatchSeesEndedSession ends the holder's session from the
// server's side: no statement frees the lock, but the holder's Advisory
// learns of the end, and its watchers anywhere are told.
func TestAdvisoryWatchSeesEndedSession(t *testing.T) {
	admin := open(t, "")
	app := "dlock_holder_" + dlock.NewToken().String()[:8]
	holder := newAdvisory(t, open(t, app))
	w := newAdvisory(t, nil)
	key := watchKey("ended")
	ch, err := w.Watch(t.Context(), key)
	if err != nil {
		t.Fatal(err)
	}
	grant(t, holder, dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 10 * time.Second})
	sees(t, ch, "a grant")
	if n := terminate(t, admin, app); n == 0 {
		t.Fatal("found no connection to terminate")
	}
	sees(t, ch, "the end of the holder's session")
}

// TestAdvisoryWatchSeesForceRelease: a holder that cannot tell anyone (here
// a plain session, as a process that froze would be) loses its lock to
// ForceRelease, which tells the watchers itself.
func TestAdvisoryWatchSeesForceRelease(t *testing.T) {
	pool := open(t, "")
	w := newAdvisory(t, nil)
	key := watchKey("force")
	c, err := pool.Acquire(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release()
	k1, k2 := pglock.AdvisoryKeys(key)
	if _, err := c.Exec(t.Context(), `SELECT pg_advisory_lock($1::int4, $2::int4)`, k1, k2); err != nil {
		t.Fatal(err)
	}
	ch, err := w.Watch(t.Context(), key)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.ForceRelease(t.Context(), key); err != nil {
		t.Fatal(err)
	}
	sees(t, ch, "a forced release")
}

// TestAdvisoryWatchSeesClose: closing an Advisory ends its sessions, which
// frees its locks; its watchers, and those of other processes, are told.
func TestAdvisoryWatchSeesClose(t *testing.T) {
	holder := newAdvisory(t, nil)
	w := newAdvisory(t, nil)
	key := watchKey("close")
	ch, err := w.Watch(t.Context(), key)
	if err != nil {
		t.Fatal(err)
	}
	grant(t, holder, dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 10 * time.Second})
	sees(t, ch, "a grant")
	holder.Close()
	sees(t, ch, "the release of the holder's locks by Close")
	if _, err := holder.Watch(t.Context(), key); !errors.Is(err, dlock.ErrClosed) {
		t.Errorf("Watch after Close: %v, want ErrClosed", err)
	}
}

// TestWatchOutlivesIdleSessionTimeout: a pool whose sessions the server
// ends after a second idle (idle_session_timeout, set by the application,
// its role or the server) does not end a watch that sees no change for
// longer.
func TestWatchOutlivesIdleSessionTimeout(t *testing.T) {
	for name, build := range watchStrategies {
		t.Run(name, func(t *testing.T) {
			cfg := openConfig(t)
			cfg.ConnConfig.RuntimeParams["idle_session_timeout"] = "1000"
			w := build(t, openWith(t, cfg))
			other := build(t, nil)
			key := watchKey(name)
			ch, err := w.Watch(t.Context(), key)
			if err != nil {
				t.Fatal(err)
			}
			select {
			case _, open := <-ch:
				if !open {
					t.Fatal("rule: a watch lasts until its context ends; closed while idle (idle_session_timeout)")
				}
			case <-time.After(3 * time.Second):
			}
			req := dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 10 * time.Second}
			grant(t, other, req)
			sees(t, ch, "a grant after 3 s without changes")
			_ = other.Release(t.Context(), key, req.Token)
		})
	}
}

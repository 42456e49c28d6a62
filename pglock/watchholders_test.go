package pglock_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/pglock"
	"github.com/jackc/pgx/v5/pgxpool"
)

// holderWatchBackend is what both holderWatchStrategies offer.
type holderWatchBackend interface {
	watchBackend
	dlock.HolderWatcher
	dlock.ForceReleaser
}

// holderWatchStrategies builds each strategy on a pool, with the table
// that keeps its keys' change counters.
var holderWatchStrategies = map[string]struct {
	build   func(t testing.TB, pool *pgxpool.Pool) holderWatchBackend
	counter string
}{
	"lease":    {func(t testing.TB, p *pgxpool.Pool) holderWatchBackend { return newLease(t, p) }, ""},
	"advisory": {func(t testing.TB, p *pgxpool.Pool) holderWatchBackend { return newAdvisory(t, p) }, "_session"},
}

// describe names holders by metadata, in the order given.
func describe(hs []dlock.LockInfo) string {
	var out []string
	for _, h := range hs {
		out = append(out, h.Metadata)
	}
	return "[" + strings.Join(out, " ") + "]"
}

// next returns the holders ch reports next.
func next(t *testing.T, ch <-chan []dlock.LockInfo, what string) []dlock.LockInfo {
	t.Helper()
	select {
	case hs, open := <-ch:
		if !open {
			t.Fatalf("the watch was closed before %s", what)
		}
		return hs
	case <-time.After(watchBound):
		t.Fatalf("rule: a holder watch reports every change; %s not reported within %s", what, watchBound)
	}
	return nil
}

// closesHolders waits for ch to close, failing if it reports holders
// first.
func closesHolders(t *testing.T, ch <-chan []dlock.LockInfo, why string) {
	t.Helper()
	select {
	case hs, open := <-ch:
		if open {
			t.Fatalf("rule: a holder watch is closed %s; it reported %s", why, describe(hs))
		}
	case <-time.After(watchBound):
		t.Fatalf("rule: a holder watch is closed %s; still open after %s", why, watchBound)
	}
}

// TestWatchHoldersClosedOnAGap: a change whose notification the watch did
// not get (here the key's change counter bumped without one), or one it
// cannot apply (a notification without a change record, as a client of an
// earlier version sends), ends the watch at the next change: its channel
// is closed, rather than the change it saw merged with the one it missed.
func TestWatchHoldersClosedOnAGap(t *testing.T) {
	admin := open(t, "")
	for name, s := range holderWatchStrategies {
		for _, fault := range []string{"skipped counter", "bare notification"} {
			t.Run(name+"/"+fault, func(t *testing.T) {
				w, b := s.build(t, nil), s.build(t, nil)
				key := watchKey("gap-" + name)
				_, ch, err := w.WatchHolders(t.Context(), key)
				if err != nil {
					t.Fatal(err)
				}
				r := dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 10 * time.Second, Metadata: "a"}
				grant(t, b, r)
				if hs := next(t, ch, "the grant"); describe(hs) != "[a]" {
					t.Fatalf("after the grant: %s", describe(hs))
				}
				switch fault {
				case "skipped counter":
					if _, err := admin.Exec(t.Context(), `UPDATE "`+testTable()+s.counter+`" SET changes = changes + 1 WHERE name = $1`, []byte(key)); err != nil {
						t.Fatal(err)
					}
				default:
					hk := fmt.Sprintf("%x", key)
					if _, err := admin.Exec(t.Context(), `SELECT pg_notify($1, $2)`, testTable()+"/watch", hk); err != nil {
						t.Fatal(err)
					}
				}
				if err := b.Release(t.Context(), key, r.Token); err != nil {
					t.Fatal(err)
				}
				closesHolders(t, ch, "after a "+fault)
			})
		}
	}
}

// TestWatchHoldersClosedOnAChangeTooLarge: a grant that drops more expired
// holders than its notification can name still succeeds, and the watch,
// which cannot tell the holders after it, is closed.
func TestWatchHoldersClosedOnAChangeTooLarge(t *testing.T) {
	admin := open(t, "")
	w, b := newLease(t, nil), newLease(t, nil)
	key := watchKey("large")
	if _, err := admin.Exec(t.Context(), `INSERT INTO "`+testTable()+`_holders" (name, token, lim, fence, acquired_at, expires_at)
SELECT $1, gen_random_bytes(16), 0, i, clock_timestamp() - interval '1 hour', clock_timestamp() - interval '1 minute'
FROM generate_series(1, 300) i`, []byte(key)); err != nil && strings.Contains(err.Error(), "gen_random_bytes") {
		_, err = admin.Exec(t.Context(), `INSERT INTO "`+testTable()+`_holders" (name, token, lim, fence, acquired_at, expires_at)
SELECT $1, decode(md5(i::text || $2), 'hex'), 0, i, clock_timestamp() - interval '1 hour', clock_timestamp() - interval '1 minute'
FROM generate_series(1, 300) i`, []byte(key), key)
		if err != nil {
			t.Fatal(err)
		}
	} else if err != nil {
		t.Fatal(err)
	}
	_, ch, err := w.WatchHolders(t.Context(), key)
	if err != nil {
		t.Fatal(err)
	}
	r := dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 10 * time.Second, Mode: dlock.ModeShared, Metadata: "a"}
	grant(t, b, r)
	closesHolders(t, ch, "after a change too large for a notification")
	now, _, err := w.WatchHolders(t.Context(), key)
	if err != nil || describe(now) != "[a]" {
		t.Errorf("WatchHolders anew: %s, %v; want the shared holder", describe(now), err)
	}
}

// TestWatchHoldersEndedContext: WatchHolders with an ended context returns
// its error at once, and a watch whose context ends is closed.
func TestWatchHoldersEndedContext(t *testing.T) {
	for name, s := range holderWatchStrategies {
		t.Run(name, func(t *testing.T) {
			w := s.build(t, nil)
			ctx, cancel := context.WithCancel(t.Context())
			cancel()
			start := time.Now()
			if _, ch, err := w.WatchHolders(ctx, watchKey("ended")); !errors.Is(err, context.Canceled) || ch != nil {
				t.Errorf("WatchHolders with an ended context: %v, %v; want context.Canceled", ch, err)
			}
			if d := time.Since(start); d > time.Second {
				t.Errorf("WatchHolders with an ended context took %s", d)
			}
			ctx, cancel = context.WithCancel(t.Context())
			_, ch, err := w.WatchHolders(ctx, watchKey("ended"))
			if err != nil {
				t.Fatal(err)
			}
			cancel()
			closesHolders(t, ch, "when its context ends")
		})
	}
}

// TestAdvisoryWatchHoldersSeesEndedSession: the end of a holder's session
// that its Advisory sees is a change of the holders.
func TestAdvisoryWatchHoldersSeesEndedSession(t *testing.T) {
	admin := open(t, "")
	app := "dlock_holder_" + dlock.NewToken().String()[:8]
	holder := newAdvisory(t, open(t, app))
	w := newAdvisory(t, nil)
	key := watchKey("ended-holders")
	_, ch, err := w.WatchHolders(t.Context(), key)
	if err != nil {
		t.Fatal(err)
	}
	grant(t, holder, dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 10 * time.Second, Metadata: "a"})
	if hs := next(t, ch, "the grant"); describe(hs) != "[a]" {
		t.Fatalf("after the grant: %s", describe(hs))
	}
	if n := terminate(t, admin, app); n == 0 {
		t.Fatal("found no connection to terminate")
	}
	if hs := next(t, ch, "the end of the holder's session"); len(hs) != 0 {
		t.Errorf("after the end of the holder's session: %s, want none", describe(hs))
	}
}

var _ holderWatchBackend = (*pglock.Advisory)(nil)

// TestWatchHoldersEndsWhileListenerStarts: a watch whose context ends while
// the listening connection is still starting returns the context's error,
// and the connection, once it starts, serves the next watch (run with -race:
// the first watch must not read the start's outcome before it is known).
func TestWatchHoldersEndsWhileListenerStarts(t *testing.T) {
	for name, s := range holderWatchStrategies {
		t.Run(name, func(t *testing.T) {
			open(t, "") // the tables exist
			cfg := openConfig(t)
			proxy := newGateProxy(t, fmt.Sprintf("%s:%d", cfg.ConnConfig.Host, cfg.ConnConfig.Port))
			host, port, _ := net.SplitHostPort(proxy.ln.Addr().String())
			cfg.ConnConfig.Host = host
			fmt.Sscan(port, &cfg.ConnConfig.Port)
			proxy.hold()
			w := s.build(t, openWith(t, cfg))
			// Opened by a timer, not after the first watch returns: what the
			// test does next must not order the start after that watch.
			opened := time.AfterFunc(time.Second, proxy.release)
			defer opened.Stop()
			ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
			defer cancel()
			if _, ch, err := w.WatchHolders(ctx, watchKey("starting")); !errors.Is(err, context.DeadlineExceeded) || ch != nil {
				t.Fatalf("WatchHolders while the server does not answer: %v, %v; want context.DeadlineExceeded", ch, err)
			}
			ctx, cancel = context.WithTimeout(t.Context(), 10*time.Second)
			defer cancel()
			if _, _, err := w.WatchHolders(ctx, watchKey("starting")); err != nil {
				t.Fatalf("WatchHolders once the server answers: %v", err)
			}
		})
	}
}

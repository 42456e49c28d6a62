package redislock_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/redislock"
	"github.com/redis/go-redis/v9"
)

// mustWatchHolders starts a holder watch of key that lasts the test.
func mustWatchHolders(t *testing.T, b *redislock.Backend, key string) ([]dlock.LockInfo, <-chan []dlock.LockInfo) {
	t.Helper()
	now, ch, err := b.WatchHolders(ctxT(t, 2*time.Minute), key)
	if err != nil {
		t.Fatalf("WatchHolders(%q): %v", key, err)
	}
	return now, ch
}

// next returns the next holders ch delivers.
func next(t *testing.T, ch <-chan []dlock.LockInfo, what string) []dlock.LockInfo {
	t.Helper()
	select {
	case hs, open := <-ch:
		if !open {
			t.Fatalf("the holder watch closed before %s", what)
		}
		return hs
	case <-time.After(watchBound):
		t.Fatalf("rule: a holder watch delivers every change; %s not seen within %s", what, watchBound)
	}
	return nil
}

// holdersClose waits for ch to close and fails if it delivers first.
func holdersClose(t *testing.T, ch <-chan []dlock.LockInfo, why string) {
	t.Helper()
	select {
	case hs, open := <-ch:
		if open {
			t.Fatalf("rule: a holder watch that missed a change closes; after %s it delivered %+v", why, hs)
		}
	case <-time.After(watchBound):
		t.Fatalf("rule: a holder watch that missed a change closes; still open %s after %s", watchBound, why)
	}
}

// tokens returns the tokens and metadata of hs, in order.
func tokens(hs []dlock.LockInfo) []string {
	var out []string
	for _, h := range hs {
		out = append(out, h.Token.String()[:6]+"="+h.Metadata)
	}
	return out
}

func wantHolders(t *testing.T, got []dlock.LockInfo, what string, want ...dlock.Request) {
	t.Helper()
	ok := len(got) == len(want)
	for i := 0; ok && i < len(got); i++ {
		ok = got[i].Token == want[i].Token && got[i].Metadata == want[i].Metadata && got[i].Mode == want[i].Mode &&
			got[i].Limit == want[i].Limit && got[i].Key == want[i].Key && got[i].Fence > 0 &&
			time.Until(got[i].ExpiresAt) > 0 && time.Until(got[i].ExpiresAt) <= want[i].TTL+time.Second
	}
	if !ok {
		var w []dlock.LockInfo
		for _, r := range want {
			w = append(w, dlock.LockInfo{Token: r.Token, Metadata: r.Metadata})
		}
		t.Fatalf("holders after %s: %v (%+v), want %v", what, tokens(got), got, tokens(w))
	}
}

// TestWatchHoldersClosesOnGap: a change whose message the watch did not
// get (here: counted without a message) closes the watch at the next
// message instead of merging it with the change after it; and so does a
// message without a change number (a client of an older version).
func TestWatchHoldersClosesOnGap(t *testing.T) {
	c, b, ctx, k := fixture(t, "holdersgap")
	_, ch := mustWatchHolders(t, b, k)
	x := modeReq(k, dlock.ModeExclusive, 0, 30*time.Second)
	mustGrant(t, b, x)
	wantHolders(t, next(t, ch, "a grant"), "a grant", x)
	if err := c.Incr(ctx, b.ChangesKey(k)).Err(); err != nil {
		t.Fatal(err)
	}
	if err := b.Release(ctx, k, x.Token); err != nil {
		t.Fatal(err)
	}
	holdersClose(t, ch, "a change without its message")

	_, ch = mustWatchHolders(t, b, k)
	if err := c.SPublish(ctx, b.WatchChannel(k), "granted").Err(); err != nil {
		t.Fatal(err)
	}
	mustGrant(t, b, x)
	holdersClose(t, ch, "a message without a change number")
}

// TestWatchHoldersClosesOnManyHolders: a change that leaves more holders
// than its message carries closes the watch.
func TestWatchHoldersClosesOnManyHolders(t *testing.T) {
	_, b, _, k := fixture(t, "holdersmany")
	_, ch := mustWatchHolders(t, b, k)
	for i := range 101 {
		mustGrant(t, b, modeReq(k, dlock.ModeLimited, 200, 30*time.Second))
		if i < 100 {
			if hs := next(t, ch, "a limited grant"); len(hs) != i+1 {
				t.Fatalf("after %d grants: %d holders", i+1, len(hs))
			}
		}
	}
	holdersClose(t, ch, "a grant that leaves 101 holders")
	now, _ := mustWatchHolders(t, b, k)
	if len(now) != 101 {
		t.Errorf("the read after: %d holders, want 101", len(now))
	}
}

// TestWatchHoldersEndsWithContext: WatchHolders returns when ctx ends, on a
// server that stopped answering, and an established watch closes with its
// ctx.
func TestWatchHoldersEndsWithContext(t *testing.T) {
	s := startServer(t)
	_, b, _, k := fixture(t, "holdersctx")
	ctx, cancel := context.WithCancel(context.Background())
	_, ch, err := b.WatchHolders(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	cancel()
	holdersClose(t, ch, "its context ended")

	p := newStallProxy(t, s.addr())
	stalled := newBackend(t, newClient(t, p.addr), nil)
	// Subscribing works; the read of the holders gets no answer.
	// No read timeout: only the cancellation can end the wait.
	slow := redis.NewClient(&redis.Options{Addr: p.addr, ReadTimeout: -1})
	t.Cleanup(func() { slow.Close() })
	split := newBackend(t, scriptsVia{s.client(t), slow}, nil)
	p.stall()
	for name, b := range map[string]*redislock.Backend{"subscription": stalled, "read": split} {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		time.AfterFunc(200*time.Millisecond, cancel)
		returned := make(chan error, 1)
		go func() {
			_, _, err := b.WatchHolders(ctx, locktest.UniqueKey("holdersctx"))
			returned <- err
		}()
		select {
		case err := <-returned:
			if !errors.Is(err, context.Canceled) {
				t.Errorf("WatchHolders with a stalled %s: %v, want the context's error", name, err)
			}
		case <-time.After(watchBound):
			t.Fatalf("rule: WatchHolders returns when its context ends; still running %s after, with a stalled %s", watchBound, name)
		}
	}
}

// scriptsVia is a client that runs scripts on another client.
type scriptsVia struct {
	*redis.Client
	scripts *redis.Client
}

func (c scriptsVia) Eval(ctx context.Context, script string, keys []string, args ...any) *redis.Cmd {
	return c.scripts.Eval(ctx, script, keys, args...)
}

func (c scriptsVia) EvalSha(ctx context.Context, sha1 string, keys []string, args ...any) *redis.Cmd {
	return c.scripts.EvalSha(ctx, sha1, keys, args...)
}

// TestWatchHoldersClassicAndSentinel: a holder watch works on a server
// without sharded pub/sub (as before Redis 7), on classic channels, and
// through a Sentinel-discovered client.
func TestWatchHoldersClassicAndSentinel(t *testing.T) {
	classic := startServer(t, "--rename-command", "SPUBLISH", "", "--rename-command", "SSUBSCRIBE", "")
	_, sentinel := startSentinel(t)
	failover := redis.NewFailoverClient(&redis.FailoverOptions{MasterName: "primary", SentinelAddrs: []string{sentinel.addr()}})
	t.Cleanup(func() { failover.Close() })
	for name, c := range map[string]redislock.Client{"classic": classic.client(t), "sentinel": failover} {
		t.Run(name, func(t *testing.T) {
			b := newBackend(t, c, nil)
			ctx, k := ctxT(t, 30*time.Second), locktest.UniqueKey("holders"+name)
			_, ch := mustWatchHolders(t, b, k)
			req := modeReq(k, dlock.ModeExclusive, 0, 30*time.Second)
			mustGrant(t, b, req)
			if err := b.SetMetadata(ctx, k, req.Token, "v2"); err != nil {
				t.Fatal(err)
			}
			if err := b.Release(ctx, k, req.Token); err != nil {
				t.Fatal(err)
			}
			wantHolders(t, next(t, ch, "a grant"), "a grant", req)
			req.Metadata = "v2"
			wantHolders(t, next(t, ch, "a metadata change"), "a metadata change", req)
			wantHolders(t, next(t, ch, "a release"), "a release")
		})
	}
}

package sqlitelock_test

import (
	"context"
	"errors"
	"os"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/sqlitelock"
)

// listed returns the metadata that List shows for the holder of key with tok.
func listed(t *testing.T, b *sqlitelock.Backend, key string, tok dlock.Token) string {
	t.Helper()
	infos, err := b.List(context.Background(), key)
	if err != nil {
		t.Fatal(err)
	}
	for _, in := range infos {
		if in.Key == key && in.Token == tok {
			return in.Metadata
		}
	}
	return "(not listed)"
}

func setter(t *testing.T, b dlock.Backend) dlock.MetadataSetter {
	t.Helper()
	ms, ok := b.(dlock.MetadataSetter)
	if !ok {
		t.Fatalf("%T does not implement dlock.MetadataSetter", b)
	}
	return ms
}

// TestSetMetadataEveryMode checks that exclusive, shared and limited
// holders each set their own row's metadata (the value they have too),
// which another process's List shows, and that a released or expired
// holder's token changes nothing.
func TestSetMetadataEveryMode(t *testing.T) {
	b := migrated(t)
	other := open(t, os.Getenv(envDB))
	ms := setter(t, b)
	ctx := context.Background()
	for _, m := range []struct {
		mode  dlock.Mode
		limit int
	}{{dlock.ModeExclusive, 0}, {dlock.ModeShared, 0}, {dlock.ModeLimited, 2}} {
		t.Run(m.mode.String(), func(t *testing.T) {
			k := "meta/" + m.mode.String() + "/" + dlock.NewToken().String()
			a := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 30 * time.Second, Metadata: "a1", Mode: m.mode, Limit: m.limit}
			if res, err := b.Acquire(ctx, a); err != nil || !res.Acquired {
				t.Fatalf("Acquire: %+v %v", res, err)
			}
			for _, v := range []string{"a2", "a2"} {
				if err := ms.SetMetadata(ctx, k, a.Token, v); err != nil {
					t.Fatalf("SetMetadata %s by the %s holder: %v", v, m.mode, err)
				}
			}
			if got := listed(t, other, k, a.Token); got != "a2" {
				t.Fatalf("List shows %q, want a2", got)
			}
			if err := ms.SetMetadata(ctx, k, dlock.NewToken(), "x"); !errors.Is(err, dlock.ErrNotHeld) {
				t.Fatalf("SetMetadata by another token: %v, want ErrNotHeld", err)
			}
			if err := b.Release(ctx, k, a.Token); err != nil {
				t.Fatal(err)
			}
			if err := ms.SetMetadata(ctx, k, a.Token, "a3"); !errors.Is(err, dlock.ErrNotHeld) {
				t.Fatalf("SetMetadata after Release: %v, want ErrNotHeld", err)
			}
			// An expired lease, never renewed, is not its holder's.
			e := a
			e.Token, e.TTL = dlock.NewToken(), time.Second
			if res, err := b.Acquire(ctx, e); err != nil || !res.Acquired {
				t.Fatalf("Acquire: %+v %v", res, err)
			}
			time.Sleep(1100 * time.Millisecond)
			if err := ms.SetMetadata(ctx, k, e.Token, "late"); !errors.Is(err, dlock.ErrNotHeld) {
				t.Fatalf("SetMetadata of an expired lease: %v, want ErrNotHeld", err)
			}
		})
	}
}

// TestElectionProclaim checks that a leader's Proclaim changes what Leader
// and another process's Observe report (the conformance suite runs
// elections over a wrapper that hides dlock.MetadataSetter).
func TestElectionProclaim(t *testing.T) {
	migrated(t)
	path := os.Getenv(envDB)
	k := "elected/" + dlock.NewToken().String()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	leader := dlock.New(open(t, path), nil)
	defer leader.Close(context.Background())
	observer := dlock.New(open(t, path), nil)
	defer observer.Close(context.Background())
	term, err := dlock.NewElection(leader, k).Campaign(ctx, "a:1")
	if err != nil {
		t.Fatal(err)
	}
	octx, stop := context.WithCancel(ctx)
	seen := dlock.NewElection(observer, k).Observe(octx)
	if ld := <-seen; ld.Value != "a:1" {
		t.Fatalf("Observe: %+v, want a:1", ld)
	}
	if err := term.Proclaim(ctx, "a:2"); err != nil {
		t.Fatalf("Proclaim: %v", err)
	}
	select {
	case ld := <-seen:
		if ld.Value != "a:2" || ld.Fence != term.Fence() {
			t.Fatalf("Observe after Proclaim: %+v, want a:2", ld)
		}
	case <-ctx.Done():
		t.Fatal("Observe did not report the proclaimed value")
	}
	stop()
	for range seen {
	}
	if err := term.Resign(ctx); err != nil {
		t.Fatal(err)
	}
	if err := term.Proclaim(ctx, "a:3"); !errors.Is(err, dlock.ErrNotHeld) {
		t.Fatalf("Proclaim after Resign: %v, want ErrNotHeld", err)
	}
}

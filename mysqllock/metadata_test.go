package mysqllock_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
)

// strategy builds one of the three strategies over a pool with extra DSN
// parameters, and names the table that keeps its holders' metadata.
type strategy struct {
	name  string
	table string
	build func(t *testing.T, params string) dlock.Backend
}

var strategies = []strategy{
	{"lease", testTable, func(t *testing.T, p string) dlock.Backend { return newBackend(t, p) }},
	{"getlock", testTable + "_session", func(t *testing.T, p string) dlock.Backend { return newGetLock(t, p) }},
	{"rowlock", testTable + "_session", func(t *testing.T, p string) dlock.Backend { return newRowLock(t, p) }},
}

// setter returns b as a dlock.MetadataSetter, failing the test if it is not one.
func setter(t *testing.T, b dlock.Backend) dlock.MetadataSetter {
	t.Helper()
	ms, ok := b.(dlock.MetadataSetter)
	if !ok {
		t.Fatalf("%T does not implement dlock.MetadataSetter", b)
	}
	return ms
}

// listed returns the metadata that List shows for the holder of key with tok.
func listed(t *testing.T, b dlock.Backend, key string, tok dlock.Token) string {
	t.Helper()
	infos, err := b.(dlock.Lister).List(context.Background(), key)
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

func acquire(t *testing.T, b dlock.Backend, req dlock.Request) dlock.Result {
	t.Helper()
	if req.Token == (dlock.Token{}) {
		req.Token = dlock.NewToken()
	}
	res, err := b.Acquire(context.Background(), req)
	if err != nil || !res.Acquired {
		t.Fatalf("Acquire %+v: %+v %v", req, res, err)
	}
	t.Cleanup(func() { _ = b.Release(context.Background(), req.Key, req.Token) })
	return res
}

// TestSetMetadataSameValue checks that the holder setting the value it
// already has succeeds, on every strategy, with and without the DSN
// settings that change what the server reports: a row that a statement
// leaves unchanged reports no affected row (and clientFoundRows reports
// every matched row), so neither tells whether the holder matched.
func TestSetMetadataSameValue(t *testing.T) {
	needServer(t)
	for _, params := range []string{"", "clientFoundRows=true&interpolateParams=true"} {
		for _, s := range strategies {
			t.Run(s.name+"/"+params, func(t *testing.T) {
				b := s.build(t, params)
				ms := setter(t, b)
				ctx := context.Background()
				req := dlock.Request{Key: "meta/same/" + dlock.NewToken().String(), Token: dlock.NewToken(), TTL: 30 * time.Second, Metadata: "v1"}
				acquire(t, b, req)
				for range 2 {
					if err := ms.SetMetadata(ctx, req.Key, req.Token, "v1"); err != nil {
						t.Fatalf("SetMetadata of the value held: %v", err)
					}
				}
				if err := ms.SetMetadata(ctx, req.Key, dlock.NewToken(), "v1"); !errors.Is(err, dlock.ErrNotHeld) {
					t.Fatalf("SetMetadata by another token, same value: %v, want ErrNotHeld", err)
				}
				if err := ms.SetMetadata(ctx, req.Key, req.Token, "v2"); err != nil {
					t.Fatal(err)
				}
				if got := listed(t, b, req.Key, req.Token); got != "v2" {
					t.Fatalf("List shows %q, want v2", got)
				}
			})
		}
	}
}

// TestSetMetadataSharedAndLimited checks that shared and limited holders
// each set their own row's metadata, which List shows, and that a released
// holder's token changes nothing.
func TestSetMetadataSharedAndLimited(t *testing.T) {
	b := newBackend(t, "")
	ms := setter(t, b)
	ctx := context.Background()
	for _, mode := range []struct {
		mode  dlock.Mode
		limit int
	}{{dlock.ModeShared, 0}, {dlock.ModeLimited, 3}} {
		t.Run(mode.mode.String(), func(t *testing.T) {
			k := "meta/" + mode.mode.String() + "/" + dlock.NewToken().String()
			a := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 30 * time.Second, Metadata: "a1", Mode: mode.mode, Limit: mode.limit}
			c := a
			c.Token, c.Metadata = dlock.NewToken(), "c1"
			acquire(t, b, a)
			acquire(t, b, c)
			if err := ms.SetMetadata(ctx, k, a.Token, "a2"); err != nil {
				t.Fatalf("SetMetadata by a %s holder: %v", mode.mode, err)
			}
			if err := ms.SetMetadata(ctx, k, a.Token, "a2"); err != nil {
				t.Fatalf("SetMetadata of the value held: %v", err)
			}
			if got := listed(t, b, k, a.Token); got != "a2" {
				t.Fatalf("List shows %q for the holder that set a2", got)
			}
			if got := listed(t, b, k, c.Token); got != "c1" {
				t.Fatalf("List shows %q for the other holder, want c1", got)
			}
			if err := b.Release(ctx, k, c.Token); err != nil {
				t.Fatal(err)
			}
			if err := ms.SetMetadata(ctx, k, c.Token, "c2"); !errors.Is(err, dlock.ErrNotHeld) {
				t.Fatalf("SetMetadata by a released holder: %v, want ErrNotHeld", err)
			}
			if got := listed(t, b, k, a.Token); got != "a2" {
				t.Fatalf("List shows %q after a refused SetMetadata, want a2", got)
			}
		})
	}
}

// TestSetMetadataExpiredLease checks that a lease expired by the server's
// clock, exclusive or shared, is not the holder's any more: SetMetadata is
// ErrNotHeld and the row keeps its metadata.
func TestSetMetadataExpiredLease(t *testing.T) {
	b := newBackend(t, "")
	ms := setter(t, b)
	db := open(t, "")
	ctx := context.Background()
	k := "meta/expired/" + dlock.NewToken().String()
	excl := dlock.Request{Key: k, Token: dlock.NewToken(), TTL: time.Second, Metadata: "x1"}
	acquire(t, b, excl)
	ks := k + "/shared"
	shared := dlock.Request{Key: ks, Token: dlock.NewToken(), TTL: time.Second, Metadata: "s1", Mode: dlock.ModeShared}
	acquire(t, b, shared)
	time.Sleep(1200 * time.Millisecond)
	for _, c := range []struct {
		req   dlock.Request
		table string
	}{{excl, testTable}, {shared, testTable + "_holders"}} {
		if err := ms.SetMetadata(ctx, c.req.Key, c.req.Token, "late"); !errors.Is(err, dlock.ErrNotHeld) {
			t.Errorf("SetMetadata of an expired %s lease: %v, want ErrNotHeld", c.req.Mode, err)
		}
		var md string
		if err := db.QueryRowContext(ctx, "SELECT metadata FROM "+c.table+" WHERE name = ? AND token = ?", c.req.Key, c.req.Token[:]).Scan(&md); err != nil {
			t.Fatal(err)
		}
		if md != c.req.Metadata {
			t.Errorf("an expired %s lease's metadata became %q", c.req.Mode, md)
		}
	}
}

// TestSetMetadataCallerDeadlineKeepsLocks checks that a SetMetadata whose
// caller's deadline ends while its statement waits (here for a lock on
// the key's row that another client holds) leaves every lock of the caller held: on the
// session strategies the statement must not run under the caller's
// deadline on the session that holds them, which the driver would close.
func TestSetMetadataCallerDeadlineKeepsLocks(t *testing.T) {
	needServer(t)
	for _, s := range strategies {
		t.Run(s.name, func(t *testing.T) {
			b := s.build(t, "")
			ms := setter(t, b)
			var lost []string
			if lr, ok := b.(dlock.LossReporter); ok {
				stop := lr.OnLoss(func(key string, _ dlock.Token, cause error) { lost = append(lost, key+": "+cause.Error()) })
				defer stop()
			}
			ctx := context.Background()
			prefix := "meta/deadline/" + dlock.NewToken().String()
			a := dlock.Request{Key: prefix + "/a", Token: dlock.NewToken(), TTL: 30 * time.Second, Metadata: "a1"}
			c := dlock.Request{Key: prefix + "/c", Token: dlock.NewToken(), TTL: 30 * time.Second, Metadata: "c1"}
			acquire(t, b, a)
			acquire(t, b, c)

			unblock := blockRow(t, s.table, a.Key)
			dctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
			err := ms.SetMetadata(dctx, a.Key, a.Token, "a2")
			cancel()
			unblock()
			if err == nil || errors.Is(err, dlock.ErrNotHeld) {
				t.Fatalf("SetMetadata cut by its caller's deadline: %v, want an error of unknown outcome", err)
			}
			errs, err := b.Extend(ctx, []dlock.Lease{{Key: a.Key, Token: a.Token, TTL: 30 * time.Second}, {Key: c.Key, Token: c.Token, TTL: 30 * time.Second}})
			if err != nil || errs[0] != nil || errs[1] != nil {
				t.Fatalf("rule: a caller's deadline on SetMetadata never disturbs other locks; Extend after it: %v %v", errs, err)
			}
			if len(lost) > 0 {
				t.Fatalf("rule: a caller's deadline on SetMetadata never disturbs other locks; reported lost: %v", lost)
			}
			if err := ms.SetMetadata(ctx, a.Key, a.Token, "a3"); err != nil {
				t.Fatal(err)
			}
			if got := listed(t, b, a.Key, a.Token); got != "a3" {
				t.Fatalf("List shows %q, want a3", got)
			}
		})
	}
}

// TestElectionProclaim checks that a leader's Proclaim on each strategy
// changes what Leader and Observe report (the conformance suite runs
// elections over a wrapper that hides dlock.MetadataSetter).
func TestElectionProclaim(t *testing.T) {
	needServer(t)
	for _, s := range strategies {
		t.Run(s.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			k := "meta/election/" + dlock.NewToken().String()
			leader := dlock.New(s.build(t, ""), nil)
			defer leader.Close(context.Background())
			observer := dlock.New(s.build(t, ""), nil)
			defer observer.Close(context.Background())
			e := dlock.NewElection(leader, k)
			term, err := e.Campaign(ctx, "a:1", dlock.WithTTL(3*time.Second))
			if err != nil {
				t.Fatal(err)
			}
			octx, stop := context.WithCancel(ctx)
			seen := dlock.NewElection(observer, k).Observe(octx)
			if ld := <-seen; ld.Value != "a:1" || ld.Fence != term.Fence() {
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
			if ld, err := dlock.NewElection(observer, k).Leader(ctx); err != nil || ld.Value != "a:2" {
				t.Fatalf("Leader: %+v %v, want a:2", ld, err)
			}
			if err := term.Resign(ctx); err != nil {
				t.Fatal(err)
			}
			if err := term.Proclaim(ctx, "a:3"); !errors.Is(err, dlock.ErrNotHeld) {
				t.Fatalf("Proclaim after Resign: %v, want ErrNotHeld", err)
			}
		})
	}
}

// blockRow has another client lock key's row of table until unblock: a row
// lock (FOR UPDATE) in an InnoDB table, a lock of the whole table in a
// MEMORY one (the session strategies'), which has no row locks.
func blockRow(t *testing.T, table, key string) (unblock func()) {
	t.Helper()
	ctx := context.Background()
	db := open(t, "")
	var engine string
	if err := db.QueryRowContext(ctx, "SELECT ENGINE FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?", table).Scan(&engine); err != nil {
		t.Fatal(err)
	}
	if engine == "MEMORY" {
		conn, err := db.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := conn.ExecContext(ctx, "LOCK TABLES `"+table+"` WRITE"); err != nil {
			t.Fatal(err)
		}
		return func() {
			_, _ = conn.ExecContext(ctx, "UNLOCK TABLES")
			conn.Close()
		}
	}
	blocker, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	var name []byte
	if err := blocker.QueryRowContext(ctx, "SELECT name FROM `"+table+"` WHERE name = ? FOR UPDATE", key).Scan(&name); err != nil {
		t.Fatal(err)
	}
	return func() { _ = blocker.Rollback() }
}

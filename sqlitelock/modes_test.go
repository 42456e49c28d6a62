package sqlitelock_test

import (
	"context"
	"database/sql"
	_ "embed"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/sqlitelock"
)

// exclusiveOnlySchema is the table as it was before shared and limited
// modes: files made then must keep working, with their fences.
//
//go:embed testdata/schema-exclusive-only.sql
var exclusiveOnlySchema string

func request(k string, m dlock.Mode, limit int) dlock.Request {
	return dlock.Request{Key: k, Token: dlock.NewToken(), TTL: 10 * time.Second, Mode: m, Limit: limit}
}

func testKey(t *testing.T, suffix string) string {
	return fmt.Sprintf("%s/%d/%s", t.Name(), time.Now().UnixNano(), suffix)
}

// acquire is b.Acquire that fails t on an error.
func acquire(t *testing.T, b dlock.Backend, req dlock.Request) dlock.Result {
	t.Helper()
	res, err := b.Acquire(context.Background(), req)
	if err != nil {
		t.Fatalf("Acquire(%q, %s): %v", req.Key, req.Mode, err)
	}
	return res
}

// oldFile makes a WAL-mode file with the exclusive-only table, as Open and
// Migrate made it: "held" held by the returned token for a minute with
// fence 41, "gone" free with fence 7.
func oldFile(t *testing.T) (string, dlock.Token) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "old.db")
	db, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)")
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	tok := dlock.NewToken()
	const nowUs = "CAST(unixepoch('now', 'subsec') * 1000000 AS INTEGER)"
	for _, q := range []struct {
		stmt string
		args []any
	}{
		{exclusiveOnlySchema, nil},
		{"INSERT INTO dlock_locks VALUES ('held', ?, 'alice', 41, " + nowUs + ", " + nowUs + " + 60000000, 'm')", []any{tok[:]}},
		{"INSERT INTO dlock_locks VALUES ('gone', ?, '', 7, 0, 1, '')", []any{dlock.NewToken().String()}},
	} {
		if _, err := db.Exec(q.stmt, q.args...); err != nil {
			t.Fatal(err)
		}
	}
	return path, tok
}

// TestMigrateUpgradesExclusiveOnlyTable checks that Migrate brings a file
// made before shared modes up to date without losing a holder or a fence.
func TestMigrateUpgradesExclusiveOnlyTable(t *testing.T) {
	path, tok := oldFile(t)
	b := open(t, path)
	ctx := context.Background()
	if err := b.Migrate(ctx); err != nil {
		t.Fatalf("Migrate of an exclusive-only file: %v", err)
	}
	ls, err := b.List(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	if len(ls) != 1 || ls[0].Key != "held" || ls[0].Token != tok || ls[0].Fence != 41 || ls[0].Owner != "alice" || ls[0].Mode != dlock.ModeExclusive {
		t.Fatalf("the holder from before the upgrade: %+v", ls)
	}
	if res := acquire(t, b, request("held", dlock.ModeShared, 0)); res.Acquired || res.Holder.Fence != 41 {
		t.Errorf("a shared request next to the old exclusive holder: %+v", res)
	}
	errs, err := b.Extend(ctx, []dlock.Lease{{Key: "held", Token: tok, TTL: time.Minute}})
	if err != nil || errs[0] != nil {
		t.Errorf("the old holder's renewal: %v %v", errs, err)
	}
	if err := b.Release(ctx, "held", tok); err != nil {
		t.Errorf("the old holder's release: %v", err)
	}
	ks, err := b.ListKeys(ctx, "")
	if err != nil || len(ks) != 2 {
		t.Fatalf("ListKeys after the upgrade: %+v, %v", ks, err)
	}
	if g := ks[0]; g.Key != "gone" || g.Fence != 7 || !g.Expired || g.Last == nil || g.FreedAt.Year() != 1970 {
		t.Errorf("a key that expired before the upgrade: %+v", g)
	}
	if h := ks[1]; h.Key != "held" || h.Fence != 41 || h.Expired || h.Last == nil || h.Last.Owner != "alice" || time.Since(h.FreedAt) > time.Minute {
		t.Errorf("a key released after the upgrade: %+v", h)
	}
	last := map[string]uint64{"held": 41, "gone": 7}
	for _, c := range []struct {
		key   string
		mode  dlock.Mode
		limit int
	}{{"held", dlock.ModeShared, 0}, {"gone", dlock.ModeLimited, 2}, {"gone", dlock.ModeLimited, 2}} {
		res := acquire(t, b, request(c.key, c.mode, c.limit))
		if !res.Acquired || res.Fence <= last[c.key] {
			t.Errorf("%s %q after the upgrade: %+v, want a fence above %d (the counter goes on)", c.mode, c.key, res, last[c.key])
		}
		last[c.key] = res.Fence
	}
	if err := b.Migrate(ctx); err != nil {
		t.Errorf("Migrate of an upgraded file: %v", err)
	}
}

// TestConcurrentMigrateUpgrades starts Migrate on one exclusive-only file
// from several connections at once: each must succeed, and the upgrade
// happen once.
func TestConcurrentMigrateUpgrades(t *testing.T) {
	path, _ := oldFile(t)
	const n = 8
	errs := make([]error, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		b := open(t, path)
		wg.Go(func() {
			<-start
			errs[i] = b.Migrate(context.Background())
		})
	}
	close(start)
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("Migrate %d: %v", i, err)
		}
	}
	if res := acquire(t, open(t, path), request("gone", dlock.ModeShared, 0)); !res.Acquired || res.Fence <= 7 {
		t.Errorf("after concurrent upgrades: %+v, want a fence above 7", res)
	}
}

// race runs one Acquire per backend at once, and returns the results.
func race(t *testing.T, bs []dlock.Backend, req func(i int) dlock.Request) []dlock.Result {
	t.Helper()
	out := make([]dlock.Result, len(bs))
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i, b := range bs {
		wg.Go(func() {
			r := req(i)
			<-start
			res, err := b.Acquire(context.Background(), r)
			if err != nil {
				t.Errorf("Acquire %s: %v", r.Mode, err)
			}
			out[i] = res
		})
	}
	close(start)
	wg.Wait()
	return out
}

// backends returns n Backends on the test file, migrated, each with its
// own connections, as n processes would have.
func backends(t *testing.T, n int) []dlock.Backend {
	out := make([]dlock.Backend, n)
	for i := range out {
		out[i] = migrated(t)
	}
	return out
}

// migrated opens the test file and migrates it.
func migrated(t *testing.T) *sqlitelock.Backend {
	t.Helper()
	b := open(t, os.Getenv(envDB))
	if err := b.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return b
}

// TestModeChecksAreAtomic races acquisitions of one key from separate
// connections: the check of the key's holders and the grant must be one
// step, or two racers that both saw a free slot would both take it.
func TestModeChecksAreAtomic(t *testing.T) {
	bs := backends(t, 12)
	const limit = 3
	for round := range 5 {
		k := testKey(t, fmt.Sprint(round))
		n := 0
		for _, res := range race(t, bs, func(int) dlock.Request { return request(k, dlock.ModeLimited, limit) }) {
			if res.Acquired {
				n++
			}
		}
		if n != limit {
			t.Errorf("round %d: %d of %d racers hold a key limited to %d", round, n, len(bs), limit)
		}
	}
	for round := range 10 {
		k := testKey(t, fmt.Sprint(round))
		var excl, shared int
		res := race(t, bs, func(i int) dlock.Request {
			if i%2 == 0 {
				return request(k, dlock.ModeExclusive, 0)
			}
			return request(k, dlock.ModeShared, 0)
		})
		for i, r := range res {
			switch {
			case !r.Acquired:
			case i%2 == 0:
				excl++
			default:
				shared++
			}
		}
		if excl > 1 || excl == 1 && shared > 0 || excl+shared == 0 {
			t.Errorf("round %d: %d exclusive and %d shared holders at once", round, excl, shared)
		}
	}
}

// TestWithoutImmediateTransactions drives shared and limited acquisitions
// through Backends over databases opened without _txlock=immediate, as New
// allows: their transactions must wait for each other (busy timeout), not
// fail with SQLITE_BUSY.
func TestWithoutImmediateTransactions(t *testing.T) {
	migrated(t)
	path := os.Getenv(envDB)
	k := testKey(t, "k")
	var wg sync.WaitGroup
	for i := range 6 {
		db, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(10000)")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { db.Close() })
		b := sqlitelock.New(db)
		wg.Go(func() {
			for j := range 25 {
				req := request(k, dlock.ModeShared, 0)
				if i%2 == 1 {
					req = request(k+"/limited", dlock.ModeLimited, 2)
				}
				res, err := b.Acquire(context.Background(), req)
				if err != nil {
					t.Errorf("backend %d, round %d: %v", i, j, err)
					return
				}
				if res.Acquired {
					if err := b.Release(context.Background(), req.Key, req.Token); err != nil {
						t.Errorf("backend %d, round %d: release: %v", i, j, err)
						return
					}
				}
			}
		})
	}
	wg.Wait()
}

// TestWriterMarkLapses checks both ends of writer preference on one file: a
// writer that found readers keeps new readers out, with the mark's end as
// the hint, and a writer that gave up holds them back for WriterMark only.
func TestWriterMarkLapses(t *testing.T) {
	b := migrated(t)
	k := testKey(t, "k")
	if !acquire(t, b, request(k, dlock.ModeShared, 0)).Acquired {
		t.Fatal("the first reader was refused")
	}
	if res := acquire(t, b, request(k, dlock.ModeExclusive, 0)); res.Acquired || res.Holder.Mode != dlock.ModeShared || res.Remaining <= 0 {
		t.Fatalf("a writer next to a reader: %+v, want refused, naming the reader and its lease", res)
	}
	res := acquire(t, b, request(k, dlock.ModeShared, 0))
	if res.Acquired || res.Remaining <= 0 || res.Remaining > dlock.WriterMark {
		t.Fatalf("a reader behind the writer: %+v, want refused for at most %s", res, dlock.WriterMark)
	}
	time.Sleep(res.Remaining + 10*time.Millisecond)
	if res := acquire(t, b, request(k, dlock.ModeShared, 0)); !res.Acquired {
		t.Errorf("a reader %s after the writer gave up: %+v, want it granted", dlock.WriterMark, res)
	}
}

// TestRefusalsNameAHolder checks what a refused shared or limited request
// reports: the holder whose lease ends first, with its mode, and its
// remaining lease (the Locker's waiters sleep no longer than that).
func TestRefusalsNameAHolder(t *testing.T) {
	b := migrated(t)
	k := testKey(t, "limited")
	first := request(k, dlock.ModeLimited, 2)
	first.TTL = 5 * time.Second
	f := acquire(t, b, first)
	acquire(t, b, request(k, dlock.ModeLimited, 2))
	res := acquire(t, b, request(k, dlock.ModeLimited, 2))
	if res.Acquired || res.Holder.Token != first.Token || res.Holder.Fence != f.Fence || res.Holder.Mode != dlock.ModeLimited ||
		res.Holder.Limit != 2 || res.Remaining <= 0 || res.Remaining > first.TTL {
		t.Errorf("a full limited key: %+v, want the first holder (fence %d) and its remaining lease", res, f.Fence)
	}
	k = testKey(t, "shared")
	w := request(k, dlock.ModeExclusive, 0)
	acquire(t, b, w)
	res = acquire(t, b, request(k, dlock.ModeShared, 0))
	if res.Acquired || res.Holder.Token != w.Token || res.Holder.Mode != dlock.ModeExclusive || res.Remaining <= 0 || res.Remaining > w.TTL {
		t.Errorf("a reader next to a writer: %+v, want the writer and its remaining lease", res)
	}
}

// TestListAndForceReleaseSeeEveryHolder checks that List shows each holder
// of every mode with its mode and limit, in key then fence order, and that
// ForceRelease frees every holder of a key.
func TestListAndForceReleaseSeeEveryHolder(t *testing.T) {
	b := migrated(t)
	ctx := context.Background()
	base := testKey(t, "")
	reqs := []dlock.Request{
		request(base+"a", dlock.ModeShared, 0),
		request(base+"a", dlock.ModeShared, 0),
		request(base+"b", dlock.ModeLimited, 3),
		request(base+"c", dlock.ModeExclusive, 0),
	}
	fences := make([]uint64, len(reqs))
	for i, r := range reqs {
		res := acquire(t, b, r)
		if !res.Acquired {
			t.Fatalf("Acquire %d: %+v", i, res)
		}
		fences[i] = res.Fence
	}
	ls, err := b.List(ctx, base)
	if err != nil {
		t.Fatal(err)
	}
	if len(ls) != len(reqs) {
		t.Fatalf("List: %d holders, want %d: %+v", len(ls), len(reqs), ls)
	}
	for i, r := range reqs {
		if l := ls[i]; l.Key != r.Key || l.Token != r.Token || l.Fence != fences[i] || l.Mode != r.Mode || l.Limit != r.Limit {
			t.Errorf("List[%d] = %+v, want key %q mode %s limit %d fence %d", i, l, r.Key, r.Mode, r.Limit, fences[i])
		}
	}
	if err := b.ForceRelease(ctx, base+"a"); err != nil {
		t.Fatal(err)
	}
	for _, r := range reqs[:2] {
		if err := b.Release(ctx, r.Key, r.Token); !errors.Is(err, dlock.ErrNotHeld) {
			t.Errorf("Release after ForceRelease: %v, want ErrNotHeld", err)
		}
	}
	if err := b.ForceRelease(ctx, base+"a"); !errors.Is(err, dlock.ErrNotHeld) {
		t.Errorf("ForceRelease of a freed key: %v, want ErrNotHeld", err)
	}
	if err := b.ForceRelease(ctx, base+"b"); err != nil {
		t.Errorf("ForceRelease of a limited key: %v", err)
	}
}

// TestListKeysAfterSharedHolders checks that a key whose last holder was
// shared names no last holder (the row keeps only exclusive ones) and says
// when it was released.
func TestListKeysAfterSharedHolders(t *testing.T) {
	b := open(t, filepath.Join(t.TempDir(), "locks.db"))
	ctx := context.Background()
	if err := b.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	k := testKey(t, "k")
	ex := request(k, dlock.ModeExclusive, 0)
	ex.Owner = "writer"
	acquire(t, b, ex)
	if err := b.Release(ctx, k, ex.Token); err != nil {
		t.Fatal(err)
	}
	sh := request(k, dlock.ModeShared, 0)
	res := acquire(t, b, sh)
	if !res.Acquired {
		t.Fatalf("shared acquisition of a free key: %+v", res)
	}
	before := time.Now()
	if err := b.Release(ctx, k, sh.Token); err != nil {
		t.Fatal(err)
	}
	ks, err := b.ListKeys(ctx, k)
	if err != nil || len(ks) != 1 {
		t.Fatalf("ListKeys: %+v, %v", ks, err)
	}
	if g := ks[0]; g.Fence != res.Fence || g.Last != nil || g.Expired || g.FreedAt.Before(before.Add(-time.Second)) || len(g.Holders) != 0 {
		t.Errorf("a key last held shared: %+v; want fence %d, no last holder, freed after %v", g, res.Fence, before)
	}
}

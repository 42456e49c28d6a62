package pglock_test

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/pglock"
	"github.com/jackc/pgx/v5/pgxpool"
)

// req returns an acquisition request for key in mode m (limit for
// ModeLimited).
func req(key string, ttl time.Duration, m dlock.Mode, limit int) dlock.Request {
	return dlock.Request{Key: key, Token: dlock.NewToken(), TTL: ttl, Mode: m, Limit: limit}
}

func mustGrant(t *testing.T, b dlock.Backend, r dlock.Request) uint64 {
	t.Helper()
	res, err := b.Acquire(t.Context(), r)
	if err != nil || !res.Acquired {
		t.Fatalf("Acquire %s of %q: %+v, %v; want acquired", r.Mode, r.Key, res, err)
	}
	return res.Fence
}

func mustRefuse(t *testing.T, b dlock.Backend, r dlock.Request, why string) dlock.Result {
	t.Helper()
	res, err := b.Acquire(t.Context(), r)
	if err != nil || res.Acquired {
		if res.Acquired {
			b.Release(context.Background(), r.Key, r.Token)
		}
		t.Fatalf("rule: %s; Acquire %s of %q: %+v, %v; want refused", why, r.Mode, r.Key, res, err)
	}
	return res
}

// TestMigrateUpgradesV1Tables creates the lease table of the previous
// schema (testdata/schema_v1.sql, exclusive holders only) with a held key,
// a waiter queued for it and a free key in it, migrates it, and checks that
// the waiter stays queued (as an exclusive waiter), that both keys' fences
// go on from where they were and that the held lease still excludes every
// mode.
func TestMigrateUpgradesV1Tables(t *testing.T) {
	ctx := t.Context()
	pool, table := v1Tables(t)
	held, free, tok, other := "upgrade/held", "upgrade/free", dlock.NewToken(), dlock.NewToken()
	if _, err := pool.Exec(ctx, `INSERT INTO "`+table+`" (name, token, owner, fence, acquired_at, expires_at, metadata) VALUES
  ($1, $2, 'old', 41, clock_timestamp(), clock_timestamp() + interval '1 hour', ''),
  ($3, $4, 'old', 7, clock_timestamp() - interval '1 hour', clock_timestamp() - interval '1 minute', '')`,
		[]byte(held), tok[:], []byte(free), other[:]); err != nil {
		t.Fatal(err)
	}
	waiter := dlock.NewToken()
	if _, err := pool.Exec(ctx, `INSERT INTO "`+table+`_waiters" (name, token, since, until)
VALUES ($1, $2, clock_timestamp(), clock_timestamp() + interval '1 hour')`, []byte(held), waiter[:]); err != nil {
		t.Fatal(err)
	}
	b, err := pglock.New(pool, &pglock.Options{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if err := b.Migrate(ctx); err != nil {
		t.Fatalf("Migrate of the previous schema: %v", err)
	}
	if err := b.Migrate(ctx); err != nil {
		t.Fatalf("Migrate again: %v", err)
	}
	var lim int
	if err := pool.QueryRow(ctx, `SELECT lim FROM "`+table+`_waiters" WHERE name = $1 AND token = $2`, []byte(held), waiter[:]).Scan(&lim); err != nil || lim != -1 {
		t.Errorf("rule: a queued waiter of the previous schema stays queued as an exclusive waiter; lim %d, %v; want -1", lim, err)
	}
	ws, err := b.ListWaiters(ctx, "upgrade/")
	if err != nil || len(ws) != 1 || ws[0].Key != held || ws[0].Token != waiter || ws[0].Owner != "" || ws[0].Mode != dlock.ModeExclusive {
		t.Errorf("ListWaiters after the upgrade = %+v, %v; want the queued waiter, exclusive, without owner", ws, err)
	}
	ks, err := b.ListKeys(ctx, "upgrade/")
	if err != nil || len(ks) != 2 || ks[0].Key != free || ks[0].Fence != 7 || ks[0].Last == nil || ks[0].Last.Owner != "old" ||
		ks[1].Key != held || len(ks[1].Holders) != 1 || ks[1].Last != nil {
		t.Errorf("ListKeys after the upgrade = %+v, %v; want the free key with its last holder, then the held one", ks, err)
	}
	if _, err := pool.Exec(ctx, `DELETE FROM "`+table+`_waiters"`); err != nil {
		t.Fatal(err)
	}
	const ttl = 5 * time.Second
	for _, r := range []dlock.Request{req(held, ttl, dlock.ModeShared, 0), req(held, ttl, dlock.ModeExclusive, 0)} {
		if res := mustRefuse(t, b, r, "a lease of the previous schema still excludes every mode"); res.Holder.Token != tok {
			t.Errorf("the holder of the upgraded key: %+v, want its token", res.Holder)
		}
	}
	if _, err := b.Acquire(ctx, req(held, ttl, dlock.ModeLimited, 2)); !errors.Is(err, dlock.ErrModeMismatch) {
		t.Errorf("limited acquisition of a key held exclusive by the previous schema: %v, want ErrModeMismatch", err)
	}
	if err := b.Release(ctx, held, tok); err != nil {
		t.Fatalf("release of a lease of the previous schema: %v", err)
	}
	if f := mustGrant(t, b, req(held, ttl, dlock.ModeShared, 0)); f != 42 {
		t.Errorf("rule: fences go on after the upgrade; shared fence %d, want 42", f)
	}
	if f := mustGrant(t, b, req(free, ttl, dlock.ModeExclusive, 0)); f != 8 {
		t.Errorf("rule: fences go on after the upgrade; exclusive fence %d, want 8", f)
	}
}

// v1Tables creates the tables of the previous schema
// (testdata/schema_v1.sql) under a name of their own, dropped when the test
// ends.
func v1Tables(t *testing.T) (*pgxpool.Pool, string) {
	pool := open(t, "")
	table := testTable() + "_v1"
	old, err := os.ReadFile("testdata/schema_v1.sql")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dropTablesOf(context.Background(), pool, table) })
	if _, err := pool.Exec(t.Context(), strings.ReplaceAll(string(old), `"dlock_locks`, `"`+table)); err != nil {
		t.Fatal(err)
	}
	return pool, table
}

// waitForLockWait returns once a statement on table waits for a lock.
func waitForLockWait(t *testing.T, pool *pgxpool.Pool, table string) {
	t.Helper()
	for i := 0; ; i++ {
		var n int
		if err := pool.QueryRow(t.Context(), `SELECT count(*) FROM pg_stat_activity
WHERE wait_event_type = 'Lock' AND datname = current_database() AND query LIKE '%' || $1 || '%'`, table).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			return
		}
		if i == 500 {
			t.Fatal("the acquisition never waited for the row's lock")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestModesDecideUnderTheRowLock makes a grant in an open transaction
// (written as the backend writes it), starts an acquisition in another
// mode, which must wait for the key's row, and commits: the acquisition
// must see the grant. A statement that decided from its snapshot, taken
// before the wait, would admit a reader and a writer together, or one
// holder too many.
func TestModesDecideUnderTheRowLock(t *testing.T) {
	pool := open(t, "")
	b := newLease(t, pool)
	lease, holders := `"`+testTable()+`"`, `"`+testTable()+`_holders"`
	// holderGrant grants a holder with limit lim (0: shared).
	holderGrant := func(lim int) string {
		return fmt.Sprintf(`WITH g AS (INSERT INTO %[2]s (name, token, lim, fence, acquired_at, expires_at)
  SELECT $1, $2, %[3]d, fence + 1, clock_timestamp(), clock_timestamp() + interval '1 minute' FROM %[1]s WHERE name = $1
  RETURNING fence, expires_at)
UPDATE %[1]s l SET fence = g.fence, shared_until = g.expires_at, share_limit = %[3]d FROM g WHERE l.name = $1`, lease, holders, lim)
	}
	for _, c := range []struct {
		name    string
		grant   string // makes a grant of $1 to $2
		request func(key string) dlock.Request
	}{{
		name: "shared after an exclusive grant",
		grant: `UPDATE ` + lease + ` SET token = $2, fence = fence + 1, acquired_at = clock_timestamp(),
  expires_at = clock_timestamp() + interval '1 minute' WHERE name = $1`,
		request: func(key string) dlock.Request { return req(key, time.Minute, dlock.ModeShared, 0) },
	}, {
		name:    "exclusive after a shared grant",
		grant:   holderGrant(0),
		request: func(key string) dlock.Request { return req(key, time.Minute, dlock.ModeExclusive, 0) },
	}, {
		name:    "limited after the last slot's grant",
		grant:   holderGrant(1),
		request: func(key string) dlock.Request { return req(key, time.Minute, dlock.ModeLimited, 1) },
	}} {
		t.Run(c.name, func(t *testing.T) {
			ctx := t.Context()
			key := locktest.UniqueKey("underlock")
			// The key's row exists, free.
			r := req(key, time.Minute, dlock.ModeExclusive, 0)
			mustGrant(t, b, r)
			if err := b.Release(ctx, key, r.Token); err != nil {
				t.Fatal(err)
			}
			tx, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(context.Background())
			tok := dlock.NewToken()
			if _, err := tx.Exec(ctx, c.grant, []byte(key), tok[:]); err != nil {
				t.Fatal(err)
			}
			type outcome struct {
				res dlock.Result
				err error
			}
			got := make(chan outcome, 1)
			want := c.request(key)
			go func() {
				res, err := b.Acquire(ctx, want)
				got <- outcome{res, err}
			}()
			waitForLockWait(t, pool, lease)
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			o := <-got
			if o.err != nil || o.res.Acquired {
				if o.res.Acquired {
					b.Release(context.Background(), key, want.Token)
				}
				t.Fatalf("rule: a grant committed while the acquisition waited for the row excludes it; %+v, %v", o.res, o.err)
			}
			// (The exclusive statement describes the holder from its
			// snapshot: the grant it waited for may be missing there.)
			if want.Mode != dlock.ModeExclusive && o.res.Holder.Token != tok {
				t.Errorf("the refusal names %+v, want the new holder", o.res.Holder)
			}
		})
	}
}

// TestWriterMarkLastsWhileTheWriterWaits: an exclusive waiter behind a
// reader renews its writer mark as long as it waits, well beyond
// dlock.WriterMark, so new readers stay out until it has had the key.
func TestWriterMarkLastsWhileTheWriterWaits(t *testing.T) {
	ctx := t.Context()
	key := locktest.UniqueKey("mark")
	reader := locktest.NewLocker(t, newLease(t, nil))
	first, err := reader.Acquire(ctx, key, dlock.Shared(), dlock.WithTTL(30*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	writer := locktest.NewLocker(t, newLease(t, nil))
	queued := make(chan struct{}, 1)
	got := make(chan error, 1)
	go func() {
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		lk, err := writer.Acquire(wctx, key, dlock.WithWaitFunc(func(dlock.LockInfo) {
			select {
			case queued <- struct{}{}:
			default:
			}
		}))
		if err == nil {
			err = lk.Release(context.Background())
		}
		got <- err
	}()
	<-queued
	others := locktest.NewLocker(t, newLease(t, nil))
	end := time.Now().Add(dlock.WriterMark + 3*time.Second)
	for time.Now().Before(end) {
		lk, err := others.TryAcquire(ctx, key, dlock.Shared())
		if err == nil {
			lk.Release(ctx)
			t.Fatalf("rule: a waiting writer keeps new readers out while it waits; a reader got in after %s", time.Since(end.Add(-dlock.WriterMark-3*time.Second)))
		}
		if !errors.Is(err, dlock.ErrNotAcquired) {
			t.Fatal(err)
		}
		time.Sleep(250 * time.Millisecond)
	}
	if err := first.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-got; err != nil {
		t.Fatalf("the writer: %v", err)
	}
	lk, err := others.TryAcquire(ctx, key, dlock.Shared())
	if err != nil {
		t.Fatalf("rule: an exclusive grant clears the writer mark; %v", err)
	}
	lk.Release(ctx)
}

// TestSharedRenewalKeepsWritersOut: a renewed shared lease keeps an
// exclusive acquisition out beyond its first TTL (the renewal raises what
// the exclusive path reads), and its release lets it in at once.
func TestSharedRenewalKeepsWritersOut(t *testing.T) {
	ctx := t.Context()
	b := newLease(t, nil)
	key := locktest.UniqueKey("renewshared")
	r := req(key, time.Second, dlock.ModeShared, 0)
	f := mustGrant(t, b, r)
	errs, err := b.Extend(ctx, []dlock.Lease{{Key: key, Token: r.Token, TTL: 5 * time.Second}})
	if err != nil || errs[0] != nil {
		t.Fatalf("Extend: %v %v", errs, err)
	}
	time.Sleep(1500 * time.Millisecond)
	res := mustRefuse(t, b, req(key, time.Second, dlock.ModeExclusive, 0), "a renewed shared lease excludes writers")
	if res.Holder.Mode != dlock.ModeShared || res.Holder.Token != r.Token || res.Remaining <= 0 {
		t.Errorf("the refusal: %+v, want the shared holder and its remaining lease", res)
	}
	if err := b.Release(ctx, key, r.Token); err != nil {
		t.Fatal(err)
	}
	if g := mustGrant(t, b, req(key, time.Second, dlock.ModeExclusive, 0)); g <= f {
		t.Errorf("fence %d after the reader's %d", g, f)
	}
}

// TestListAndForceReleaseEveryMode: List shows each holder with its mode
// and limit; ForceRelease frees every holder of the key.
func TestListAndForceReleaseEveryMode(t *testing.T) {
	ctx := t.Context()
	b := newLease(t, nil)
	base := locktest.UniqueKey("listmodes")
	rs, ls := base+"/s", base+"/l"
	mustGrant(t, b, req(rs, time.Minute, dlock.ModeShared, 0))
	mustGrant(t, b, req(rs, time.Minute, dlock.ModeShared, 0))
	mustGrant(t, b, req(ls, time.Minute, dlock.ModeLimited, 3))
	infos, err := b.List(ctx, base)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, i := range infos {
		got = append(got, fmt.Sprintf("%s:%s:%d", i.Key[len(base):], i.Mode, i.Limit))
	}
	if want := "/l:limited:3 /s:shared:0 /s:shared:0"; strings.Join(got, " ") != want {
		t.Errorf("List: %v, want %s", got, want)
	}
	for _, k := range []string{rs, ls} {
		if err := b.ForceRelease(ctx, k); err != nil {
			t.Fatalf("ForceRelease(%q): %v", k, err)
		}
		mustGrant(t, b, req(k, time.Minute, dlock.ModeExclusive, 0))
		if err := b.ForceRelease(ctx, k); err != nil {
			t.Fatal(err)
		}
		if err := b.ForceRelease(ctx, k); !errors.Is(err, dlock.ErrNotHeld) {
			t.Errorf("ForceRelease of a free key: %v, want ErrNotHeld", err)
		}
	}
}

// TestLimitedWaiterWokenByRelease: a limited waiter is handed the slot that
// a release frees long before the holder's lease would have run out (the
// release of a limited holder notifies).
func TestLimitedWaiterWokenByRelease(t *testing.T) {
	ctx := t.Context()
	key := locktest.UniqueKey("wakelimited")
	a := locktest.NewLocker(t, newLease(t, nil))
	w := locktest.NewLocker(t, newLease(t, nil))
	lk, err := a.Acquire(ctx, key, dlock.WithLimit(1), dlock.WithTTL(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	time.AfterFunc(500*time.Millisecond, func() { lk.Release(ctx) })
	began := time.Now()
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	got, err := w.Acquire(wctx, key, dlock.WithLimit(1))
	if err != nil {
		t.Fatal(err)
	}
	defer got.Release(ctx)
	if d := time.Since(began); d > 3*time.Second {
		t.Errorf("rule: a release wakes limited waiters; the waiter got the slot after %s", d)
	}
}

// TestWriterBehindReadersGetsTheLastRelease: a reader queues (it meets
// the writer mark of a refused exclusive try) ahead of a waiting writer;
// then both readers holding the key leave. The writer must have the key
// about a round trip after the last release, well within the writer's
// own look interval (dlock.WriterMark/3) and the grace period: a release
// that wakes only the queued reader, which the mark refuses, or a queue
// that keeps the writer behind that reader, would leave it asleep. The
// reader then gets in as soon as the writer leaves.
func TestWriterBehindReadersGetsTheLastRelease(t *testing.T) {
	ctx := t.Context()
	key := locktest.UniqueKey("writerlast")
	const ttl, bound = 30 * time.Second, 250 * time.Millisecond
	holders := newLease(t, nil)
	r1, r2 := req(key, ttl, dlock.ModeShared, 0), req(key, ttl, dlock.ModeShared, 0)
	mustGrant(t, holders, r1)
	mustGrant(t, holders, r2)
	w := req(key, ttl, dlock.ModeExclusive, 0)
	mustRefuse(t, holders, w, "shared holders keep a writer out") // leaves the mark
	pool := open(t, "")
	queued := func(want int) {
		t.Helper()
		for i := 0; ; i++ {
			var n int
			if err := pool.QueryRow(ctx, fmt.Sprintf(`SELECT count(*) FROM "%s_waiters" WHERE name = $1 AND until > clock_timestamp()`, testTable()),
				[]byte(key)).Scan(&n); err != nil {
				t.Fatal(err)
			}
			if n >= want {
				return
			}
			if i == 500 {
				t.Fatalf("%d waiters queued, want %d", n, want)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	type grant struct {
		at  time.Time
		res dlock.Result
		err error
	}
	wait := func(r dlock.Request) chan grant {
		b := newLease(t, nil)
		ch := make(chan grant, 1)
		go func() {
			wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
			defer cancel()
			res, err := b.AcquireWait(wctx, r)
			ch <- grant{time.Now(), res, err}
		}()
		return ch
	}
	r3 := req(key, ttl, dlock.ModeShared, 0)
	readerGot := wait(r3)
	queued(1)
	writerGot := wait(w)
	queued(2)
	if err := holders.Release(ctx, key, r1.Token); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	if err := holders.Release(ctx, key, r2.Token); err != nil {
		t.Fatal(err)
	}
	last := time.Now()
	g := <-writerGot
	if g.err != nil || !g.res.Acquired {
		t.Fatalf("the writer: %+v, %v; want acquired", g.res, g.err)
	}
	if d := g.at.Sub(last); d > bound {
		t.Errorf("rule: the last reader's release hands the key to the writer waiting behind it; the writer got it %s after the release, want <= %s", d, bound)
	}
	select {
	case g := <-readerGot:
		t.Fatalf("a reader got in while the writer holds the key: %+v, %v", g.res, g.err)
	default:
	}
	if err := holders.Release(ctx, key, w.Token); err != nil {
		t.Fatal(err)
	}
	left := time.Now()
	g = <-readerGot
	if g.err != nil || !g.res.Acquired {
		t.Fatalf("the queued reader: %+v, %v; want acquired", g.res, g.err)
	}
	if d := g.at.Sub(left); d > bound {
		t.Errorf("rule: a reader queued behind a writer gets in when it leaves; it got in %s after the writer's release, want <= %s", d, bound)
	}
	holders.Release(ctx, key, r3.Token)
}

// TestReleaseNamesWhoMayTakeTheKey: while a writer mark is live, a
// release's NOTIFY names the first queued waiter that is not a reader
// (the mark refuses readers: naming one would spend the wake-up), and with
// only readers queued, the first of them (naming nobody would wake every
// waiter at once).
func TestReleaseNamesWhoMayTakeTheKey(t *testing.T) {
	ctx := t.Context()
	key := locktest.UniqueKey("names")
	const ttl = 30 * time.Second
	b := newLease(t, nil)
	r1, r2 := req(key, ttl, dlock.ModeShared, 0), req(key, ttl, dlock.ModeShared, 0)
	mustGrant(t, b, r1)
	mustGrant(t, b, r2)
	mustRefuse(t, b, req(key, ttl, dlock.ModeExclusive, 0), "shared holders keep a writer out") // leaves the mark
	pool := open(t, "")
	reader, writer := dlock.NewToken(), dlock.NewToken()
	if _, err := pool.Exec(ctx, fmt.Sprintf(`INSERT INTO "%s_waiters" (name, token, since, until, lim) VALUES
  ($1, $2, clock_timestamp() - interval '2 seconds', clock_timestamp() + interval '1 minute', 0),
  ($1, $3, clock_timestamp() - interval '1 second', clock_timestamp() + interval '1 minute', -1)`, testTable()),
		[]byte(key), reader[:], writer[:]); err != nil {
		t.Fatal(err)
	}
	c := listening(t, pool)
	named := func(release dlock.Request) string {
		t.Helper()
		if err := b.Release(ctx, key, release.Token); err != nil {
			t.Fatal(err)
		}
		nctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		for {
			n, err := c.Conn().WaitForNotification(nctx)
			if err != nil {
				t.Fatal(err)
			}
			// A release's payload: the key, the waiter it names, then "/"
			// and its change record.
			head, _, _ := strings.Cut(n.Payload, "/")
			if k, first, _ := strings.Cut(head, " "); k == hex.EncodeToString([]byte(key)) {
				return first
			}
		}
	}
	if got := named(r1); got != writer.String() {
		t.Errorf("rule: under the writer mark a release names the first waiter that is not a reader; it named %q, want the writer %s (the reader ahead is %s)", got, writer, reader)
	}
	if _, err := pool.Exec(ctx, fmt.Sprintf(`DELETE FROM "%s_waiters" WHERE name = $1 AND token = $2`, testTable()), []byte(key), writer[:]); err != nil {
		t.Fatal(err)
	}
	if got := named(r2); got != reader.String() {
		t.Errorf("rule: with only readers queued a release names the first of them; it named %q, want %s", got, reader)
	}
}

// TestWriterRacingTheLastReleaseLooksAgain: the last reader leaves while a
// writer's statement runs, after its snapshot (which still shows the
// reader) and before its writer mark's update, which waits for the key's
// row. The release's NOTIFY cannot name the writer (it has no place in the
// queue yet; here the release sends none), so the writer must notice by
// itself that the mark found the key changed, and look again at once
// rather than sleep until its next look.
func TestWriterRacingTheLastReleaseLooksAgain(t *testing.T) {
	ctx := t.Context()
	pool := open(t, "")
	b := newLease(t, pool)
	key := locktest.UniqueKey("racelast")
	r := req(key, time.Minute, dlock.ModeShared, 0)
	mustGrant(t, b, r)
	lease, holders := `"`+testTable()+`"`, `"`+testTable()+`_holders"`
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	// The release as the backend makes it, without its NOTIFY.
	if _, err := tx.Exec(ctx, `SELECT FROM `+lease+` WHERE name = $1 FOR UPDATE`, []byte(key)); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `DELETE FROM `+holders+` WHERE name = $1 AND token = $2`, []byte(key), r.Token[:]); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `UPDATE `+lease+` SET shared_until = '-infinity', freed_at = clock_timestamp() WHERE name = $1`, []byte(key)); err != nil {
		t.Fatal(err)
	}
	type outcome struct {
		at  time.Time
		res dlock.Result
		err error
	}
	got := make(chan outcome, 1)
	w := req(key, time.Minute, dlock.ModeExclusive, 0)
	go func() {
		wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		res, err := newLease(t, nil).AcquireWait(wctx, w)
		got <- outcome{time.Now(), res, err}
	}()
	waitForLockWait(t, pool, lease)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	released := time.Now()
	o := <-got
	if o.err != nil || !o.res.Acquired {
		t.Fatalf("the writer: %+v, %v; want acquired", o.res, o.err)
	}
	defer b.Release(context.Background(), key, w.Token)
	if d := o.at.Sub(released); d > 250*time.Millisecond {
		t.Errorf("rule: a writer whose mark found the readers gone looks again at once; it got the key %s after the release", d)
	}
}

// TestReaderPassesQueuedReadersNotWriters: during the grace period after a
// release, a reader is not held back by readers queued ahead of it (they
// may all hold the key together: waiting for them only serialises
// readers), but still by a writer queued ahead of it.
func TestReaderPassesQueuedReadersNotWriters(t *testing.T) {
	ctx := t.Context()
	pool := open(t, "")
	b := longGrace(t, pool)
	key := locktest.UniqueKey("passreaders")
	const ttl = time.Minute
	first := req(key, ttl, dlock.ModeShared, 0)
	mustGrant(t, b, first)
	if err := b.Release(ctx, key, first.Token); err != nil { // the grace period starts
		t.Fatal(err)
	}
	queueWaiter(t, pool, key, 0)
	r := req(key, ttl, dlock.ModeShared, 0)
	mustGrant(t, b, r) // rule: readers queued ahead do not hold a reader back
	if err := b.Release(ctx, key, r.Token); err != nil {
		t.Fatal(err)
	}
	queueWaiter(t, pool, key, -1)
	mustRefuse(t, b, req(key, ttl, dlock.ModeShared, 0), "a writer queued ahead holds readers back during the grace period")
}

// TestYieldingWaiterNamesTheOneAhead: a waiter that finds the key free but
// yields it, during the grace period, to a waiter queued ahead of it names
// that waiter: the release that freed the key may have named another
// waiter (one whose statement ran while the key was still held, and that
// was not in the queue yet in the release's snapshot), which would leave
// both asleep until the grace period ends.
func TestYieldingWaiterNamesTheOneAhead(t *testing.T) {
	ctx := t.Context()
	pool := open(t, "")
	b := longGrace(t, pool)
	c := listening(t, pool)
	for _, m := range []dlock.Mode{dlock.ModeExclusive, dlock.ModeShared} {
		key := locktest.UniqueKey("forward")
		first := req(key, time.Minute, dlock.ModeExclusive, 0)
		mustGrant(t, b, first)
		if err := b.Release(ctx, key, first.Token); err != nil { // the grace period starts
			t.Fatal(err)
		}
		writer := queueWaiter(t, pool, key, -1)
		wctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		res, err := b.AcquireWait(wctx, req(key, time.Minute, m, 0))
		cancel()
		if err != nil || res.Acquired {
			t.Fatalf("%s waiter behind a queued writer: %+v, %v; want refused", m, res, err)
		}
		named := false
		for !named {
			nctx, cancel := context.WithTimeout(ctx, time.Second)
			n, err := c.Conn().WaitForNotification(nctx)
			cancel()
			if err != nil {
				t.Errorf("rule: a waiter that yields a free key names the waiter ahead of it; the %s waiter sent no notification naming %s (%v)", m, writer, err)
				break
			}
			named = n.Payload == hex.EncodeToString([]byte(key))+" "+writer.String()
		}
	}
}

// listening returns a connection of pool that LISTENs on the test table's
// channel, until the test ends.
func listening(t *testing.T, pool *pgxpool.Pool) *pgxpool.Conn {
	t.Helper()
	c, err := pool.Acquire(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.Exec(context.Background(), `UNLISTEN *`)
		c.Release()
	})
	if _, err := c.Exec(t.Context(), `LISTEN "`+testTable()+`"`); err != nil {
		t.Fatal(err)
	}
	return c
}

// longGrace returns a lease Backend on pool whose grace period outlasts
// any test.
func longGrace(t *testing.T, pool *pgxpool.Pool) *pglock.Backend {
	t.Helper()
	b, err := pglock.New(pool, &pglock.Options{Table: testTable(), Grace: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

// queueWaiter puts a waiter with limit column lim (-1 exclusive, 0 shared)
// in key's queue, a second ahead of now, and returns its token.
func queueWaiter(t *testing.T, pool *pgxpool.Pool, key string, lim int) dlock.Token {
	t.Helper()
	tok := dlock.NewToken()
	if _, err := pool.Exec(t.Context(), fmt.Sprintf(`INSERT INTO "%s_waiters" (name, token, since, until, lim)
VALUES ($1, $2, clock_timestamp() - interval '1 second', clock_timestamp() + interval '1 minute', $3)`, testTable()),
		[]byte(key), tok[:], lim); err != nil {
		t.Fatal(err)
	}
	return tok
}

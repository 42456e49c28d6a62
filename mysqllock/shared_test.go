package mysqllock_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/mysqllock"
)

// request returns a request for key in mode (limit for ModeLimited).
func request(key string, mode dlock.Mode, limit int, ttl time.Duration) dlock.Request {
	return dlock.Request{Key: key, Token: dlock.NewToken(), TTL: ttl, Mode: mode, Limit: limit}
}

// mustGrant acquires req from b and fails the test unless it was granted.
func mustGrant(t *testing.T, b dlock.Backend, req dlock.Request) uint64 {
	t.Helper()
	res, err := b.Acquire(t.Context(), req)
	if err != nil || !res.Acquired {
		t.Fatalf("%s acquisition of %q: %+v, %v; want a grant", req.Mode, req.Key, res, err)
	}
	return res.Fence
}

// mustRefuse acquires req from b and fails the test unless it was refused
// without an error; it returns the refusal.
func mustRefuse(t *testing.T, b dlock.Backend, req dlock.Request) dlock.Result {
	t.Helper()
	res, err := b.Acquire(t.Context(), req)
	if err != nil || res.Acquired {
		t.Fatalf("%s acquisition of %q: %+v, %v; want a refusal", req.Mode, req.Key, res, err)
	}
	return res
}

// keyRow reads the mode columns of key's row in the test table.
func keyRow(t *testing.T, db *sql.DB, key string) (fence uint64, writerMarked bool) {
	t.Helper()
	err := db.QueryRowContext(t.Context(), "SELECT fence, writer_until > UTC_TIMESTAMP(6) FROM "+testTable+" WHERE name = ?", key).
		Scan(&fence, &writerMarked)
	if err != nil {
		t.Fatal(err)
	}
	return fence, writerMarked
}

// TestModesExcludeUnderContention: goroutines, each with a Backend of its
// own, take one key shared and exclusively (and another limited to 2) as
// fast as they can, and count who is inside. The transaction of a shared
// grant and the exclusive statement both go through the key's row, so a
// writer is never in with a reader, and the limit's count is never stale.
func TestModesExcludeUnderContention(t *testing.T) {
	rw, sem := locktest.UniqueKey("contend-rw"), locktest.UniqueKey("contend-sem")
	const workers, rounds, limit = 6, 30, 2
	var readers, writers, inSem atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, 2*workers)
	for w := range workers {
		b := newBackend(t, "")
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range rounds {
				mode := dlock.ModeShared
				if (w+i)%3 == 0 {
					mode = dlock.ModeExclusive
				}
				err := contend(t.Context(), b, request(rw, mode, 0, 5*time.Second), func() (func(), error) {
					if mode == dlock.ModeExclusive {
						if writers.Add(1) != 1 || readers.Load() != 0 {
							return func() { writers.Add(-1) }, errors.New("a writer was in with another holder")
						}
						return func() { writers.Add(-1) }, nil
					}
					if readers.Add(1); writers.Load() != 0 {
						return func() { readers.Add(-1) }, errors.New("a reader was in with a writer")
					}
					return func() { readers.Add(-1) }, nil
				})
				if err == nil {
					err = contend(t.Context(), b, request(sem, dlock.ModeLimited, limit, 5*time.Second), func() (func(), error) {
						if n := inSem.Add(1); n > limit {
							return func() { inSem.Add(-1) }, fmt.Errorf("%d holders of a key limited to %d", n, limit)
						}
						return func() { inSem.Add(-1) }, nil
					})
				}
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// contend takes req from b, retrying refusals, enters, stays a moment for
// the others to collide with, leaves and releases.
func contend(ctx context.Context, b dlock.Backend, req dlock.Request, enter func() (leave func(), err error)) error {
	for {
		res, err := b.Acquire(ctx, req)
		if err != nil {
			return err
		}
		if res.Acquired {
			break
		}
		time.Sleep(time.Millisecond)
	}
	leave, err := enter()
	time.Sleep(2 * time.Millisecond)
	leave()
	return dlock.Join(err, b.Release(ctx, req.Key, req.Token))
}

// TestWriterMarkAndMismatchStatements checks the exclusive statement's
// edges: it leaves the writer mark when it finds shared holders (and a
// shared request then learns how long it lasts), not when it finds limited
// holders (a mismatch, which writes nothing), and its grant clears the mark.
func TestWriterMarkAndMismatchStatements(t *testing.T) {
	b := newBackend(t, "")
	db := open(t, "")
	const ttl = 5 * time.Second

	rw := locktest.UniqueKey("mark")
	reader := request(rw, dlock.ModeShared, 0, ttl)
	mustGrant(t, b, reader)
	mustRefuse(t, b, request(rw, dlock.ModeExclusive, 0, ttl))
	if _, marked := keyRow(t, db, rw); !marked {
		t.Fatal("an exclusive attempt that found a reader left no writer mark")
	}
	res := mustRefuse(t, b, request(rw, dlock.ModeShared, 0, ttl))
	if res.Remaining <= dlock.WriterMark-time.Second || res.Remaining > dlock.WriterMark {
		t.Errorf("a reader refused by the writer mark was told to wait %s; want the mark's remaining time, up to %s", res.Remaining, dlock.WriterMark)
	}
	if err := b.Release(t.Context(), rw, reader.Token); err != nil {
		t.Fatal(err)
	}
	writer := request(rw, dlock.ModeExclusive, 0, ttl)
	mustGrant(t, b, writer) // at once: the release settled the key's shared_until
	if _, marked := keyRow(t, db, rw); marked {
		t.Error("an exclusive grant left the writer mark")
	}
	if err := b.Release(t.Context(), rw, writer.Token); err != nil {
		t.Fatal(err)
	}
	mustGrant(t, b, request(rw, dlock.ModeShared, 0, ttl))

	sem := locktest.UniqueKey("mark-sem")
	mustGrant(t, b, request(sem, dlock.ModeLimited, 2, ttl))
	before, _ := keyRow(t, db, sem)
	for _, req := range []dlock.Request{
		request(sem, dlock.ModeExclusive, 0, ttl),
		request(sem, dlock.ModeShared, 0, ttl),
		request(sem, dlock.ModeLimited, 3, ttl),
	} {
		if res, err := b.Acquire(t.Context(), req); !errors.Is(err, dlock.ErrModeMismatch) {
			t.Errorf("%s request (limit %d) for a key held limited to 2: %+v, %v; want ErrModeMismatch", req.Mode, req.Limit, res, err)
		}
	}
	if after, marked := keyRow(t, db, sem); after != before || marked {
		t.Errorf("refused mismatches changed the row: fence %d → %d, writer mark %v", before, after, marked)
	}
	if f := mustGrant(t, b, request(sem, dlock.ModeLimited, 2, ttl)); f != before+1 {
		t.Errorf("the second slot's fence is %d; want %d", f, before+1)
	}
	mustRefuse(t, b, request(sem, dlock.ModeLimited, 2, ttl))

	ex := locktest.UniqueKey("mark-ex")
	mustGrant(t, b, request(ex, dlock.ModeExclusive, 0, ttl))
	if _, err := b.Acquire(t.Context(), request(ex, dlock.ModeLimited, 2, ttl)); !errors.Is(err, dlock.ErrModeMismatch) {
		t.Errorf("a limited request for a key held exclusively: %v; want ErrModeMismatch", err)
	}
	if res := mustRefuse(t, b, request(ex, dlock.ModeShared, 0, ttl)); res.Remaining <= 0 || res.Holder.Mode != dlock.ModeExclusive {
		t.Errorf("a reader refused by a writer: %+v; want the writer and its remaining lease", res)
	}
}

// TestExtendedSharedHoldKeepsWritersOut: an extension raises the key's
// shared_until with the holder's lease, so a writer is still refused after
// the lease's first expiry, and a release lets it in at once.
func TestExtendedSharedHoldKeepsWritersOut(t *testing.T) {
	b := newBackend(t, "")
	k := locktest.UniqueKey("extend")
	reader := request(k, dlock.ModeShared, 0, time.Second)
	fence := mustGrant(t, b, reader)
	time.Sleep(500 * time.Millisecond)
	errs, err := b.Extend(t.Context(), []dlock.Lease{{Key: k, Token: reader.Token, TTL: 3 * time.Second}})
	if err != nil || errs[0] != nil {
		t.Fatalf("Extend: %v, %v", errs, err)
	}
	time.Sleep(time.Second) // past the first lease
	res := mustRefuse(t, b, request(k, dlock.ModeExclusive, 0, time.Second))
	if res.Holder.Token != reader.Token || res.Holder.Mode != dlock.ModeShared {
		t.Errorf("the writer was refused by %+v; want the reader", res.Holder)
	}
	if err := b.Release(t.Context(), k, reader.Token); err != nil {
		t.Fatal(err)
	}
	if f := mustGrant(t, b, request(k, dlock.ModeExclusive, 0, time.Second)); f <= fence {
		t.Errorf("the writer's fence %d after the reader's %d", f, fence)
	}
}

// TestReleaseFindsSharedHoldOfUnknownOutcome: the Locker resolves an
// acquisition whose outcome it does not know by releasing its token, which
// the Backend did not see granted: the release finds it among the shared
// holders all the same.
func TestReleaseFindsSharedHoldOfUnknownOutcome(t *testing.T) {
	granted, resolver := newBackend(t, ""), newBackend(t, "")
	k := locktest.UniqueKey("unknown")
	req := request(k, dlock.ModeLimited, 1, 5*time.Second)
	mustGrant(t, granted, req)
	if err := resolver.Release(t.Context(), k, req.Token); err != nil {
		t.Fatalf("the release of a limited hold granted elsewhere: %v", err)
	}
	mustGrant(t, resolver, request(k, dlock.ModeLimited, 1, 5*time.Second))
	if err := resolver.Release(t.Context(), k, req.Token); !errors.Is(err, dlock.ErrNotHeld) {
		t.Errorf("a second release: %v, want ErrNotHeld", err)
	}
}

// TestListAndForceReleaseEveryMode: List shows each holder with its mode
// and limit; ForceRelease frees them all, and their extensions fail.
func TestListAndForceReleaseEveryMode(t *testing.T) {
	b := newBackend(t, "")
	prefix := locktest.UniqueKey("list")
	shared, sem := prefix+"/rw", prefix+"/sem"
	r1, r2 := request(shared, dlock.ModeShared, 0, 5*time.Second), request(shared, dlock.ModeShared, 0, 5*time.Second)
	s1 := request(sem, dlock.ModeLimited, 3, 5*time.Second)
	f1, f2, f3 := mustGrant(t, b, r1), mustGrant(t, b, r2), mustGrant(t, b, s1)
	got, err := b.List(t.Context(), prefix)
	if err != nil {
		t.Fatal(err)
	}
	want := []dlock.LockInfo{
		{Key: shared, Token: r1.Token, Fence: f1, Mode: dlock.ModeShared},
		{Key: shared, Token: r2.Token, Fence: f2, Mode: dlock.ModeShared},
		{Key: sem, Token: s1.Token, Fence: f3, Mode: dlock.ModeLimited, Limit: 3},
	}
	if len(got) != len(want) {
		t.Fatalf("List: %+v; want %d holders", got, len(want))
	}
	for i, w := range want {
		g := got[i]
		if g.Key != w.Key || g.Token != w.Token || g.Fence != w.Fence || g.Mode != w.Mode || g.Limit != w.Limit ||
			time.Until(g.ExpiresAt) <= 0 {
			t.Errorf("List[%d] = %+v; want %+v, unexpired", i, g, w)
		}
	}
	for _, k := range []string{shared, sem} {
		if err := b.ForceRelease(t.Context(), k); err != nil {
			t.Fatalf("ForceRelease(%q): %v", k, err)
		}
		if err := b.ForceRelease(t.Context(), k); !errors.Is(err, dlock.ErrNotHeld) {
			t.Errorf("a second ForceRelease(%q): %v, want ErrNotHeld", k, err)
		}
	}
	if got, err := b.List(t.Context(), prefix); err != nil || len(got) != 0 {
		t.Errorf("List after ForceRelease: %+v, %v; want nothing", got, err)
	}
	errs, err := b.Extend(t.Context(), []dlock.Lease{
		{Key: shared, Token: r1.Token, TTL: 5 * time.Second}, {Key: sem, Token: s1.Token, TTL: 5 * time.Second}})
	if err != nil || !errors.Is(errs[0], dlock.ErrNotHeld) || !errors.Is(errs[1], dlock.ErrNotHeld) {
		t.Errorf("Extend of force-released holders: %v, %v; want ErrNotHeld for each", errs, err)
	}
	mustGrant(t, b, request(shared, dlock.ModeExclusive, 0, 5*time.Second))
}

// TestModeRequestsRefusedBeforeIO: a request that no strategy can take is
// an error before any I/O (the pool points at a closed port, so any I/O
// would fail otherwise): a limit out of range, in an attempt or a wait,
// and a mode that GetLock or RowLock cannot grant.
func TestModeRequestsRefusedBeforeIO(t *testing.T) {
	db, err := sql.Open("mysql", "root@tcp(127.0.0.1:1)/test?timeout=1s")
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	lease, err := mysqllock.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer lease.Close()
	for _, req := range []dlock.Request{
		request("k", dlock.ModeLimited, 0, time.Second),
		request("k", dlock.ModeLimited, dlock.MaxLimit+1, time.Second),
		request("k", dlock.ModeShared, 2, time.Second),
		request("k", dlock.Mode(7), 0, time.Second),
	} {
		if _, err := lease.Acquire(t.Context(), req); !errors.Is(err, dlock.ErrInvalidOption) {
			t.Errorf("Acquire(%s, limit %d): %v; want ErrInvalidOption", req.Mode, req.Limit, err)
		}
		if _, err := lease.AcquireWait(t.Context(), req); !errors.Is(err, dlock.ErrInvalidOption) {
			t.Errorf("AcquireWait(%s, limit %d): %v; want ErrInvalidOption", req.Mode, req.Limit, err)
		}
	}
	get, err := mysqllock.NewGetLock(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer get.Close()
	row, err := mysqllock.NewRowLock(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer row.Close()
	for name, b := range map[string]interface {
		dlock.Waiter
		dlock.Sharer
	}{"getlock": get, "rowlock": row} {
		if b.SupportsMode(dlock.ModeShared) || b.SupportsMode(dlock.ModeLimited) {
			t.Errorf("%s: SupportsMode says it grants shared or limited holds", name)
		}
		req := request("k", dlock.ModeShared, 0, time.Second)
		if _, err := b.(dlock.Backend).Acquire(t.Context(), req); !errors.Is(err, dlock.ErrUnsupported) {
			t.Errorf("%s: Acquire(shared): %v; want ErrUnsupported", name, err)
		}
		if _, err := b.AcquireWait(t.Context(), req); !errors.Is(err, dlock.ErrUnsupported) {
			t.Errorf("%s: AcquireWait(shared): %v; want ErrUnsupported", name, err)
		}
	}
}

// TestMigrateUpgradesExclusiveOnlyTable: a lock table created by the
// schema without shared holders (testdata/schema_exclusive_only.sql), with
// a live lease in it, is upgraded by Migrate (run concurrently, and again):
// its columns become those of a new table, the lease is still held, and
// the key's fences go on from where they were, in every mode.
func TestMigrateUpgradesExclusiveOnlyTable(t *testing.T) {
	db := open(t, "")
	ctx := t.Context()
	old, err := os.ReadFile("testdata/schema_exclusive_only.sql")
	if err != nil {
		t.Fatal(err)
	}
	stamp := time.Now().UnixNano() % 1e12
	table, fresh := scoped(fmt.Sprintf("dlock_up%d", stamp)), scoped(fmt.Sprintf("dlock_new%d", stamp))
	t.Cleanup(func() {
		for _, tb := range []string{table, fresh} {
			for _, suffix := range []string{"", "_session", "_rows", "_claims", "_holders", "_journal", "_epoch", "_run"} {
				db.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+tb+suffix)
			}
		}
	})
	for _, stmt := range strings.Split(strings.ReplaceAll(string(old), "`dlock_locks", "`"+table), ";\n") {
		if strings.TrimSpace(stmt) != "" {
			if _, err := db.ExecContext(ctx, stmt); err != nil {
				t.Fatal(err)
			}
		}
	}
	k := locktest.UniqueKey("upgrade")
	holder := dlock.NewToken()
	if _, err := db.ExecContext(ctx, "INSERT INTO "+table+` (name, token, fence, acquired_at, expires_at)
VALUES (?, ?, 41, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL 30 SECOND)`, k, holder[:]); err != nil {
		t.Fatal(err)
	}

	b, err := mysqllock.New(db, &mysqllock.Options{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if _, err := b.Acquire(ctx, request(k, dlock.ModeExclusive, 0, time.Second)); !errors.Is(err, dlock.ErrNoSchema) {
		t.Errorf("an acquisition before the upgrade: %v; want ErrNoSchema (run Migrate)", err)
	}
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = b.Migrate(ctx)
		}()
	}
	wg.Wait()
	if err := errors.Join(append(errs, b.Migrate(ctx))...); err != nil {
		t.Fatalf("Migrate of an exclusive-only table: %v", err)
	}
	nb, err := mysqllock.New(db, &mysqllock.Options{Table: fresh})
	if err != nil {
		t.Fatal(err)
	}
	defer nb.Close()
	if err := nb.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if got, want := columns(t, db, table), columns(t, db, fresh); got != want {
		t.Errorf("the upgraded table's columns:\n%s\nwant those of a new table:\n%s", got, want)
	}
	if got, want := columns(t, db, table+"_session"), columns(t, db, fresh+"_session"); got != want {
		t.Errorf("the upgraded session table's columns:\n%s\nwant those of a new table:\n%s", got, want)
	}

	for _, req := range []dlock.Request{request(k, dlock.ModeExclusive, 0, time.Second), request(k, dlock.ModeShared, 0, time.Second)} {
		if res := mustRefuse(t, b, req); res.Holder.Token != holder {
			t.Errorf("a %s request was refused by %+v; want the lease held before the upgrade", req.Mode, res.Holder)
		}
	}
	wctx, stop := context.WithCancel(ctx)
	defer stop()
	now, changes, err := b.WatchHolders(wctx, k)
	if err != nil || len(now) != 1 || now[0].Token != holder {
		t.Fatalf("a watch of the lease held before the upgrade: %+v %v", now, err)
	}
	if err := b.Release(ctx, k, holder); err != nil {
		t.Fatalf("the release of the lease held before the upgrade: %v", err)
	}
	if hs := <-changes; len(hs) != 0 {
		t.Errorf("the journal's first change after the upgrade: %+v; want the release", hs)
	}
	reader := request(k, dlock.ModeShared, 0, 5*time.Second)
	if f := mustGrant(t, b, reader); f != 42 {
		t.Errorf("the first shared fence after the upgrade is %d; want 42, after the 41 held before", f)
	}
	if err := b.Release(ctx, k, reader.Token); err != nil {
		t.Fatal(err)
	}
	if f := mustGrant(t, b, request(k, dlock.ModeExclusive, 0, 5*time.Second)); f != 43 {
		t.Errorf("the exclusive fence after it is %d; want 43", f)
	}
}

// columns describes a table's columns: name, type, nullability, default.
func columns(t *testing.T, db *sql.DB, table string) string {
	t.Helper()
	rows, err := db.QueryContext(t.Context(), `SELECT CONCAT_WS(' ', COLUMN_NAME, COLUMN_TYPE, IS_NULLABLE, IFNULL(COLUMN_DEFAULT, 'none'),
  IFNULL(CHARACTER_SET_NAME, ''))
FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? ORDER BY COLUMN_NAME`, table)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var c string
		if err := rows.Scan(&c); err != nil {
			t.Fatal(err)
		}
		out = append(out, c)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return strings.Join(out, "\n")
}

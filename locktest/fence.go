package locktest

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/fence"
)

// RunFence runs the rules of package fence against db, a database of
// dialect d: each rule a subtest with tables of its own, dropped at its
// end. newBackend returns a new client of a lock store for the DoTx cases
// (the backend module's own store; it may live elsewhere than db).
//
// db must let two transactions run at once (a pool of at least 2
// connections) and wait for locks rather than fail at once: for SQLite, WAL
// mode and a busy timeout of several seconds.
func RunFence(t *testing.T, db *sql.DB, d fence.Dialect, newBackend func(t *testing.T) dlock.Backend) {
	s := &suite{newBackend: newBackend}
	cases := []namedCase{
		{"MigrateIsIdempotent", func(t *testing.T) { fenceMigrate(t, newFenceDB(t, db, d)) }},
		{"EqualAndNewerFencesAreAcceptedOlderRefused", func(t *testing.T) { fenceOrder(t, newFenceDB(t, db, d)) }},
		{"InvalidInputIsRefusedBeforeIO", func(t *testing.T) { fenceInvalid(t, newFenceDB(t, db, d)) }},
		{"CheckSeesFencesCommittedSinceTheTransactionBegan", func(t *testing.T) { fenceSnapshot(t, newFenceDB(t, db, d)) }},
		{"CheckWaitsForTheOpenTransactionOfTheResource", func(t *testing.T) { fenceWaits(t, newFenceDB(t, db, d)) }},
		{"ConcurrentWritersCommitInFenceOrder", func(t *testing.T) { fenceConcurrent(t, newFenceDB(t, db, d)) }},
		{"DoTxCommitsUnderTheLock", func(t *testing.T) { fenceDoTx(t, newFenceDB(t, db, d), s) }},
		{"DoTxRollsBackOnStaleFenceErrorLossOrPanic", func(t *testing.T) { fenceDoTxFails(t, newFenceDB(t, db, d), s) }},
		{"DoTxReportsATransactionFnEnded", func(t *testing.T) { fenceDoTxEnded(t, newFenceDB(t, db, d), s) }},
	}
	for _, c := range cases {
		t.Run(c.name, c.fn)
	}
}

// fenceDB is one rule's database: a fence table and a data table, both
// named uniquely for the rule.
type fenceDB struct {
	db   *sql.DB
	d    fence.Dialect
	tb   fence.Table
	data string // a table (seq BIGINT PRIMARY KEY, fence BIGINT)
}

func newFenceDB(t *testing.T, db *sql.DB, d fence.Dialect) *fenceDB {
	t.Helper()
	base := "dlock_fences_" + dlock.NewToken().String()[:12]
	f := &fenceDB{db: db, d: d, tb: fence.Table{Dialect: d, Name: base}, data: base + "_data"}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		for _, tb := range []string{f.tb.Name, f.data, f.data + "_seq"} {
			if _, err := db.ExecContext(ctx, "DROP TABLE IF EXISTS "+tb); err != nil {
				t.Errorf("drop %s: %v", tb, err)
			}
		}
	})
	if err := f.tb.Migrate(ctxT(t, 20*time.Second), db); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	f.exec(t, nil, "CREATE TABLE "+f.data+" (seq BIGINT NOT NULL PRIMARY KEY, fence BIGINT NOT NULL)")
	return f
}

// q rewrites the ? placeholders of stmt for the dialect.
func (f *fenceDB) q(stmt string) string {
	if f.d != fence.PostgreSQL {
		return stmt
	}
	var b strings.Builder
	n := 0
	for _, r := range stmt {
		if r == '?' {
			n++
			b.WriteString("$" + strconv.Itoa(n))
			continue
		}
		b.WriteRune(r)
	}
	return b.String()
}

// forUpdate is the suffix of a locking read ("" on SQLite, whose writer
// holds the whole database).
func (f *fenceDB) forUpdate() string {
	if f.d == fence.SQLite {
		return ""
	}
	return " FOR UPDATE"
}

// exec runs stmt on tx, or on the pool when tx is nil.
func (f *fenceDB) exec(t *testing.T, tx *sql.Tx, stmt string, args ...any) {
	t.Helper()
	ctx := ctxT(t, 20*time.Second)
	var err error
	if tx != nil {
		_, err = tx.ExecContext(ctx, f.q(stmt), args...)
	} else {
		_, err = f.db.ExecContext(ctx, f.q(stmt), args...)
	}
	if err != nil {
		t.Fatalf("%s: %v", stmt, err)
	}
}

// stored returns the fence recorded for resource, or 0 when there is none.
func (f *fenceDB) stored(t *testing.T, resource string) uint64 {
	t.Helper()
	var got uint64
	err := f.db.QueryRowContext(ctxT(t, 20*time.Second), f.q("SELECT fence FROM "+f.tb.Name+" WHERE resource = ?"), resource).Scan(&got)
	if err != nil && !errors.Is(err, sql.ErrNoRows) {
		t.Fatalf("read the fence of %q: %v", resource, err)
	}
	return got
}

// rows returns the data table's rows: fences by seq, in seq order.
func (f *fenceDB) rows(t *testing.T) []uint64 {
	t.Helper()
	rs, err := f.db.QueryContext(ctxT(t, 20*time.Second), "SELECT fence FROM "+f.data+" ORDER BY seq")
	if err != nil {
		t.Fatal(err)
	}
	defer rs.Close()
	var out []uint64
	for rs.Next() {
		var v uint64
		if err := rs.Scan(&v); err != nil {
			t.Fatal(err)
		}
		out = append(out, v)
	}
	if err := rs.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

func (f *fenceDB) begin(t *testing.T) *sql.Tx {
	t.Helper()
	tx, err := f.db.BeginTx(ctxT(t, 60*time.Second), nil)
	if err != nil {
		t.Fatalf("BeginTx: %v", err)
	}
	t.Cleanup(func() { tx.Rollback() })
	return tx
}

// checkTx runs Check for resource and fence in a transaction of its own and
// commits it when the check passed.
func (f *fenceDB) checkTx(t *testing.T, resource string, fn uint64) error {
	t.Helper()
	tx := f.begin(t)
	if err := f.tb.Check(ctxT(t, 20*time.Second), tx, resource, fn); err != nil {
		tx.Rollback()
		return err
	}
	if err := tx.Commit(); err != nil {
		t.Fatalf("Commit: %v", err)
	}
	return nil
}

func fenceMigrate(t *testing.T, f *fenceDB) {
	if err := f.checkTx(t, "r", 7); err != nil {
		t.Fatalf("Check after Migrate: %v", err)
	}
	for range 2 {
		if err := f.tb.Migrate(ctxT(t, 20*time.Second), f.db); err != nil {
			t.Fatalf("rule: Migrate is idempotent; a second Migrate: %v", err)
		}
	}
	if got := f.stored(t, "r"); got != 7 {
		t.Errorf("rule: Migrate keeps the recorded fences; after it %q has %d, want 7", "r", got)
	}
	if err := f.checkTx(t, "r", 6); !errors.Is(err, fence.ErrStaleFence) {
		t.Errorf("rule: Migrate keeps the recorded fences; an older fence after it: %v, want ErrStaleFence", err)
	}
}

func fenceOrder(t *testing.T, f *fenceDB) {
	const r = "invoice:42"
	for _, step := range []struct {
		fence uint64
		ok    bool
	}{{5, true}, {5, true}, {9, true}, {8, false}, {1, false}, {9, true}, {10, true}} {
		err := f.checkTx(t, r, step.fence)
		switch {
		case step.ok && err != nil:
			t.Fatalf("rule: a fence at least the newest is accepted; fence %d: %v", step.fence, err)
		case !step.ok && !errors.Is(err, fence.ErrStaleFence):
			t.Fatalf("rule: an older fence is refused; fence %d: %v, want ErrStaleFence", step.fence, err)
		}
	}
	if got := f.stored(t, r); got != 10 {
		t.Errorf("recorded fence %d, want 10", got)
	}
	// A refused check changes nothing, even if its transaction commits.
	tx := f.begin(t)
	if err := f.tb.Check(ctxT(t, 20*time.Second), tx, r, 3); !errors.Is(err, fence.ErrStaleFence) {
		t.Fatalf("Check(3) after 10: %v, want ErrStaleFence", err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatalf("Commit after a refused check: %v", err)
	}
	if got := f.stored(t, r); got != 10 {
		t.Errorf("rule: a refused check changes nothing; the recorded fence is %d after refusing 3, want 10", got)
	}
	// Resources are independent, and compared byte for byte.
	for _, other := range []string{"invoice:43", "INVOICE:42", "invoice:42 ", "é/ü"} {
		if err := f.checkTx(t, other, 1); err != nil {
			t.Errorf("rule: each resource has its own fences; fence 1 for %q: %v", other, err)
		}
	}
	if got := f.stored(t, r); got != 10 {
		t.Errorf("other resources changed %q's fence to %d", r, got)
	}
	// Fences up to MaxInt64 are stored.
	if err := f.checkTx(t, r, math.MaxInt64); err != nil {
		t.Errorf("fence MaxInt64: %v", err)
	}
	if got := f.stored(t, r); got != math.MaxInt64 {
		t.Errorf("recorded fence %d, want MaxInt64", got)
	}
}

func fenceInvalid(t *testing.T, f *fenceDB) {
	ctx := ctxT(t, 20*time.Second)
	tx := f.begin(t)
	for _, r := range []string{"", strings.Repeat("r", dlock.MaxKeyLen+1), "bad\xffutf8", "nul\x00byte"} {
		if err := f.tb.Check(ctx, tx, r, 1); !errors.Is(err, dlock.ErrInvalidKey) {
			t.Errorf("Check(resource %q): %v, want ErrInvalidKey", r, err)
		}
	}
	for _, fn := range []uint64{0, math.MaxInt64 + 1} {
		if err := f.tb.Check(ctx, tx, "r", fn); !errors.Is(err, fence.ErrInvalidFence) {
			t.Errorf("Check(fence %d): %v, want ErrInvalidFence", fn, err)
		}
	}
	bad := fence.Table{Dialect: f.d, Name: f.tb.Name + "; DROP TABLE " + f.data}
	if err := bad.Check(ctx, tx, "r", 1); !errors.Is(err, dlock.ErrInvalidOption) {
		t.Errorf("Check on table %q: %v, want ErrInvalidOption", bad.Name, err)
	}
	if err := bad.Migrate(ctx, f.db); !errors.Is(err, dlock.ErrInvalidOption) {
		t.Errorf("Migrate of table %q: %v, want ErrInvalidOption", bad.Name, err)
	}
	// The refusals did not disturb the transaction (no statement failed in
	// it, which would abort a PostgreSQL transaction).
	if err := f.tb.Check(ctx, tx, "r", 1); err != nil {
		t.Fatalf("rule: invalid input is refused before any I/O; a valid Check in the same transaction: %v", err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if got := f.stored(t, "r"); got != 1 {
		t.Errorf("recorded fence %d, want 1", got)
	}
	f.rows(t) // the data table is still there
}

// fenceSnapshot: a transaction that read fence 8 before fence 9 committed
// must not accept 8 on the strength of its snapshot (MySQL's REPEATABLE
// READ, SQLite's WAL readers), where 8 is still the newest.
func fenceSnapshot(t *testing.T, f *fenceDB) {
	const r = "r"
	if err := f.checkTx(t, r, 8); err != nil {
		t.Fatal(err)
	}
	a := f.begin(t)
	var seen uint64
	if err := a.QueryRowContext(ctxT(t, 20*time.Second), f.q("SELECT fence FROM "+f.tb.Name+" WHERE resource = ?"), r).Scan(&seen); err != nil || seen != 8 {
		t.Fatalf("read in A: %d, %v", seen, err)
	}
	if err := f.checkTx(t, r, 9); err != nil {
		t.Fatalf("Check(9) while A reads: %v", err)
	}
	err := f.tb.Check(ctxT(t, 20*time.Second), a, r, 8)
	if err == nil {
		t.Fatal("rule: a check sees the newest fence, not its transaction's snapshot; 8 was accepted after 9 committed")
	}
	if f.d != fence.SQLite && !errors.Is(err, fence.ErrStaleFence) {
		// SQLite refuses the write of a stale snapshot with SQLITE_BUSY.
		t.Errorf("Check(8) after 9: %v, want ErrStaleFence", err)
	}
	a.Rollback()
	if got := f.stored(t, r); got != 9 {
		t.Errorf("recorded fence %d, want 9", got)
	}
}

// fenceWaits: while a transaction that checked a fence is open, another
// check of the resource waits for it to end, then compares with what it
// left: an older fence is refused after a commit, accepted after a
// rollback (which recorded nothing).
func fenceWaits(t *testing.T, f *fenceDB) {
	const r = "r"
	if err := f.checkTx(t, r, 3); err != nil {
		t.Fatal(err)
	}
	for _, commit := range []bool{true, false} {
		newer, older := uint64(5), uint64(4)
		if !commit {
			newer, older = 8, 6
		}
		a := f.begin(t)
		if err := f.tb.Check(ctxT(t, 20*time.Second), a, r, newer); err != nil {
			t.Fatalf("Check(%d): %v", newer, err)
		}
		b := f.begin(t)
		res := make(chan error, 1)
		go func() { res <- f.tb.Check(ctxT(t, 60*time.Second), b, r, older) }()
		select {
		case err := <-res:
			t.Fatalf("rule: a check waits while another transaction that checked the resource is open; fence %d's check returned %v while %d's transaction was open", older, err, newer)
		case <-time.After(300 * time.Millisecond):
		}
		var err error
		if commit {
			err = a.Commit()
		} else {
			err = a.Rollback()
		}
		if err != nil {
			t.Fatal(err)
		}
		select {
		case err := <-res:
			switch {
			case commit && !errors.Is(err, fence.ErrStaleFence):
				t.Errorf("rule: after fence %d commits, fence %d is refused; got %v", newer, older, err)
			case !commit && err != nil:
				t.Errorf("rule: a rolled-back check records nothing; fence %d after %d rolled back: %v", older, newer, err)
			}
		case <-time.After(60 * time.Second):
			t.Fatalf("the waiting check did not return within 60s of the other transaction's end")
		}
		if err := b.Commit(); err != nil {
			t.Fatal(err)
		}
	}
	if got := f.stored(t, r); got != 6 {
		t.Errorf("recorded fence %d, want 6", got)
	}
}

// fenceConcurrent: goroutines take increasing fences from a shared counter
// and race to commit, each transaction checking its fence and then writing
// under it. The data's own row lock puts the commits in order (seq), and in
// that order the fences must never decrease: no stale writer committed
// after a newer one.
func fenceConcurrent(t *testing.T, f *fenceDB) {
	const (
		r       = "shared"
		writers = 8
		each    = 25
	)
	// The resource has no row yet: the first checks race to insert it.
	f.exec(t, nil, "CREATE TABLE "+f.data+"_seq (id INT NOT NULL PRIMARY KEY, seq BIGINT NOT NULL)")
	f.exec(t, nil, "INSERT INTO "+f.data+"_seq (id, seq) VALUES (1, 0)")
	var next atomic.Uint64
	var committed, stale atomic.Int64
	var wg sync.WaitGroup
	for range writers {
		wg.Go(func() {
			for range each {
				if err := f.guardedWrite(t, r, next.Add(1)); errors.Is(err, fence.ErrStaleFence) {
					stale.Add(1)
				} else if err != nil {
					t.Error(err)
					return
				} else {
					committed.Add(1)
				}
			}
		})
	}
	wg.Wait()
	got := f.rows(t)
	if int64(len(got)) != committed.Load() {
		t.Errorf("%d rows for %d commits", len(got), committed.Load())
	}
	for i := 1; i < len(got); i++ {
		if got[i] < got[i-1] {
			t.Errorf("rule: no stale writer commits after a newer one; commit %d wrote fence %d after commit %d wrote %d (commits in order: %v)",
				i+1, got[i], i, got[i-1], got)
			break
		}
	}
	if len(got) > 0 && f.stored(t, r) != got[len(got)-1] {
		t.Errorf("recorded fence %d, last committed %d", f.stored(t, r), got[len(got)-1])
	}
	t.Logf("%d commits, %d stale refused", committed.Load(), stale.Load())
}

// guardedWrite checks fn for resource, then appends fn to the data table
// under the next seq (read with a locking read, so that seq order is commit
// order), pausing briefly between steps to let writers interleave.
func (f *fenceDB) guardedWrite(t *testing.T, resource string, fn uint64) error {
	ctx := ctxT(t, 60*time.Second)
	pause := func() { time.Sleep(time.Duration(rand.IntN(500)) * time.Microsecond) }
	tx, err := f.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	pause()
	if err := f.tb.Check(ctx, tx, resource, fn); err != nil {
		return err
	}
	pause()
	var seq int64
	if err := tx.QueryRowContext(ctx, "SELECT seq FROM "+f.data+"_seq WHERE id = 1"+f.forUpdate()).Scan(&seq); err != nil {
		return fmt.Errorf("read seq: %w", err)
	}
	seq++
	if _, err := tx.ExecContext(ctx, f.q("UPDATE "+f.data+"_seq SET seq = ? WHERE id = 1"), seq); err != nil {
		return fmt.Errorf("update seq: %w", err)
	}
	if _, err := tx.ExecContext(ctx, f.q("INSERT INTO "+f.data+" (seq, fence) VALUES (?, ?)"), seq, int64(fn)); err != nil {
		return fmt.Errorf("append: %w", err)
	}
	pause()
	return tx.Commit()
}

// insert is the guarded write of DoTx's cases: a row seq of the data
// table.
func (f *fenceDB) insert(ctx context.Context, tx *sql.Tx, seq int64) error {
	_, err := tx.ExecContext(ctx, f.q("INSERT INTO "+f.data+" (seq, fence) VALUES (?, ?)"), seq, seq)
	return err
}

func fenceDoTx(t *testing.T, f *fenceDB, s *suite) {
	l, _ := s.locker(t)
	other, _ := s.locker(t)
	k := key(t, "k")
	ctx := ctxT(t, 30*time.Second)
	var fences []uint64
	for i := range int64(3) {
		err := f.tb.DoTx(ctx, l, f.db, k, func(ctx context.Context, tx *sql.Tx) error {
			mustBeHeld(t, other, k)
			if ctx.Err() != nil {
				t.Errorf("fn's context ended while the lock is held: %v", context.Cause(ctx))
			}
			return f.insert(ctx, tx, i+1)
		}, dlock.WithTTL(ttl))
		if err != nil {
			t.Fatalf("DoTx %d: %v", i+1, err)
		}
		fences = append(fences, mustBeFree(t, other, k))
	}
	if got := f.rows(t); len(got) != 3 {
		t.Errorf("rule: DoTx commits fn's writes; %d rows after 3 DoTx, want 3", len(got))
	}
	if got := f.stored(t, k); got == 0 || got >= fences[len(fences)-1] {
		t.Errorf("recorded fence %d for %q: want the last DoTx's, below the later acquisitions' %v", got, k, fences)
	}
}

func fenceDoTxFails(t *testing.T, f *fenceDB, s *suite) {
	l, faults := s.locker(t)
	other, _ := s.locker(t)
	ctx := ctxT(t, 60*time.Second)
	errFn := errors.New("fn failed")

	k := key(t, "fnerr")
	err := f.tb.DoTx(ctx, l, f.db, k, func(ctx context.Context, tx *sql.Tx) error {
		if err := f.insert(ctx, tx, 1); err != nil {
			return err
		}
		return errFn
	}, dlock.WithTTL(ttl))
	if !errors.Is(err, errFn) {
		t.Errorf("DoTx with fn failing: %v, want fn's error", err)
	}
	if n := len(f.rows(t)); n != 0 {
		t.Errorf("rule: DoTx rolls back when fn fails; %d rows committed", n)
	}
	mustBeFree(t, other, k)

	// A newer holder (here a fence far ahead) has written: the check refuses
	// this one before fn runs.
	k = key(t, "stale")
	if err := f.checkTx(t, k, math.MaxInt64-1); err != nil {
		t.Fatal(err)
	}
	err = f.tb.DoTx(ctx, l, f.db, k, func(ctx context.Context, tx *sql.Tx) error {
		t.Error("rule: DoTx runs fn only after the check passed; fn ran with a stale fence")
		return f.insert(ctx, tx, 2)
	}, dlock.WithTTL(ttl))
	if !errors.Is(err, fence.ErrStaleFence) {
		t.Errorf("DoTx with a stale fence: %v, want ErrStaleFence", err)
	}
	if n := len(f.rows(t)); n != 0 {
		t.Errorf("rule: DoTx rolls back a stale fence; %d rows committed", n)
	}
	mustBeFree(t, other, k)

	// The lock is lost while fn runs: fn's context ends, nothing commits.
	k = key(t, "lost")
	err = f.tb.DoTx(ctx, l, f.db, k, func(ctx context.Context, tx *sql.Tx) error {
		if err := f.insert(ctx, tx, 3); err != nil {
			return err
		}
		faults.failExtend.Store(true)
		select {
		case <-ctx.Done():
		case <-time.After(3 * ttl):
			t.Error("rule: DoTx's context ends when the lock is lost; it did not")
		}
		return nil
	}, dlock.WithTTL(ttl))
	faults.failExtend.Store(false)
	if !errors.Is(err, dlock.ErrLockLost) {
		t.Errorf("DoTx after a loss: %v, want ErrLockLost", err)
	}
	if n := len(f.rows(t)); n != 0 {
		t.Errorf("rule: DoTx does not commit after the lock is lost; %d rows committed", n)
	}

	// fn panics: the transaction rolls back, the lock is released, the
	// panic goes on.
	k = key(t, "panic")
	func() {
		defer func() {
			if recover() == nil {
				t.Error("DoTx swallowed fn's panic")
			}
		}()
		f.tb.DoTx(ctx, l, f.db, k, func(ctx context.Context, tx *sql.Tx) error {
			if err := f.insert(ctx, tx, 4); err != nil {
				return err
			}
			panic("fn panics")
		}, dlock.WithTTL(ttl))
	}()
	if n := len(f.rows(t)); n != 0 {
		t.Errorf("rule: DoTx rolls back when fn panics; %d rows committed", n)
	}
	mustBeFree(t, other, k)
}

// fenceDoTxEnded: a fn that ends DoTx's transaction itself (a COMMIT it
// sends, tx.Commit, or on MySQL a statement that commits implicitly) has
// written outside the fence's protection from then on: DoTx returns an
// error matching fence.ErrTxEnded, never nil.
func fenceDoTxEnded(t *testing.T, f *fenceDB, s *suite) {
	l, _ := s.locker(t)
	other, _ := s.locker(t)
	ctx := ctxT(t, 60*time.Second)
	ends := map[string]func(ctx context.Context, tx *sql.Tx) error{
		"COMMIT":    func(ctx context.Context, tx *sql.Tx) error { _, err := tx.ExecContext(ctx, "COMMIT"); return err },
		"tx.Commit": func(ctx context.Context, tx *sql.Tx) error { return tx.Commit() },
	}
	if f.d == fence.MySQL {
		ends["implicit commit"] = func(ctx context.Context, tx *sql.Tx) error {
			_, err := tx.ExecContext(ctx, "CREATE TABLE IF NOT EXISTS "+f.data+"_lazy (id INT PRIMARY KEY)")
			return err
		}
		t.Cleanup(func() { f.db.Exec("DROP TABLE IF EXISTS " + f.data + "_lazy") })
	}
	seq := int64(100)
	for name, end := range ends {
		k := key(t, "ended")
		seq++
		err := f.tb.DoTx(ctx, l, f.db, k, func(ctx context.Context, tx *sql.Tx) error {
			if err := f.insert(ctx, tx, seq); err != nil {
				return err
			}
			return end(ctx, tx)
		}, dlock.WithTTL(ttl))
		if !errors.Is(err, fence.ErrTxEnded) {
			t.Errorf("rule: DoTx reports a transaction that fn ended (%s); got %v, want ErrTxEnded", name, err)
		}
		mustBeFree(t, other, k)
	}
}

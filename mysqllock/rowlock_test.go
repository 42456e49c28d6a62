package mysqllock_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/mysqllock"
	"github.com/go-sql-driver/mysql"
)

// TestRowLockFenceNeedsUnbrokenHold kills the locking session between the
// locking read and the fence's write, and lets another client take the key
// meanwhile. The rule: a fence is reported only if the row lock was held
// across its write, so the first acquisition must not be reported acquired
// (its fence, written after the second client's, would be the larger one
// while the second client holds the key).
func TestRowLockFenceNeedsUnbrokenHold(t *testing.T) {
	ctx := t.Context()
	first, second := newRowLock(t, ""), newRowLock(t, "")
	admin := open(t, "")
	key := locktest.UniqueKey("rowlock-fence-order")
	var got dlock.Result
	var gotErr error
	killed := false
	second1 := dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 10 * time.Second}
	mysqllock.OnRowLocked(t, func(k string, id int64) {
		if k != key || killed { // only the first client's locking session
			return
		}
		killed = true
		if _, err := admin.ExecContext(ctx, fmt.Sprintf("KILL CONNECTION %d", id)); err != nil {
			gotErr = err
			return
		}
		wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		got, gotErr = second.AcquireWait(wctx, second1)
	})
	res, err := first.Acquire(ctx, dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 10 * time.Second})
	if gotErr != nil || !got.Acquired {
		t.Fatalf("the second client did not take the key after the first one's session was killed: %+v, %v", got, gotErr)
	}
	defer second.Release(ctx, key, second1.Token)
	if err == nil && res.Acquired {
		t.Fatalf("a fence written after the locking session died was reported: first client acquired with fence %d, while the second client holds the key with fence %d", res.Fence, got.Fence)
	}
	// The failed acquisition left the holder's row as the holder wrote it.
	hs, err := second.List(ctx, key)
	if err != nil || len(hs) != 1 || hs[0].Token != second1.Token || hs[0].Fence != got.Fence {
		t.Fatalf("List after the failed acquisition: %+v, %v; want the holder (fence %d)", hs, err, got.Fence)
	}
}

// TestRowLockWaitUnderMaxStatementTime waits for a held key on sessions
// whose max_statement_time (MariaDB; set here for the test's sessions only,
// as a user's grants or a DSN would) is shorter than the wait: the wait must
// last until the release, not fail with error 1969 when the limit passes.
func TestRowLockWaitUnderMaxStatementTime(t *testing.T) {
	var limit float64
	if err := open(t, "").QueryRowContext(t.Context(), "SELECT @@max_statement_time").Scan(&limit); err != nil {
		t.Skipf("SKIPPING: the test server has no max_statement_time (MariaDB only): %v", err)
	}
	for name, params := range map[string]string{
		"prepared":     "max_statement_time=0.3",
		"interpolated": "max_statement_time=0.3&interpolateParams=true",
	} {
		t.Run(name, func(t *testing.T) { testWaitUnderMaxStatementTime(t, params) })
	}
}

func testWaitUnderMaxStatementTime(t *testing.T, params string) {
	ctx := t.Context()
	holder := newRowLock(t, "")
	waiter := newRowLock(t, params)
	key := locktest.UniqueKey("rowlock-max-statement-time")
	held := dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 10 * time.Second}
	if res, err := holder.Acquire(ctx, held); err != nil || !res.Acquired {
		t.Fatalf("holder: %+v, %v", res, err)
	}
	type outcome struct {
		res dlock.Result
		err error
	}
	done := make(chan outcome, 1)
	req := dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 10 * time.Second}
	go func() {
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		res, err := waiter.AcquireWait(wctx, req)
		done <- outcome{res, err}
	}()
	var o outcome
	select {
	case o = <-done: // the wait ended before the release
		holder.Release(ctx, key, held.Token)
	case <-time.After(1500 * time.Millisecond): // five times the limit
		if err := holder.Release(ctx, key, held.Token); err != nil {
			t.Fatal(err)
		}
		o = <-done
	}
	if o.err != nil || !o.res.Acquired {
		t.Fatalf("a wait longer than max_statement_time did not last until the release: %+v, %v", o.res, o.err)
	}
	if err := waiter.Release(ctx, key, req.Token); err != nil {
		t.Fatal(err)
	}
}

// TestRowLockWaitCutErrors checks which server errors end a rowlock wait
// with "not acquired": a statement time limit (MariaDB's max_statement_time,
// MySQL's max_execution_time) that the wait could not lift.
func TestRowLockWaitCutErrors(t *testing.T) {
	for _, c := range []struct {
		err error
		cut bool
	}{
		{&mysql.MySQLError{Number: 1969, Message: "Query execution was interrupted (max_statement_time exceeded)"}, true},
		{&mysql.MySQLError{Number: 3024, Message: "Query execution was interrupted, maximum statement execution time exceeded"}, true},
		{fmt.Errorf("wrapped: %w", &mysql.MySQLError{Number: 1969}), true},
		{nil, false},
		{&mysql.MySQLError{Number: 1317, Message: "Query execution was interrupted"}, false},
		{mysql.ErrInvalidConn, false},
		{context.DeadlineExceeded, false},
	} {
		if got := mysqllock.WaitCut(c.err); got != c.cut {
			t.Errorf("waitCut(%v) = %v, want %v", c.err, got, c.cut)
		}
	}
}

// TestRowLockSmallPools runs rowlock over pools with small limits. Each held
// lock pins a connection and each grant needs another: a pool of 1 is
// refused (at NewRowLock, and at each call if the limit is lowered after),
// with a limit of n up to n−1 locks are held, an attempt beyond that fails
// at once instead of blocking until its deadline, a wait beyond it takes the
// key once a lock is released, and no session is kept out of the pool once
// its lock is released.
func TestRowLockSmallPools(t *testing.T) {
	ctx := t.Context()
	newBackend(t, "") // migrated
	db := open(t, "")
	db.SetMaxOpenConns(1)
	if _, err := mysqllock.NewRowLock(db, &mysqllock.Options{Table: testTable}); !errors.Is(err, dlock.ErrInvalidOption) {
		t.Fatalf("NewRowLock over a pool of 1: %v, want ErrInvalidOption", err)
	}
	db.SetMaxOpenConns(0)
	r, err := mysqllock.NewRowLock(db, &mysqllock.Options{Table: testTable})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	db.SetMaxOpenConns(1)
	req := func() dlock.Request {
		return dlock.Request{Key: locktest.UniqueKey("rowlock-pool"), Token: dlock.NewToken(), TTL: 10 * time.Second}
	}
	bounded := func() (context.Context, context.CancelFunc) { return context.WithTimeout(ctx, 20*time.Second) }
	c, cancel := bounded()
	if _, err := r.Acquire(c, req()); !errors.Is(err, dlock.ErrInvalidOption) {
		t.Errorf("Acquire after the pool's limit was lowered to 1: %v, want ErrInvalidOption", err)
	}
	cancel()

	for _, n := range []int{2, 3} {
		db.SetMaxOpenConns(n)
		var held []dlock.Request
		for range n - 1 {
			q := req()
			c, cancel := bounded()
			res, err := r.Acquire(c, q)
			cancel()
			if err != nil || !res.Acquired {
				t.Fatalf("pool of %d: lock %d of %d: %+v, %v", n, len(held)+1, n-1, res, err)
			}
			held = append(held, q)
		}
		c, cancel := bounded()
		res, err := r.Acquire(c, req())
		cancel()
		if err == nil || errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("pool of %d with %d locks held: an attempt at another key: %+v, %v; want an error at once", n, n-1, res, err)
		}
		// A blocking acquisition through a Locker fails at once too: its
		// caller may hold the locks that fill the pool.
		l := dlock.New(r, nil)
		c, cancel = context.WithTimeout(ctx, 5*time.Second)
		if k, err := l.Acquire(c, locktest.UniqueKey("rowlock-pool")); err == nil || errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("pool of %d with %d locks held: a blocking acquisition of another key: %v, %v; want an error at once", n, n-1, k, err)
		}
		cancel()
		if err := l.Close(ctx); err != nil {
			t.Fatal(err)
		}
		// A wait for another key is served by the first release.
		waited := make(chan error, 1)
		w := req()
		go func() {
			c, cancel := bounded()
			defer cancel()
			res, err := r.AcquireWait(c, w)
			if err == nil && !res.Acquired {
				err = fmt.Errorf("not acquired: %+v", res)
			}
			waited <- err
		}()
		time.Sleep(100 * time.Millisecond) // the wait is waiting (else it takes the key at once)
		if err := r.Release(ctx, held[0].Key, held[0].Token); err != nil {
			t.Fatal(err)
		}
		if err := <-waited; err != nil {
			t.Fatalf("pool of %d: a wait for a connection: %v", n, err)
		}
		held = append(held[1:], w)
		for _, q := range held {
			if err := r.Release(ctx, q.Key, q.Token); err != nil {
				t.Fatal(err)
			}
		}
		if inUse := db.Stats().InUse; inUse != 0 {
			t.Errorf("pool of %d: %d connections still checked out with no lock held", n, inUse)
		}
	}
}

// TestRowLockGrantAcrossRestartWithReusedSessionID restarts the server
// (SIGKILL) between a rowlock's locking read and the fence's write, then
// has another client open sessions until one gets the locking session's
// connection id, which a new server run hands out again, and take that
// session's named mark as a rowlock session would. The rule: the grant
// must still see that its locking session ended (its row lock ended with
// the server), so it is not reported acquired.
func TestRowLockGrantAcrossRestartWithReusedSessionID(t *testing.T) {
	dsn, restart := startRestartableMariaDB(t)
	ctx := t.Context()
	admin := openDSN(t, dsn)
	migrateTwice(t, admin, nil)
	// Move connection ids past those that a new run gives its first
	// clients, so that the locking session's id can be reached again.
	for range 30 {
		c, err := admin.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		_ = c.Raw(func(any) error { return driver.ErrBadConn })
		c.Close()
	}
	db := openDSN(t, dsn)
	r, err := mysqllock.NewRowLock(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	key := locktest.UniqueKey("rowlock-reused-id")
	var impostor *sql.Conn
	var hookErr error
	done := false
	mysqllock.OnRowLocked(t, func(k string, id int64) {
		if k != key || done {
			return
		}
		done = true
		restart()
		other := openDSN(t, dsn)
		for {
			c, err := other.Conn(ctx)
			if err != nil {
				hookErr = err
				return
			}
			var got int64
			if err := c.QueryRowContext(ctx, "SELECT CONNECTION_ID()").Scan(&got); err != nil {
				hookErr = err
				return
			}
			if got == id {
				var ok sql.NullInt64
				if err := c.QueryRowContext(ctx, "SELECT GET_LOCK(CONCAT('dlock/session/', CONNECTION_ID()), 0)").Scan(&ok); err != nil || ok.Int64 != 1 {
					hookErr = fmt.Errorf("take the reused id's mark: %v, %v", ok, err)
				}
				impostor = c
				return
			}
			_ = c.Raw(func(any) error { return driver.ErrBadConn })
			c.Close()
			if got > id {
				hookErr = fmt.Errorf("the new run's connection ids start at %d, past the locking session's %d", got, id)
				return
			}
		}
	})
	res, err := r.Acquire(ctx, dlock.Request{Key: key, Token: dlock.NewToken(), TTL: 10 * time.Second})
	if hookErr != nil {
		t.Fatal(hookErr)
	}
	if impostor == nil {
		t.Fatal("the hook did not run")
	}
	defer impostor.Close()
	if err == nil && res.Acquired {
		t.Fatalf("acquired with fence %d, though the row lock ended with the server before the fence was written", res.Fence)
	}
	t.Logf("refused as it should be: %+v, %v", res, err)
}

// TestRowLockIsolation holds a rowlock on a pool whose sessions run at
// SERIALIZABLE (set by the DSN, as a caller may): the locking transaction
// runs at READ COMMITTED, and the session, handed back to the caller's pool
// after the release, is at SERIALIZABLE again.
func TestRowLockIsolation(t *testing.T) {
	ctx := t.Context()
	variable := "transaction_isolation"
	var version string
	if err := open(t, "").QueryRowContext(ctx, "SELECT VERSION()").Scan(&version); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(version, "MariaDB") {
		variable = "tx_isolation" // before 11.1 MariaDB knows only this name
	}
	newBackend(t, "") // migrated
	db := open(t, variable+"=%27SERIALIZABLE%27")
	db.SetMaxOpenConns(2) // a pool with a limit gets each session back at release
	r, err := mysqllock.NewRowLock(db, &mysqllock.Options{Table: testTable})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	key := locktest.UniqueKey("rowlock-isolation")
	var id int64
	mysqllock.OnRowLocked(t, func(k string, connID int64) {
		if k == key {
			id = connID
		}
	})
	for round := range 2 { // the second round may reuse the first's session
		tok := dlock.NewToken()
		if res, err := r.Acquire(ctx, dlock.Request{Key: key, Token: tok, TTL: 10 * time.Second}); err != nil || !res.Acquired {
			t.Fatalf("round %d: acquire: %+v, %v", round, res, err)
		}
		// information_schema.INNODB_TRX is a snapshot that InnoDB renews
		// when it has not been read for 0.1 s.
		admin := open(t, "")
		var level string
		for end := time.Now().Add(3 * time.Second); time.Now().Before(end); {
			time.Sleep(150 * time.Millisecond)
			err = admin.QueryRowContext(ctx, "SELECT trx_isolation_level FROM information_schema.INNODB_TRX WHERE trx_mysql_thread_id = ?", id).Scan(&level)
			if !errors.Is(err, sql.ErrNoRows) {
				break
			}
		}
		if err != nil || level != "READ COMMITTED" {
			t.Errorf("round %d: the locking transaction has isolation %q (%v), want READ COMMITTED", round, level, err)
		}
		if err := r.Release(ctx, key, tok); err != nil {
			t.Fatalf("round %d: release: %v", round, err)
		}
		conns := make([]*sql.Conn, 2)
		for i := range conns {
			c, err := db.Conn(ctx)
			if err != nil {
				t.Fatal(err)
			}
			conns[i] = c
			if err := c.QueryRowContext(ctx, "SELECT @@SESSION."+variable).Scan(&level); err != nil || level != "SERIALIZABLE" {
				t.Errorf("round %d: a session back in the pool is at %q (%v), want the DSN's SERIALIZABLE", round, level, err)
			}
		}
		for _, c := range conns {
			c.Close()
		}
	}
}

package mysqllock_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/mysqllock"
	"github.com/go-sql-driver/mysql"
)

// pausing is a driver.Connector whose connections stop for pause after a
// statement that contains mark, while armed: the client process paused (a
// GC pause, SIGSTOP) between two statements of a transaction.
type pausing struct {
	driver.Connector
	mark  string
	pause time.Duration
	armed atomic.Bool
	hit   chan struct{} // receives once a pause begins
}

// pausingDB opens the test server through a pausing connector.
func pausingDB(t *testing.T, mark string, pause time.Duration) (*pausing, *sql.DB) {
	cfg, err := mysql.ParseDSN(dsn())
	if err != nil {
		t.Fatal(err)
	}
	cfg.InterpolateParams = true // statements go through ExecContext and QueryContext
	base, err := mysql.NewConnector(cfg)
	if err != nil {
		t.Fatal(err)
	}
	p := &pausing{Connector: base, mark: mark, pause: pause, hit: make(chan struct{}, 1)}
	db := sql.OpenDB(p)
	t.Cleanup(func() { db.Close() })
	return p, db
}

func (p *pausing) Connect(ctx context.Context) (driver.Conn, error) {
	c, err := p.Connector.Connect(ctx)
	if err != nil {
		return nil, err
	}
	return &pausingConn{Conn: c, p: p}, nil
}

type pausingConn struct {
	driver.Conn
	p *pausing
}

func (c *pausingConn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Result, error) {
	res, err := c.Conn.(driver.ExecerContext).ExecContext(ctx, query, args)
	c.after(query, err)
	return res, err
}

func (c *pausingConn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Rows, error) {
	rows, err := c.Conn.(driver.QueryerContext).QueryContext(ctx, query, args)
	c.after(query, err)
	return rows, err
}

// after pauses once query has run, if it is the mark's and the pause is armed.
func (c *pausingConn) after(query string, err error) {
	if err == nil && strings.Contains(query, c.p.mark) && c.p.armed.CompareAndSwap(true, false) {
		c.p.hit <- struct{}{}
		time.Sleep(c.p.pause)
	}
}

func (c *pausingConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	return c.Conn.(driver.ConnBeginTx).BeginTx(ctx, opts)
}

func (c *pausingConn) ResetSession(ctx context.Context) error {
	return c.Conn.(driver.SessionResetter).ResetSession(ctx)
}

func (c *pausingConn) IsValid() bool { return c.Conn.(driver.Validator).IsValid() }

func (c *pausingConn) CheckNamedValue(nv *driver.NamedValue) error {
	return c.Conn.(driver.NamedValueChecker).CheckNamedValue(nv)
}

// TestPausedSharedAttemptHoldsNoKey: a client that pauses in the middle of a
// shared acquisition (its transaction holds the key's row) must not keep the
// key's holder from renewing, nor others from the key, for longer than the
// server's idle-transaction bound: the server ends the paused transaction.
func TestPausedSharedAttemptHoldsNoKey(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	p, pdb := pausingDB(t, "ON DUPLICATE KEY UPDATE fence = fence", 7*time.Second)
	stranger, err := mysqllock.New(pdb, &mysqllock.Options{Table: testTable})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { stranger.Close() })
	newBackend(t, "") // migrated

	const ttl = 3 * time.Second
	key := locktest.UniqueKey("paused-shared")
	holder := locktest.NewLocker(t, newBackend(t, ""))
	lk, err := holder.Acquire(ctx, key, dlock.WithTTL(ttl))
	if err != nil {
		t.Fatal(err)
	}
	defer lk.Release(ctx)
	p.armed.Store(true)
	strangerDone := make(chan struct{})
	defer func() { <-strangerDone }() // after its pause
	sl := locktest.NewLocker(t, stranger)
	go func() {
		defer close(strangerDone)
		actx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		_, _ = sl.TryAcquire(actx, key, dlock.Shared(), dlock.WithTTL(ttl))
	}()
	<-p.hit
	// Two TTLs of the holder while the stranger stays paused.
	select {
	case <-lk.Done():
		t.Fatalf("the holder lost the key while a shared attempt was paused: %v", lk.Err())
	case <-time.After(2 * ttl):
	}
	// And others are answered.
	octx, ocancel := context.WithTimeout(ctx, 2*time.Second)
	defer ocancel()
	if _, err := locktest.NewLocker(t, newBackend(t, "")).TryAcquire(octx, key, dlock.WithTTL(ttl)); err == nil || !errors.Is(err, dlock.ErrNotAcquired) {
		t.Fatalf("another client's attempt while the stranger is paused: %v", err)
	}
}

// TestReleaseOfAGoneLeaseLocksNothing: releasing an exclusive lease that is
// gone (expired, taken by another) reads whether the token holds a shared
// hold instead of locking the key's row to look: a client paused there
// keeps nobody waiting.
func TestReleaseOfAGoneLeaseLocksNothing(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	p, pdb := pausingDB(t, "WHERE name = ? FOR UPDATE", 2*time.Second)
	be, err := mysqllock.New(pdb, &mysqllock.Options{Table: testTable, NoDoorbell: true})
	if err != nil {
		t.Fatal(err)
	}
	newBackend(t, "") // migrated
	key := locktest.UniqueKey("gone-release")
	tok := dlock.NewToken()
	if r, err := be.Acquire(ctx, dlock.Request{Key: key, Token: tok, TTL: dlock.MinTTL}); err != nil || !r.Acquired {
		t.Fatal(r, err)
	}
	time.Sleep(dlock.MinTTL + 50*time.Millisecond) // gone
	p.armed.Store(true)
	if err := be.Release(ctx, key, tok); !errors.Is(err, dlock.ErrNotHeld) {
		t.Fatalf("release of a gone lease: %v", err)
	}
	select {
	case <-p.hit:
		t.Fatal("the release of a gone lease locked the key's row")
	default:
	}
}

package mysqllock

import (
	"context"
	"testing"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/internal/refusals"
)

// ReleaseQuery exposes the lease release statement (arguments: key, token),
// for a test that runs it inside a transaction of its own.
func ReleaseQuery(b *Backend) string { return b.q.release }

// CheckGalera runs g's Galera check under ctx on a connection pinned without
// it, as if ctx ended while the check's query ran.
func CheckGalera(ctx context.Context, g *GetLock) error {
	c, err := g.s.db.Conn(context.Background())
	if err != nil {
		return err
	}
	defer c.Close()
	return g.s.checkGalera(ctx, c)
}

// Doorbells returns the lease strategy's doorbells (nil without them).
func Doorbells(b *Backend) *GetLock { return b.bell }

// DoorbellName returns the named lock that is key's doorbell.
func DoorbellName(b *Backend, key string) string { return b.bell.name(key) }

// HoldsDoorbell reports whether tok holds key's doorbell.
func HoldsDoorbell(b *Backend, key string, tok dlock.Token) bool {
	return b.bell.sessionOf(key, tok) != 0
}

// MainWaitTimeout reads @@session.wait_timeout on g's shared session.
func MainWaitTimeout(ctx context.Context, g *GetLock) (secs int, err error) {
	g.mu.Lock()
	ss := g.main
	g.mu.Unlock()
	err = ss.queryRow(ctx, "SELECT @@session.wait_timeout", nil, &secs)
	return secs, err
}

// RowLockWaitTimeout reads @@session.wait_timeout on the session where r
// holds key.
func RowLockWaitTimeout(ctx context.Context, r *RowLock, key string) (secs int, err error) {
	r.mu.Lock()
	h := r.held[key]
	r.mu.Unlock()
	h.ss.mu.Lock()
	defer h.ss.mu.Unlock()
	err = h.tx.QueryRowContext(ctx, "SELECT @@session.wait_timeout").Scan(&secs)
	return secs, err
}

// LockBusy exposes rowlock's "not acquired" error classification.
var LockBusy = lockBusy

// GetLockName returns the named lock that g takes for key.
func GetLockName(g *GetLock, key string) string { return g.name(key) }

// KnowsDoorbell reports whether b counts key's doorbell as held on one of
// its sessions (a session found gone no longer counts).
func KnowsDoorbell(b *Backend, key string) bool {
	g := b.bell
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, ss := range g.byToken {
		if _, ok := ss.keys[key]; ok && !ss.broken.Load() {
			return true
		}
	}
	return false
}

// IdleSessionsTwice reports whether a session is parked twice among g's
// sessions kept for reuse (two acquisitions would then share it).
func IdleSessionsTwice(g *GetLock) bool {
	g.s.mu.Lock()
	defer g.s.mu.Unlock()
	seen := map[*session]bool{}
	for _, ss := range g.s.idle {
		if seen[ss] {
			return true
		}
		seen[ss] = true
	}
	return false
}

// Replication is what Check reads of a server's replication.
type Replication = replication

// ReplicationFindings decides Check's replication findings.
var ReplicationFindings = replicationFindings

// SkipSessionResize keeps a full session table's compaction from restoring
// its size limit until t ends.
func SkipSessionResize(t testing.TB) {
	skipResize.Store(true)
	t.Cleanup(func() { skipResize.Store(false) })
}

// BarrierName exposes the commit barrier's named lock of a key.
var BarrierName = barrierName

// AcquireOnOwnSession is g's blocking acquisition on a session of its
// own, without AcquireWait's first try on the shared session.
func AcquireOnOwnSession(ctx context.Context, g *GetLock, req dlock.Request) (dlock.Result, error) {
	return g.acquireWait(ctx, req, maxWait, nil)
}

// OnMainSession reports whether tok holds its key on g's shared session.
func OnMainSession(g *GetLock, tok dlock.Token) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	ss := g.byToken[tok]
	return ss != nil && ss == g.main
}

// HeldFor is how long a refused try makes AcquireWait wait at once.
const HeldFor = refusals.For

// GrantProc returns the grant procedure of the lock table table (quoted).
func GrantProc(table string) string { return grantProc(table) }

package mysqllock

import "testing"

// OnRowLocked makes RowLock call f with the key and the locking session's
// connection id between locking a row and writing its fence, until t ends.
func OnRowLocked(t testing.TB, f func(key string, connID int64)) {
	rowLockedHook.Store(&f)
	t.Cleanup(func() { rowLockedHook.Store(nil) })
}

// WaitCut exposes rowlock's "a time limit ended the wait" classification.
var WaitCut = waitCut

package mysqllock

import "github.com/dlock-dev/dlock"

var (
	_ dlock.SessionBound = (*GetLock)(nil)
	_ dlock.SessionBound = (*RowLock)(nil)
)

// SessionBound implements dlock.SessionBound: a named lock ends with the
// server session that holds it. GetLock keeps a lock-delay in the key's
// record instead (dlock.LockDelayer).
func (g *GetLock) SessionBound() {}

// SessionBound implements dlock.SessionBound: a row lock ends with the
// transaction, and so the session, that holds it. RowLock keeps a
// lock-delay in the key's record instead (dlock.LockDelayer).
func (r *RowLock) SessionBound() {}

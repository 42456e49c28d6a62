package mysqllock

import "github.com/dlock-dev/dlock"

var (
	_ dlock.SessionBound = (*GetLock)(nil)
	_ dlock.SessionBound = (*RowLock)(nil)
)

// SessionBound implements dlock.SessionBound: a named lock ends with the
// server session that holds it, so it cannot keep a lock-delay.
func (g *GetLock) SessionBound() {}

// SessionBound implements dlock.SessionBound: a row lock ends with the
// transaction, and so the session, that holds it, so it cannot keep a
// lock-delay.
func (r *RowLock) SessionBound() {}

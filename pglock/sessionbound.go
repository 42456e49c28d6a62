package pglock

import "github.com/dlock-dev/dlock"

var _ dlock.SessionBound = (*Advisory)(nil)

// SessionBound implements dlock.SessionBound: an advisory lock ends with
// the server session that holds it, so it cannot keep a lock-delay.
func (a *Advisory) SessionBound() {}

package pglock

import (
	"context"

	"github.com/dlock-dev/dlock"
)

// GrantAfterSessionLoss runs Acquire's steps for req with a concurrent
// renewal's reaction to a lost session in between: Acquire picks the main
// session, then (before it locks the session for its statement) a renewal
// on that session finds it gone and discards it (Extend → lost), then
// Acquire runs its grant statement on the session it picked. It returns the
// grant's outcome.
func GrantAfterSessionLoss(ctx context.Context, a *Advisory, req dlock.Request) (bool, uint64, error) {
	ss, err := a.mainSession(ctx, req.TTL)
	if err != nil {
		return false, 0, err
	}
	a.lost(ss)
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return a.grant(ctx, ss, a.q.try, hashKey(req.Key), req, statementTimeout)
}

// SetAfterUnlock sets the hook Release runs between its unlock statement
// and its bookkeeping.
func SetAfterUnlock(a *Advisory, f func()) { a.afterUnlock = f }

// SessionCounts returns the number of holds each pinned session carries,
// and how many holds the Advisory has on its books.
func SessionCounts(a *Advisory) (counts []int, held int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for ss := range a.all {
		counts = append(counts, ss.n)
	}
	return counts, len(a.held)
}

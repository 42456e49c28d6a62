package pglock

import (
	"context"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/internal/refusals"
)

// GrantAfterSessionLoss runs Acquire's steps for req with the main
// session's end in between: Acquire picks the main session, then the
// session ends (as when the server drops it) before Acquire's grant runs on
// it. It returns the grant's outcome.
func GrantAfterSessionLoss(ctx context.Context, a *Advisory, req dlock.Request) (bool, uint64, error) {
	ss, err := a.mainSession(ctx)
	if err != nil {
		return false, 0, err
	}
	ss.stop()
	<-ss.exited
	var res grantResult
	err = ss.do(ctx, statementBound, false, func(jctx context.Context, j *job) error {
		return a.grant(jctx, j, ss, a.q.try, hashKey(req.Key), req, &res)
	})
	return res.ok, res.fence, err
}

// SetAfterUnlock sets the hook Release runs between its unlock statement
// and its bookkeeping.
func SetAfterUnlock(a *Advisory, f func()) { a.afterUnlock = f }

// SetGrantHook sets the hook that receives the synchronous_commit in force
// in each grant's transaction.
func SetGrantHook(a *Advisory, f func(syncCommit string)) { a.grantHook = f }

// SessionCounts returns the number of holds each pinned session carries,
// and how many holds the Advisory has on its books.
func SessionCounts(a *Advisory) (counts []int, held int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for ss := range a.all {
		counts = append(counts, ss.n)
	}
	for _, hs := range a.held {
		held += len(hs)
	}
	return counts, held
}

// Replication is what Check reads of a server's replication.
type Replication = replication

// Standby is a row of pg_stat_replication.
type Standby = standby

// ReplicationFindings decides Check's replication findings.
var ReplicationFindings = replicationFindings

// OnMainSession reports whether token holds key on a's main session.
func OnMainSession(a *Advisory, key string, token dlock.Token) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	h := a.find(key, token)
	return h != nil && h.ss == a.main
}

// RefusalsLast is how long a refused try makes AcquireWait wait at once.
const RefusalsLast = refusals.For

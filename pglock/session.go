package pglock

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/internal/repeat"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// A session is a server session that the advisory strategy pins: a
// connection of its own, opened from the pool's configuration but outside
// the pool (so that it never takes one of the user's connections), and one
// goroutine that owns it. Every statement on the session runs in that
// goroutine, as a job, one at a time, under a context of its own bounded by
// a fixed limit: never under a caller's context, whose end would make pgx
// close the connection and the server free every lock of the session.
//
// A caller that stops waiting for its job (its context ended) gets its
// error at once. If the job had started, the caller sends cancel requests,
// which end the statement (error 57014) and leave the session alone; the
// job settles what its statement did without the caller (a grant nobody
// will use is unlocked). The server discards a cancel request that reaches
// a session between statements, so one sent just before the job's
// statement arrives would leave a wait queued in the server for its whole
// bound: the requests are repeated (see cancelRepeat) until the job
// stops them, which it does before any statement that cleans up (see
// waitCancel), and a job checks that its caller still waits before it
// sends a wait. The next job starts only once the last cancel request has
// been delivered, so that a cancel can only reach the job it was meant for.
// Every statement still treats 57014 as "outcome unknown".
//
// Between jobs the goroutine waits on the connection, so that a session the
// server ends (pg_terminate_backend, idle_session_timeout, a crash) is seen
// at once, and every lock it held is reported lost.
type session struct {
	a      *Advisory
	conn   *pgx.Conn // used by the session's goroutine only (and for cancel requests)
	pid    uint32
	ctx    context.Context // ended by stop: aborts the statement, ends the goroutine
	stop   context.CancelFunc
	exited chan struct{} // closed when the goroutine has ended and the connection is closed

	mu    sync.Mutex // guards the fields below
	queue []*job
	wake  context.CancelFunc // ends the wait between jobs
	gone  bool               // the goroutine ended or is ending: no more jobs

	timeout  atomic.Int64 // idle_session_timeout as set, in ns (0: not set; noIdleTimeout: disabled)
	lastUsed atomic.Int64 // UnixNano of the last job
	n        int          // locks held; guarded by Advisory.mu
	parkedAt time.Time    // guarded by Advisory.mu
}

// Bounds of a job's statements. A statement that outlives its bound makes
// pgx close the connection, which ends the session: they are far beyond
// anything a healthy server takes, and only a server that stopped answering
// reaches them.
const (
	statementBound = time.Minute
	cancelTimeout  = 5 * time.Second
	// cancelRepeat is how soon a caller that left repeats its cancel
	// request while its job runs; the interval doubles after each, up to
	// cancelRepeatMax (a statement that ignores cancels, such as a commit
	// waiting for a standby, then draws one connection a second).
	cancelRepeat    = 50 * time.Millisecond
	cancelRepeatMax = time.Second
)

// errSessionGone is the error of a job whose session ended before it ran.
var errSessionGone = errors.New("pglock: the advisory strategy's server session ended")

// A job is work for a session's goroutine. run executes its statements on
// the session; it calls settle once it knows its outcome, to learn whether
// its caller still waits for it.
type job struct {
	run   func(ctx context.Context, j *job) error
	bound time.Duration
	done  chan struct{} // closed when run has returned; err is set then
	err   error

	mu         sync.Mutex
	started    bool
	settled    bool
	left       bool          // the caller stopped waiting before settle
	cancelSent chan struct{} // non-nil once the caller sends cancel requests; closed when the last is delivered
	hushed     bool          // no more cancel requests are to be sent
	hush       chan struct{} // closed when hushed is set
}

// newJob returns a job that runs run, bounded by bound.
func newJob(run func(ctx context.Context, j *job) error, bound time.Duration) *job {
	return &job{run: run, bound: bound, done: make(chan struct{}), hush: make(chan struct{})}
}

// settle records that the job knows its outcome, and reports whether the
// caller takes it (true) or has left (false: the job must undo what nobody
// will use, after waitCancel).
func (j *job) settle() bool {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.settled = true
	j.stopCancels()
	return !j.left
}

// stopCancels ends the caller's repeated cancel requests; j.mu is held.
func (j *job) stopCancels() {
	if !j.hushed {
		j.hushed = true
		close(j.hush)
	}
}

// waitCancel stops the cancel requests sent for the job, if any, and
// returns when the last one has been delivered or given up: a statement
// sent after it cannot be cancelled.
func (j *job) waitCancel() {
	j.mu.Lock()
	j.stopCancels()
	c := j.cancelSent
	j.mu.Unlock()
	if c != nil {
		<-c
	}
}

// callerLeft reports whether the job's caller stopped waiting for it.
func (j *job) callerLeft() bool {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.left
}

// start reports whether the job is to run (its caller did not leave while
// it was queued).
func (j *job) start() bool {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.left {
		return false
	}
	j.started = true
	return true
}

// newSession starts the goroutine of a connected session.
func (a *Advisory) newSession(conn *pgx.Conn, pid uint32) *session {
	ctx, stop := context.WithCancel(context.Background())
	ss := &session{a: a, conn: conn, pid: pid, ctx: ctx, stop: stop, exited: make(chan struct{})}
	ss.touch()
	a.wg.Add(1)
	go ss.loop()
	return ss
}

// touch records activity on the session.
func (ss *session) touch() { ss.lastUsed.Store(time.Now().UnixNano()) }

// isGone reports whether the session takes no more jobs.
func (ss *session) isGone() bool {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return ss.gone
}

// loop runs the session's jobs and watches the idle connection, until the
// session is stopped or lost.
func (ss *session) loop() {
	defer ss.a.wg.Done()
	var cause error // why the session ended; nil if stopped on purpose
	for cause == nil {
		ss.mu.Lock()
		if ss.ctx.Err() != nil {
			ss.mu.Unlock()
			break
		}
		if len(ss.queue) == 0 {
			wctx, cancel := context.WithCancel(ss.ctx)
			ss.wake = cancel
			ss.mu.Unlock()
			// Returns when woken (a job, stop) or when the server sends
			// something: a notice, or the error that ends the session.
			err := ss.conn.PgConn().WaitForNotification(wctx)
			woken := wctx.Err() != nil
			cancel()
			if err != nil && !woken {
				cause = err
			}
			continue
		}
		j := ss.queue[0]
		ss.queue = ss.queue[1:]
		ss.wake = nil
		ss.mu.Unlock()
		if !j.start() {
			close(j.done)
			continue
		}
		jctx, cancel := context.WithTimeout(ss.ctx, j.bound)
		j.err = j.run(jctx, j)
		cancel()
		j.settle()
		j.waitCancel()
		ss.touch()
		if endsSession(j.err) {
			cause = j.err
		}
		close(j.done)
	}
	ss.mu.Lock()
	ss.gone = true
	queued := ss.queue
	ss.queue = nil
	ss.mu.Unlock()
	for _, j := range queued {
		j.err = errSessionGone
		close(j.done)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	_ = ss.conn.Close(ctx)
	cancel()
	ss.a.ended(ss, cause)
	close(ss.exited)
}

// endsSession reports whether a job's error means that its session is gone
// or unusable.
func endsSession(err error) bool {
	return err != nil && (sessionLost(err) || errors.Is(err, ErrTransactionPooling) || errors.Is(err, errSessionGone))
}

// sessionLost reports whether err leaves a session unusable: anything but an
// error the server reported for the statement, or a server error that ends
// the session (class 57P: admin shutdown, terminated, ...; 08: connection).
func sessionLost(err error) bool {
	if err == nil {
		return false
	}
	var pe *pgconn.PgError
	if !errors.As(err, &pe) {
		return true
	}
	return len(pe.Code) == 5 && (pe.Code[:3] == "57P" || pe.Code[:2] == "08") || pe.Severity == "FATAL"
}

// cancelled reports whether a statement was cancelled (by a cancel request).
func cancelled(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == codeQueryCanceled
}

// lockTimedOut reports whether a statement ended because a lock wait ran
// past lock_timeout; the session stays usable.
func lockTimedOut(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == codeLockTimeout
}

// errLeft marks the error of a caller that stopped waiting for its job.
var errLeft = errors.New("pglock: stopped waiting")

// errNotRun marks an errLeft whose job did not run and never will: what the
// job would have cleaned up (a session to park) is the caller's to clean.
var errNotRun = errors.New("pglock: the job did not run")

// do runs run as a job on ss, bounded by bound, and waits for it until ctx
// ends. Then, if the job was queued it never runs; if it was running, a
// cancel request ends its statement (unless detached: the job then runs to
// its end). It returns the job's error, or an error matching errLeft and
// ctx.Err() when the caller stopped waiting first (and errNotRun if the job
// never ran).
func (ss *session) do(ctx context.Context, bound time.Duration, detached bool, run func(ctx context.Context, j *job) error) error {
	if !detached && ctx.Err() != nil {
		return dlock.Join(errLeft, errNotRun, context.Cause(ctx))
	}
	j := newJob(run, bound)
	ss.mu.Lock()
	if ss.gone {
		ss.mu.Unlock()
		return errSessionGone
	}
	ss.queue = append(ss.queue, j)
	if ss.wake != nil {
		ss.wake()
		ss.wake = nil
	}
	ss.mu.Unlock()
	if ctx.Err() == nil {
		select {
		case <-j.done:
			return j.err
		case <-ctx.Done():
		}
	}
	if detached {
		return dlock.Join(errLeft, context.Cause(ctx))
	}
	j.mu.Lock()
	if j.settled {
		j.mu.Unlock()
		<-j.done
		return j.err
	}
	j.left = true
	send := j.started
	if send {
		j.cancelSent = make(chan struct{})
	}
	j.mu.Unlock()
	if !send { // queued: the session's goroutine skips it
		return dlock.Join(errLeft, errNotRun, context.Cause(ctx))
	}
	go func() {
		defer close(j.cancelSent)
		// Until the job is settled: then no statement of its is to end.
		repeat.Until(j.hush, cancelRepeat, cancelRepeatMax, func() {
			cctx, cancel := context.WithTimeout(context.Background(), cancelTimeout)
			_ = ss.conn.PgConn().CancelRequest(cctx)
			cancel()
		})
	}()
	return dlock.Join(errLeft, context.Cause(ctx))
}

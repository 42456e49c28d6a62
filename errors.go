package dlock

import (
	"errors"
	"fmt"
	"strings"
	"time"
)

// Sentinel errors. Callers branch on them with errors.Is; the errors dlock
// returns wrap them with context.
var (
	// ErrNotAcquired means the lock is held by someone else: TryAcquire found
	// it taken, or Acquire's context ended while waiting (then the error also
	// matches the context's error).
	ErrNotAcquired = errors.New("dlock: not acquired")

	// ErrLockLost means a held lock could not be kept: renewal was refused by
	// the backend or could not be confirmed before the lease's safe deadline.
	// Lock.Err returns it, and Do returns it when fn ran without the lock.
	ErrLockLost = errors.New("dlock: lock lost")

	// ErrNotHeld means a release or extension named a lock that is not held
	// by the caller (any more). Nothing was changed.
	ErrNotHeld = errors.New("dlock: not held")

	// ErrInvalidKey means a key is empty, longer than MaxKeyLen bytes, not
	// valid UTF-8, or contains a NUL byte. It is returned before any I/O.
	ErrInvalidKey = errors.New("dlock: invalid key")

	// ErrInvalidOption means an option is out of range (a TTL below MinTTL,
	// an owner or metadata string too long, a bad table name, ...). It is
	// returned before any I/O.
	ErrInvalidOption = errors.New("dlock: invalid option")

	// ErrClosed means the Locker was closed.
	ErrClosed = errors.New("dlock: locker closed")

	// ErrUnsupported means the backend does not offer an optional capability
	// (such as listing holders).
	ErrUnsupported = errors.New("dlock: not supported by this backend")

	// ErrModeMismatch means an acquisition disagrees with the key's current
	// holders on how the key is shared: a Limited acquisition with another
	// limit than theirs, or a Limited one for a key held Exclusive or
	// Shared (or the reverse), or a reentrant acquisition (WithOwner) in
	// another mode than the owner's hold. Nothing was changed.
	ErrModeMismatch = errors.New("dlock: key held in another mode or with another limit")

	// ErrNoSchema means the backend's table does not exist, or lacks what
	// this version needs: run the backend's Migrate (or `dlock migrate`).
	ErrNoSchema = errors.New("dlock: schema missing (run migrate)")

	// ErrStaleFence means a guarded write presented a fence older than the
	// newest its resource has recorded: the lock that gave it has passed to
	// a newer holder, who has written. Nothing was changed. The fence
	// helpers of every store (package fence, redislock, etcdlock) return it.
	ErrStaleFence = errors.New("dlock: stale fence")
)

// HeldError is returned when a lock is held by someone else. It matches
// ErrNotAcquired with errors.Is, and carries what the backend said about the
// current holder (fields may be zero when the backend could not tell).
type HeldError struct {
	Holder LockInfo
}

// Error describes the holder.
func (e *HeldError) Error() string {
	s := fmt.Sprintf("dlock: not acquired: %q is held", e.Holder.Key)
	if e.Holder.Owner != "" {
		s += " by " + e.Holder.Owner
	}
	if !e.Holder.ExpiresAt.IsZero() {
		s += fmt.Sprintf(", lease expires in %s", time.Until(e.Holder.ExpiresAt).Round(time.Millisecond))
	}
	return s
}

// Is reports whether target is ErrNotAcquired.
func (e *HeldError) Is(target error) bool { return target == ErrNotAcquired }

// Join returns an error that wraps every non-nil error of errs, as
// errors.Join does, but whose message is one line: the messages joined by
// "; ". It returns nil if every error is nil, and the error itself if only
// one is not. Backends use it so that log lines stay one line.
func Join(errs ...error) error {
	var nonNil []error
	for _, err := range errs {
		if err != nil {
			nonNil = append(nonNil, err)
		}
	}
	switch len(nonNil) {
	case 0:
		return nil
	case 1:
		return nonNil[0]
	}
	return joined(nonNil)
}

type joined []error

func (j joined) Error() string {
	msgs := make([]string, len(j))
	for i, err := range j {
		msgs[i] = strings.ReplaceAll(err.Error(), "\n", "; ")
	}
	return strings.Join(msgs, "; ")
}

func (j joined) Unwrap() []error { return j }

package dlock

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"
	"unicode/utf8"
)

// Options configure a Locker. The zero value (or nil) means all defaults.
type Options struct {
	// TTL is the lease of acquisitions made without WithTTL. The default is
	// DefaultTTL.
	TTL time.Duration

	// Margin is how long before the lease's end, measured on the client's
	// monotonic clock from the moment the acquisition or renewal was sent, a
	// lock whose renewal has not been confirmed is considered lost. It absorbs
	// clock-rate differences and the time to tell the holder. The default is
	// TTL/10 + 100ms. It must be less than half the TTL, and not negative.
	Margin time.Duration

	// Logger receives renewal failures and lock losses. The default discards
	// everything.
	Logger *slog.Logger

	// Metadata is attached to acquisitions made without WithMetadata. The
	// default names the host, process id and program.
	Metadata string

	// LockDelay is the lock-delay of acquisitions made without
	// WithLockDelay (see there). The default is 0: none.
	LockDelay time.Duration

	// Clock times leases, renewals and safe deadlines. The default is the
	// system's monotonic clock; another is for tests and fault injection
	// (see Clock).
	Clock Clock

	// Observer is told of acquisitions, releases, renewals and losses (see
	// Observer). The default, nil, observes nothing and costs nothing.
	Observer Observer
}

// AcquireOption configures one acquisition.
type AcquireOption func(*acquireConfig)

type acquireConfig struct {
	ttl       time.Duration
	owner     string
	metadata  *string
	onWait    func(LockInfo)
	shared    bool
	limit     int
	limitSet  bool
	minHold   time.Duration
	lockDelay time.Duration
}

// mode returns the acquisition's Mode.
func (c acquireConfig) mode() Mode {
	switch {
	case c.shared:
		return ModeShared
	case c.limitSet:
		return ModeLimited
	}
	return ModeExclusive
}

// Shared makes the acquisition a shared hold (ModeShared): any number
// of shared holders of the key at once, never together with an exclusive
// holder, which is what every acquisition without this option is. Once an
// exclusive acquisition waits for the key, new shared ones wait behind it.
// On a backend that cannot share keys the acquisition fails with
// ErrUnsupported before any I/O.
func Shared() AcquireOption {
	return func(c *acquireConfig) { c.shared = true }
}

// WithLimit makes the key a counting semaphore (ModeLimited): at most n
// holders at once, each with its own lease and fence. Every holder of the
// key must use the same n: an acquisition with another n, or in another
// mode, while the key is held fails with ErrModeMismatch. n is 1 to
// MaxLimit; it cannot be combined with Shared. On a backend that cannot
// limit holders the acquisition fails with ErrUnsupported before any I/O.
func WithLimit(n int) AcquireOption {
	return func(c *acquireConfig) { c.limit, c.limitSet = n, true }
}

// WithWaitFunc makes Acquire call fn with what is known of the holder each
// time an attempt finds the key taken, before it waits again (the dlock CLI
// shows a status line with it). fn must not block.
func WithWaitFunc(fn func(holder LockInfo)) AcquireOption {
	return func(c *acquireConfig) { c.onWait = fn }
}

// WithTTL sets the lease of this acquisition. It must be at least MinTTL; the
// lock is renewed every TTL/3 while held.
func WithTTL(ttl time.Duration) AcquireOption {
	return func(c *acquireConfig) { c.ttl = ttl }
}

// WithOwner makes the acquisition reentrant for owner: while this Locker holds
// the key for the same owner, another acquisition with the same owner succeeds
// at once, returns a Lock with the same fence and increments a count;
// the key is freed when every such Lock has been released. Owner identities
// are labels, not credentials: reentrancy is scoped to one Locker, and two
// Lockers (or processes) using the same owner still exclude each other. An
// owner is at most MaxOwnerLen bytes of UTF-8 without NUL; anything else is
// ErrInvalidOption.
func WithOwner(owner string) AcquireOption {
	return func(c *acquireConfig) { c.owner = owner }
}

// WithMetadata attaches a short description of the holder (at most
// MaxMetadataLen bytes of UTF-8 without NUL) that Locker.List and
// `dlock list` show.
func WithMetadata(s string) AcquireOption {
	return func(c *acquireConfig) { c.metadata = &s }
}

// WithMinHold keeps the key held for at least d from its acquisition,
// however soon the Lock is released: a release (or Close) before then does
// not free the key but sets its lease in the store to what is left of d,
// by the store's clock, and stops renewing it; the key is then free when
// that lease runs out. The rest is counted from the sending of the
// acquisition, with the acquisition's round trip and the lease's margin
// added, so the key stays held at least until the store's grant plus d,
// and at most about that margin longer. A job that runs on several hosts
// from clocks that disagree then runs once per d, however fast it is (the
// lockAtLeastFor of scheduled jobs). The store must accept a lease as
// long as d. A reentrant acquisition keeps the first one's minimum hold.
// Backends that set a lease to any TTL, past the client's life, keep it
// in the lease (dlock.TTLExtender: the lease strategies of MySQL,
// PostgreSQL, Redis, SQLite and etcd). The session strategies (MySQL's
// getlock and rowlock, PostgreSQL's advisory) keep it for exclusive locks
// in the key's row (dlock.HoldKeeper): the release frees the lock and
// refuses every acquisition until what is left of d has passed, by the
// server's clock; a holder whose session ends without a release (a crash)
// frees the key at once there, or after its lock-delay. Elsewhere (ZooKeeper,
// whose nodes end with their session and which has no timer on its own
// clock) it is ErrUnsupported before any I/O. d must not be negative; 0
// (the default) frees the key at its release.
func WithMinHold(d time.Duration) AcquireOption {
	return func(c *acquireConfig) { c.minHold = d }
}

// WithLockDelay keeps the key from the next holder for d after this lock
// ends without a release: a holder that was paused, cut off, stuck or
// killed, and then told of its loss (or not told at all), has d more, by
// the store's clock, to stop before anyone else can take the key (Chubby's
// and Consul's lock-delay). A release, a Close and the end of a minimum
// hold (WithMinHold) free the key at once. Use it for work that cannot
// check a fence and takes a bounded time to stop; the cost is d more of
// unavailability after a crash. d must not be negative; 0 is none.
//
// On a lease, the store's lease is the TTL plus d, while the holder counts
// its own lease, its renewals and its loss notice from the TTL alone, and a
// lease lost this way is not released in the background: the key stays
// held until TTL + d after the grant. The store must accept a lease of
// TTL + d.
//
// On a lock that lives in a server session (dlock.SessionBound:
// mysqllock's getlock and rowlock, pglock's advisory), the backend keeps
// the delay itself (dlock.LockDelayer): after the session ends without a
// release, the next acquirer finds the lock ended that way and keeps the
// key from everyone for d from then; when the holder's renewals fail, the
// Locker tells the holder, then frees the lock as lost, and the key stays
// held for d from then. A session backend that cannot keep it refuses it
// with ErrUnsupported before any I/O.
func WithLockDelay(d time.Duration) AcquireOption {
	return func(c *acquireConfig) { c.lockDelay = d }
}

// ValidateKey reports whether key is acceptable: 1..MaxKeyLen bytes of valid
// UTF-8 without NUL bytes. The error wraps ErrInvalidKey.
func ValidateKey(key string) error {
	switch {
	case key == "":
		return fmt.Errorf("%w: empty", ErrInvalidKey)
	case len(key) > MaxKeyLen:
		return fmt.Errorf("%w: %d bytes, the limit is %d", ErrInvalidKey, len(key), MaxKeyLen)
	case !utf8.ValidString(key):
		return fmt.Errorf("%w: %q is not valid UTF-8", ErrInvalidKey, key)
	}
	for i := 0; i < len(key); i++ {
		if key[i] == 0 {
			return fmt.Errorf("%w: %q contains a NUL byte", ErrInvalidKey, key)
		}
	}
	return nil
}

func validateText(what, s string, max int) error {
	if len(s) > max {
		return fmt.Errorf("%w: %s is %d bytes, the limit is %d", ErrInvalidOption, what, len(s), max)
	}
	if !utf8.ValidString(s) {
		return fmt.Errorf("%w: %s is not valid UTF-8", ErrInvalidOption, what)
	}
	if strings.IndexByte(s, 0) >= 0 {
		// Some stores cannot keep NUL in text (PostgreSQL).
		return fmt.Errorf("%w: %s contains a NUL byte", ErrInvalidOption, what)
	}
	return nil
}

// marginFor returns the safety margin for a lease of ttl.
func (l *Locker) marginFor(ttl time.Duration) time.Duration {
	if l.margin > 0 {
		return l.margin
	}
	return ttl/10 + 100*time.Millisecond
}

func (l *Locker) config(key string, opts []AcquireOption) (acquireConfig, error) {
	c := acquireConfig{ttl: l.ttl, lockDelay: l.lockDelay}
	for _, o := range opts {
		o(&c)
	}
	if err := ValidateKey(key); err != nil {
		return c, err
	}
	if c.ttl < MinTTL {
		return c, fmt.Errorf("%w: ttl %s is below the minimum %s", ErrInvalidOption, c.ttl, MinTTL)
	}
	for _, d := range []struct {
		what string
		d    time.Duration
	}{{"ttl", c.ttl}, {"lock-delay", c.lockDelay}, {"minimum hold", c.minHold}} {
		if d.d > MaxTTL {
			return c, fmt.Errorf("%w: %s %s is above the maximum %s", ErrInvalidOption, d.what, d.d, MaxTTL)
		}
	}
	if l.margin < 0 {
		return c, fmt.Errorf("%w: margin %s is negative", ErrInvalidOption, l.margin)
	}
	if m := l.marginFor(c.ttl); 2*m >= c.ttl {
		return c, fmt.Errorf("%w: margin %s must be less than half the ttl %s", ErrInvalidOption, m, c.ttl)
	}
	if err := validateText("owner", c.owner, MaxOwnerLen); err != nil {
		return c, err
	}
	if c.minHold < 0 {
		return c, fmt.Errorf("%w: minimum hold %s is negative", ErrInvalidOption, c.minHold)
	}
	if c.lockDelay < 0 {
		return c, fmt.Errorf("%w: lock-delay %s is negative", ErrInvalidOption, c.lockDelay)
	}
	if c.lockDelay > 0 && !keepsLockDelay(l.b) {
		return c, fmt.Errorf("%w: a lock-delay on a store whose locks end with their session", ErrUnsupported)
	}
	if c.minHold > 0 && !keepsMinHold(l.b, c.mode()) {
		return c, fmt.Errorf("%w: a minimum hold of a %s lock on a store that cannot keep a key past its release", ErrUnsupported, c.mode())
	}
	switch {
	case c.shared && c.limitSet:
		return c, fmt.Errorf("%w: Shared and WithLimit cannot be combined", ErrInvalidOption)
	case c.limitSet && (c.limit < 1 || c.limit > MaxLimit):
		return c, fmt.Errorf("%w: limit %d is outside 1..%d", ErrInvalidOption, c.limit, MaxLimit)
	}
	if m := c.mode(); m != ModeExclusive {
		if sh, ok := l.b.(Sharer); !ok || !sh.SupportsMode(m) {
			return c, fmt.Errorf("%w: %s acquisitions", ErrUnsupported, m)
		}
	}
	if c.metadata == nil {
		c.metadata = &l.meta
	}
	if err := validateText("metadata", *c.metadata, MaxMetadataLen); err != nil {
		return c, err
	}
	return c, nil
}

func defaultMetadata() string {
	host, _ := os.Hostname()
	return fmt.Sprintf("host=%s pid=%d prog=%s", host, os.Getpid(), filepath.Base(os.Args[0]))
}

// keepsMinHold reports whether b can keep a minimum hold of a lock of mode
// m: in a lease whose TTL it sets past the client's life (TTLExtender), or
// in the key's row for an exclusive session lock (HoldKeeper).
func keepsMinHold(b Backend, m Mode) bool {
	if _, ok := b.(TTLExtender); ok {
		return true
	}
	_, ok := b.(HoldKeeper)
	return ok && m == ModeExclusive
}

// keepsLockDelay reports whether b can keep a lock-delay: a lease keeps it
// in its TTL, a SessionBound backend only if it is a LockDelayer.
func keepsLockDelay(b Backend) bool {
	if _, ok := b.(SessionBound); !ok {
		return true
	}
	_, ok := b.(LockDelayer)
	return ok
}

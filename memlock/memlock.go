// Package memlock is an in-memory dlock.Backend for examples, tests and the
// conformance suite's self-test. Locks exist only inside one process; it is
// not a substitute for a real store.
package memlock

import (
	"context"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/dlock-dev/dlock"
)

// Backend keeps leases in a map. The zero value is not usable; call New.
type Backend struct {
	mu   sync.Mutex
	keys map[string]*entry
}

var (
	_ dlock.Backend       = (*Backend)(nil)
	_ dlock.Lister        = (*Backend)(nil)
	_ dlock.ForceReleaser = (*Backend)(nil)
)

// entry is kept after release so that the fencing counter never resets.
type entry struct {
	info    dlock.LockInfo
	expires time.Time // zero when free
}

// New returns an empty Backend.
func New() *Backend { return &Backend{keys: make(map[string]*entry)} }

func (e *entry) heldAt(now time.Time) bool { return now.Before(e.expires) }

// Acquire implements dlock.Backend.
func (b *Backend) Acquire(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	if err := ctx.Err(); err != nil {
		return dlock.Result{}, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	now := time.Now()
	e := b.keys[req.Key]
	if e == nil {
		e = &entry{}
		b.keys[req.Key] = e
	}
	if e.heldAt(now) {
		return dlock.Result{Holder: e.info, Remaining: e.expires.Sub(now)}, nil
	}
	e.info = dlock.LockInfo{
		Key: req.Key, Owner: req.Owner, Token: req.Token, Fence: e.info.Fence + 1,
		AcquiredAt: now, ExpiresAt: now.Add(req.TTL), Metadata: req.Metadata,
	}
	e.expires = e.info.ExpiresAt
	return dlock.Result{Acquired: true, Fence: e.info.Fence}, nil
}

// Extend implements dlock.Backend.
func (b *Backend) Extend(ctx context.Context, leases []dlock.Lease) ([]error, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	now := time.Now()
	errs := make([]error, len(leases))
	for i, l := range leases {
		e := b.keys[l.Key]
		if e == nil || !e.heldAt(now) || e.info.Token != l.Token {
			errs[i] = dlock.ErrNotHeld
			continue
		}
		e.expires = now.Add(l.TTL)
		e.info.ExpiresAt = e.expires
	}
	return errs, nil
}

// Release implements dlock.Backend.
func (b *Backend) Release(ctx context.Context, key string, token dlock.Token) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	e := b.keys[key]
	if e == nil || !e.heldAt(time.Now()) || e.info.Token != token {
		return dlock.ErrNotHeld
	}
	e.expires = time.Time{}
	return nil
}

// List implements dlock.Lister.
func (b *Backend) List(ctx context.Context, prefix string) ([]dlock.LockInfo, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	now := time.Now()
	var out []dlock.LockInfo
	for k, e := range b.keys {
		if strings.HasPrefix(k, prefix) && e.heldAt(now) {
			out = append(out, e.info)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Key < out[j].Key })
	return out, nil
}

// ForceRelease implements dlock.ForceReleaser.
func (b *Backend) ForceRelease(ctx context.Context, key string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	e := b.keys[key]
	if e == nil || !e.heldAt(time.Now()) {
		return dlock.ErrNotHeld
	}
	e.expires = time.Time{}
	return nil
}

// Package memlock is an in-memory dlock.Backend for examples, tests and the
// conformance suite's self-test. Locks exist only inside one process; it is
// not a substitute for a real store. It grants every mode (dlock.Sharer).
package memlock

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/dlock-dev/dlock"
)

// Backend keeps leases in a map. The zero value is not usable; call New.
type Backend struct {
	mu       sync.Mutex
	keys     map[string]*entry
	watchers map[string]map[chan struct{}]struct{} // Watch's channels by key
	feeds    map[string]map[*feed]struct{}         // WatchHolders' feeds by key
}

var (
	_ dlock.Backend        = (*Backend)(nil)
	_ dlock.Lister         = (*Backend)(nil)
	_ dlock.ForceReleaser  = (*Backend)(nil)
	_ dlock.Sharer         = (*Backend)(nil)
	_ dlock.Watcher        = (*Backend)(nil)
	_ dlock.HolderWatcher  = (*Backend)(nil)
	_ dlock.MetadataSetter = (*Backend)(nil)
)

// entry is one key. It is kept after its holders leave so that the fencing
// counter never resets.
type entry struct {
	fence   uint64
	holders map[dlock.Token]*holder
	// writerUntil: an exclusive acquisition waits behind shared holders,
	// and new shared ones are refused, until then.
	writerUntil time.Time
}

type holder struct {
	info    dlock.LockInfo
	expires time.Time
}

// New returns an empty Backend.
func New() *Backend {
	return &Backend{
		keys:     make(map[string]*entry),
		watchers: make(map[string]map[chan struct{}]struct{}),
		feeds:    make(map[string]map[*feed]struct{}),
	}
}

// SupportsMode implements dlock.Sharer: every mode.
func (b *Backend) SupportsMode(dlock.Mode) bool { return true }

// live drops the expired holders of e and returns those left.
func (e *entry) live(now time.Time) map[dlock.Token]*holder {
	for t, h := range e.holders {
		if !now.Before(h.expires) {
			delete(e.holders, t)
		}
	}
	return e.holders
}

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
		e = &entry{holders: make(map[dlock.Token]*holder)}
		b.keys[req.Key] = e
	}
	hs := e.live(now)
	// Any holder blocks an exclusive request; an exclusive holder or a
	// queued writer blocks a shared one; the limit blocks a limited one.
	var block *holder
	for _, h := range hs {
		if h.info.Mode == dlock.ModeLimited || req.Mode == dlock.ModeLimited {
			if h.info.Mode != req.Mode || h.info.Limit != req.Limit {
				return dlock.Result{}, fmt.Errorf("memlock: %q is held %s, asked %s: %w",
					req.Key, dlock.DescribeMode(h.info.Mode, h.info.Limit), dlock.DescribeMode(req.Mode, req.Limit), dlock.ErrModeMismatch)
			}
			continue
		}
		if req.Mode == dlock.ModeExclusive || h.info.Mode == dlock.ModeExclusive {
			if block == nil || h.expires.Before(block.expires) {
				block = h
			}
		}
	}
	if req.Mode == dlock.ModeLimited && len(hs) >= req.Limit {
		for _, h := range hs {
			if block == nil || h.expires.Before(block.expires) {
				block = h
			}
		}
	}
	if block == nil && req.Mode == dlock.ModeShared && now.Before(e.writerUntil) {
		return dlock.Result{Holder: dlock.LockInfo{Key: req.Key}, Remaining: e.writerUntil.Sub(now)}, nil
	}
	if block != nil {
		if req.Mode == dlock.ModeExclusive && block.info.Mode == dlock.ModeShared {
			e.writerUntil = now.Add(dlock.WriterMark)
		}
		return dlock.Result{Holder: block.info, Remaining: block.expires.Sub(now)}, nil
	}
	if req.Mode == dlock.ModeExclusive {
		e.writerUntil = time.Time{}
	}
	e.fence++
	h := &holder{
		info: dlock.LockInfo{
			Key: req.Key, Owner: req.Owner, Token: req.Token, Fence: e.fence,
			AcquiredAt: now, ExpiresAt: now.Add(req.TTL), Metadata: req.Metadata,
			Mode: req.Mode, Limit: req.Limit,
		},
		expires: now.Add(req.TTL),
	}
	hs[req.Token] = h
	b.changedLocked(req.Key)
	return dlock.Result{Acquired: true, Fence: e.fence}, nil
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
		h := b.holder(l.Key, l.Token, now)
		if h == nil {
			errs[i] = dlock.ErrNotHeld
			continue
		}
		h.expires = now.Add(l.TTL)
		h.info.ExpiresAt = h.expires
	}
	return errs, nil
}

// holder returns key's unexpired holder with token, or nil.
func (b *Backend) holder(key string, token dlock.Token, now time.Time) *holder {
	e := b.keys[key]
	if e == nil {
		return nil
	}
	return e.live(now)[token]
}

// Release implements dlock.Backend.
func (b *Backend) Release(ctx context.Context, key string, token dlock.Token) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.holder(key, token, time.Now()) == nil {
		return dlock.ErrNotHeld
	}
	delete(b.keys[key].holders, token)
	b.changedLocked(key)
	return nil
}

// List implements dlock.Lister: every holder, ordered by key, then fence.
func (b *Backend) List(ctx context.Context, prefix string) ([]dlock.LockInfo, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.listLocked(func(k string) bool { return strings.HasPrefix(k, prefix) }), nil
}

// listLocked returns the live holders of the keys match accepts, ordered by
// key, then fence.
func (b *Backend) listLocked(match func(key string) bool) []dlock.LockInfo {
	now := time.Now()
	var out []dlock.LockInfo
	for k, e := range b.keys {
		if !match(k) {
			continue
		}
		for _, h := range e.live(now) {
			out = append(out, h.info)
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Key != out[j].Key {
			return out[i].Key < out[j].Key
		}
		return out[i].Fence < out[j].Fence
	})
	return out
}

// ForceRelease implements dlock.ForceReleaser: it frees every holder of key.
func (b *Backend) ForceRelease(ctx context.Context, key string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	e := b.keys[key]
	if e == nil || len(e.live(time.Now())) == 0 {
		return dlock.ErrNotHeld
	}
	clear(e.holders)
	b.changedLocked(key)
	return nil
}

// SetMetadata implements dlock.MetadataSetter.
func (b *Backend) SetMetadata(ctx context.Context, key string, token dlock.Token, metadata string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	h := b.holder(key, token, time.Now())
	if h == nil {
		return dlock.ErrNotHeld
	}
	h.info.Metadata = metadata
	b.changedLocked(key)
	return nil
}

// Watch implements dlock.Watcher. Expiries are not reported: nothing here
// notices them as they happen.
func (b *Backend) Watch(ctx context.Context, key string) (<-chan struct{}, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	ch := make(chan struct{}, 1)
	b.mu.Lock()
	ws := b.watchers[key]
	if ws == nil {
		ws = make(map[chan struct{}]struct{})
		b.watchers[key] = ws
	}
	ws[ch] = struct{}{}
	b.mu.Unlock()
	context.AfterFunc(ctx, func() {
		b.mu.Lock()
		defer b.mu.Unlock()
		delete(ws, ch)
		if len(ws) == 0 && b.watchers[key] != nil && len(b.watchers[key]) == 0 {
			delete(b.watchers, key)
		}
		close(ch)
	})
	return ch, nil
}

// maxFeed is how many changes a WatchHolders feed keeps for a reader that
// is behind before it gives up (closes its channel).
const maxFeed = 1024

// feed is one WatchHolders call: the changes not yet read.
type feed struct {
	mu      sync.Mutex
	pending [][]dlock.LockInfo
	over    bool          // more than maxFeed pending: the feed ends
	wake    chan struct{} // one buffered signal
}

// WatchHolders implements dlock.HolderWatcher. Expiries are not reported
// (nothing here notices them as they happen): the holders carry ExpiresAt.
func (b *Backend) WatchHolders(ctx context.Context, key string) ([]dlock.LockInfo, <-chan []dlock.LockInfo, error) {
	if err := ctx.Err(); err != nil {
		return nil, nil, err
	}
	f := &feed{wake: make(chan struct{}, 1)}
	b.mu.Lock()
	now := b.listLocked(func(k string) bool { return k == key })
	fs := b.feeds[key]
	if fs == nil {
		fs = make(map[*feed]struct{})
		b.feeds[key] = fs
	}
	fs[f] = struct{}{}
	b.mu.Unlock()
	out := make(chan []dlock.LockInfo)
	go func() {
		defer close(out)
		defer func() {
			b.mu.Lock()
			delete(fs, f)
			if len(fs) == 0 && len(b.feeds[key]) == 0 {
				delete(b.feeds, key)
			}
			b.mu.Unlock()
		}()
		for {
			select {
			case <-f.wake:
			case <-ctx.Done():
				return
			}
			f.mu.Lock()
			batch, over := f.pending, f.over
			f.pending = nil
			f.mu.Unlock()
			if over {
				return
			}
			for _, hs := range batch {
				select {
				case out <- hs:
				case <-ctx.Done():
					return
				}
			}
		}
	}()
	return now, out, nil
}

// changedLocked tells key's watchers and feeds of a change.
func (b *Backend) changedLocked(key string) {
	if fs := b.feeds[key]; len(fs) > 0 {
		hs := b.listLocked(func(k string) bool { return k == key })
		for f := range fs {
			f.mu.Lock()
			if f.pending = append(f.pending, hs); len(f.pending) > maxFeed {
				f.over = true
			}
			f.mu.Unlock()
			select {
			case f.wake <- struct{}{}:
			default:
			}
		}
	}
	for ch := range b.watchers[key] {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
}

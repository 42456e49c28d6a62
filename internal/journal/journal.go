// Package journal implements dlock.HolderWatcher for stores that cannot
// notify another session (MySQL, SQLite): each change of a key's holders
// writes an entry, numbered per key, in the transaction that makes it, and
// a watcher reads the entries after its position with a backoff.
package journal

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dlock-dev/dlock"
)

// Kinds of Entry.
const (
	// Exclusive gives the key's exclusive holder after the change (a grant,
	// a release, a metadata change); Info.Token is zero when there is none.
	// An exclusive holder excludes every other, so one that holds also ends
	// the shared and limited holders the watcher still knows (their leases
	// have run out).
	Exclusive = 'x'
	// Granted adds a shared or limited holder (Info); it ends the exclusive
	// holder the watcher still knows, as Exclusive ends the others.
	Granted = 'g'
	// Released removes the shared or limited holder of Info.Token.
	Released = 'r'
	// Metadata sets the metadata of the shared or limited holder of
	// Info.Token to Info.Metadata.
	Metadata = 'm'
)

// Entry is one change of a key's holders.
type Entry struct {
	Seq  uint64 // the key's journal position: 1, 2, 3, … with no gap
	Kind byte
	Info dlock.LockInfo
}

// Scan reads the journal rows of key that a store's query returns, whose
// columns are, in order: the position, the kind (one character), the
// holder's token, owner and fence, its share limit, when it was acquired
// (Unix µs), how long its lease had left when read (µs, by the store's
// clock), its metadata, and its mode ("exclusive", "shared" or "limited").
func Scan(rows *sql.Rows, key string) ([]Entry, error) {
	defer rows.Close()
	readAt := time.Now()
	var out []Entry
	for rows.Next() {
		var (
			e                       Entry
			kind, mode              string
			token                   []byte
			acquiredUs, remainingUs int64
		)
		if err := rows.Scan(&e.Seq, &kind, &token, &e.Info.Owner, &e.Info.Fence, &e.Info.Limit,
			&acquiredUs, &remainingUs, &e.Info.Metadata, &mode); err != nil {
			return nil, err
		}
		if len(kind) != 1 {
			return nil, fmt.Errorf("journal entry %d of %q has kind %q", e.Seq, key, kind)
		}
		e.Kind = kind[0]
		copy(e.Info.Token[:], token)
		e.Info.Key = key
		e.Info.AcquiredAt = time.UnixMicro(acquiredUs)
		e.Info.ExpiresAt = readAt.Add(time.Duration(remainingUs) * time.Microsecond)
		switch mode {
		case "shared":
			e.Info.Mode = dlock.ModeShared
		case "limited":
			e.Info.Mode = dlock.ModeLimited
		}
		out = append(out, e)
	}
	return out, rows.Err()
}

// Source is a store's journal, and its holders as dlock.Lister reports
// them.
type Source interface {
	dlock.Lister
	// Position returns the position of key's last change (0 if none).
	Position(ctx context.Context, key string) (uint64, error)
	// Read returns key's entries after position after, in order, at most
	// limit of them.
	Read(ctx context.Context, key string, after uint64, limit int) ([]Entry, error)
}

// Poll bounds: a watcher reads again after MinPoll when the last read found
// entries, and after up to MaxPoll when nothing changes.
const (
	MinPoll = 5 * time.Millisecond
	MaxPoll = time.Second
)

// page is how many entries one read asks for; a reader that is behind has
// at most one page in memory.
const page = 128

// Watch implements dlock.HolderWatcher.WatchHolders over src: it reads
// key's holders between two reads of its position that agree (at most
// snapshotTries times: a key that changes faster fails the call), then reads the entries after it, after
// MinPoll, doubling up to MaxPoll while none come (bell, if not nil, cuts
// the wait short), and sends the holders after each entry that changes
// them. The channel is closed when ctx ends, when a read fails, and when
// the entry after the watcher's position is missing (pruned: the watcher
// was too far behind).
func Watch(ctx context.Context, src Source, key string, bell *Bell) ([]dlock.LockInfo, <-chan []dlock.LockInfo, error) {
	hs, pos, err := snapshot(ctx, src, key)
	if err != nil {
		return nil, nil, err
	}
	out := make(chan []dlock.LockInfo)
	go follow(ctx, src, key, bell, newState(hs), pos, out)
	return hs, out, nil
}

// snapshotTries bounds the reads of a snapshot.
const snapshotTries = 20

// ErrBusy is the error of a Watch whose key changed during every read of
// its holders.
var ErrBusy = errors.New("the key changed during every read of its holders")

func snapshot(ctx context.Context, src Source, key string) ([]dlock.LockInfo, uint64, error) {
	for range snapshotTries {
		before, err := src.Position(ctx, key)
		if err != nil {
			return nil, 0, err
		}
		hs, err := holders(ctx, src, key)
		if err != nil {
			return nil, 0, err
		}
		after, err := src.Position(ctx, key)
		if err != nil {
			return nil, 0, err
		}
		if before == after {
			return hs, after, nil
		}
	}
	return nil, 0, ErrBusy
}

// holders returns the holders of key itself, not of the keys it prefixes.
func holders(ctx context.Context, l dlock.Lister, key string) ([]dlock.LockInfo, error) {
	hs, err := l.List(ctx, key)
	return slices.DeleteFunc(hs, func(h dlock.LockInfo) bool { return h.Key != key }), err
}

func follow(ctx context.Context, src Source, key string, bell *Bell, st *state, pos uint64, out chan<- []dlock.LockInfo) {
	defer close(out)
	var ring <-chan struct{}
	last := st.list(key)
	wait := MinPoll
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		if bell != nil {
			ring = bell.wait()
		}
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
		case <-ring:
			timer.Stop()
		}
		es, err := src.Read(ctx, key, pos, page)
		if err != nil {
			return
		}
		for _, e := range es {
			if e.Seq != pos+1 {
				return // pruned before this watcher read it
			}
			pos = e.Seq
			st.apply(e)
			hs := st.list(key)
			if same(hs, last) {
				continue
			}
			last = hs
			select {
			case out <- hs:
			case <-ctx.Done():
				return
			}
		}
		if len(es) > 0 {
			wait = MinPoll
		} else {
			wait = min(2*wait, MaxPoll)
		}
		timer.Reset(wait)
	}
}

// state is the holders a watcher knows, as the entries leave them.
type state struct {
	excl   *dlock.LockInfo
	others []dlock.LockInfo // by fence
}

func newState(hs []dlock.LockInfo) *state {
	st := &state{}
	for _, h := range hs {
		if h.Mode == dlock.ModeExclusive {
			st.excl = &h
		} else {
			st.others = append(st.others, h)
		}
	}
	return st
}

func (st *state) apply(e Entry) {
	switch e.Kind {
	case Exclusive:
		st.excl = nil
		if e.Info.Token != (dlock.Token{}) {
			info := e.Info
			st.excl, st.others = &info, nil
		}
	case Granted:
		st.excl = nil
		st.remove(e.Info.Token)
		st.others = append(st.others, e.Info)
		slices.SortStableFunc(st.others, func(a, b dlock.LockInfo) int { return cmp.Compare(a.Fence, b.Fence) })
	case Released:
		st.remove(e.Info.Token)
	case Metadata:
		for i := range st.others {
			if st.others[i].Token == e.Info.Token {
				st.others[i].Metadata = e.Info.Metadata
			}
		}
	}
}

func (st *state) remove(t dlock.Token) {
	st.others = slices.DeleteFunc(st.others, func(h dlock.LockInfo) bool { return h.Token == t })
}

// list returns the holders, the exclusive one first, each with key as Key.
func (st *state) list(key string) []dlock.LockInfo {
	var hs []dlock.LockInfo
	if st.excl != nil {
		hs = append(hs, *st.excl)
	}
	hs = append(hs, st.others...)
	for i := range hs {
		hs[i].Key = key
	}
	return hs
}

// same reports whether a and b are the same holders with the same metadata.
func same(a, b []dlock.LockInfo) bool {
	return slices.EqualFunc(a, b, func(x, y dlock.LockInfo) bool {
		return x.Token == y.Token && x.Fence == y.Fence && x.Metadata == y.Metadata
	})
}

// Bell wakes a process's own watchers when the process changes holders, so
// that they need not wait for their next poll. The zero value is ready.
type Bell struct {
	armed atomic.Bool // some watcher waits on ch
	mu    sync.Mutex
	ch    chan struct{}
}

// Ring wakes the watchers waiting now; it costs one atomic load while none
// waits.
func (b *Bell) Ring() {
	if !b.armed.Load() {
		return
	}
	b.mu.Lock()
	if b.ch != nil {
		close(b.ch)
		b.ch = nil
		b.armed.Store(false)
	}
	b.mu.Unlock()
}

func (b *Bell) wait() <-chan struct{} {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.ch == nil {
		b.ch = make(chan struct{})
		b.armed.Store(true)
	}
	return b.ch
}

package zklock

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"

	"github.com/dlock-dev/dlock"
	"github.com/go-zookeeper/zk"
)

var _ dlock.HolderWatcher = (*Backend)(nil)

// snapshotTries bounds the reads of the holders that WatchHolders starts
// from.
const snapshotTries = 20

// errGap means a journal entry that a watcher had not read is gone.
var errGap = errors.New("a change was missed")

// WatchHolders implements dlock.HolderWatcher: see "Watching every change"
// in the package doc. It reads the journal's position, the key's holders
// and the position again, until the two positions agree (an error after 20
// reads that do not), and then follows the journal and the queue, woken by
// a child watch on each. Holders are reported as by List, except that a
// node whose lease has run out counts until it is deleted (its ExpiresAt
// tells). The channel is closed when ctx ends, when the session ends or a
// watch cannot be set again, when an entry the watcher had not read is gone
// (pruned while the reader was 256 changes or a minute behind, or written
// by a session that ended), and when the journal was removed.
func (b *Backend) WatchHolders(ctx context.Context, key string) ([]dlock.LockInfo, <-chan []dlock.LockInfo, error) {
	w := &holderWatch{b: b, key: key, dir: b.dir(key), jdir: b.jdir(key)}
	hs, err := run(ctx, w.start, nil)
	if err != nil {
		return nil, nil, fmt.Errorf("zklock: watch holders of %q: %w", key, err)
	}
	out := make(chan []dlock.LockInfo)
	go w.follow(ctx, out)
	return hs, out, nil
}

// position is how far a key's journal goes: the journal node's creation
// (0 if it does not exist) and its version (the number of entries written
// to it).
type position struct {
	czxid   int64
	version int32
}

func positionOf(st *zk.Stat) position {
	if st == nil {
		return position{}
	}
	return position{st.Czxid, st.Version}
}

// holderWatch is the state of one WatchHolders. Only its goroutine uses it
// (at first, WatchHolders).
type holderWatch struct {
	b              *Backend
	key, dir, jdir string
	pos            position
	last           int64 // sequence of the newest entry read
	known          []dlock.LockInfo
	journal, queue <-chan zk.Event // the watches; nil once fired
}

// readJournal reads the journal's entries and position, setting its watch
// if it is not set.
func (w *holderWatch) readJournal() ([]string, position, error) {
	names, st, ch, err := w.b.children(w.jdir, w.journal == nil)
	if ch != nil {
		w.journal = ch
	}
	return names, positionOf(st), err
}

// holders reads the key's holders, setting the queue's watch if it is not
// set.
func (w *holderWatch) holders() ([]dlock.LockInfo, error) {
	if w.queue == nil {
		_, _, ch, err := w.b.children(w.dir, true)
		if err != nil {
			return nil, err
		}
		w.queue = ch
	}
	return w.b.holdersAt(w.key, frozen)
}

func (w *holderWatch) start() ([]dlock.LockInfo, error) {
	hs, ok, err := w.settled(func(names []string, pos position, _ []dlock.LockInfo) error {
		w.pos, w.last = pos, -1
		if seqs := entries(names, -1); len(seqs) > 0 {
			w.last = seqs[len(seqs)-1]
		}
		return nil
	})
	switch {
	case err != nil:
		return nil, err
	case !ok:
		return nil, errors.New("the key changed during every read of its holders")
	}
	w.known = hs
	return slices.Clone(hs), nil
}

// settled reads the journal's position, the key's holders and the
// journal's entries and position again, and calls apply with those
// entries, their position and the holders, until the two positions agree
// (at most snapshotTries times; false if they never do). It returns the
// holders of the last read: they are those after the entries apply was
// given, and after the changes made without an entry meanwhile. The
// entries are read after the holders, so that a holder that ended since
// an entry was written, and is missing from them, has its end among them.
func (w *holderWatch) settled(apply func(names []string, pos position, hs []dlock.LockInfo) error) ([]dlock.LockInfo, bool, error) {
	for range snapshotTries {
		_, before, err := w.readJournal()
		if err != nil {
			return nil, false, err
		}
		hs, err := w.holders()
		if err != nil {
			return nil, false, err
		}
		names, pos, err := w.readJournal()
		if err != nil {
			return nil, false, err
		}
		if err := apply(names, pos, hs); err != nil {
			return nil, false, err
		}
		if before == pos {
			return hs, true, nil
		}
	}
	return nil, false, nil
}

func (w *holderWatch) follow(ctx context.Context, out chan<- []dlock.LockInfo) {
	defer close(out)
	for fired(ctx, &w.journal, &w.queue) {
		reports, err := run(ctx, w.step, nil)
		if err != nil {
			return
		}
		for _, hs := range reports {
			select {
			case out <- hs:
			case <-ctx.Done():
				return
			}
		}
	}
}

// step reads what changed since the last step: the journal's new entries,
// then the queue, whose holders the entries do not explain changed without
// an entry (a grant, the end of a session). It returns the holders after
// each change.
func (w *holderWatch) step() ([][]dlock.LockInfo, error) {
	var reports [][]dlock.LockInfo
	hs, ok, err := w.settled(func(names []string, pos position, now []dlock.LockInfo) error {
		return w.apply(names, pos, now, &reports)
	})
	if err != nil {
		return nil, err
	}
	// If the journal moved during every read of the queue, the entries are
	// reported and the queue is read again at the next wake-up (the
	// journal's watch has fired).
	if ok {
		w.diff(hs, &reports)
	}
	return reports, nil
}

// apply reads the entries after the last one read, in order, and reports
// the holders after each change they tell; now are the key's holders, read
// before the entries' names. It fails with errGap when the
// entries cannot all be read: their count is not what the journal's
// version says, or one is gone before it is read.
func (w *holderWatch) apply(names []string, pos position, now []dlock.LockInfo, reports *[][]dlock.LockInfo) error {
	if pos.czxid != w.pos.czxid && w.pos.czxid != 0 {
		return errGap // the journal was removed (and made again)
	}
	seqs := entries(names, w.last)
	// The version is an int32 that a busy journal may wrap: the difference
	// is taken in int32 too.
	if len(seqs) != int(pos.version-w.pos.version) {
		return errGap
	}
	es := make([]entry, 0, len(seqs))
	for _, s := range seqs {
		data, _, err := w.b.c.Get(entryPath(w.jdir, s))
		if errors.Is(err, zk.ErrNoNode) {
			return errGap
		}
		if err != nil {
			return err
		}
		var e entry
		if err := json.Unmarshal(data, &e); err != nil {
			return fmt.Errorf("journal entry %d of %q: %w", s, w.key, err)
		}
		es = append(es, e)
	}
	var ended []int64 // the terms whose end the entries told of so far
	for i, e := range es {
		w.grantEarlier(e, es[i+1:], now, ended, reports)
		w.last = seqs[i]
		w.pos.version++
		w.change(e, reports)
		if e.Kind != kindMetadata {
			ended = append(ended, e.Fence)
		}
	}
	w.pos = pos
	return nil
}

// grantEarlier reports, before e, the grants of the terms that the watcher
// has not seen granted, that held the key together with e's term and were
// granted before it: those with a smaller fence that e's term does not
// exclude (shared holders, or holders of one limit, queued ahead of it),
// that later entries tell of (they ended after e) or that are among now
// and not among ended (they held the key when now was read, and a term
// granted before e's term, whose grant needed them to be, that has not
// ended before e is held at e). A grant writes no entry. A term told of by
// a later entry is reported with its first metadata, one from now with its
// metadata then.
func (w *holderWatch) grantEarlier(e entry, later []entry, now []dlock.LockInfo, ended []int64, reports *[][]dlock.LockInfo) {
	if w.knows(uint64(e.Fence)) || e.Kind == kindExpired {
		return
	}
	h, ok := e.holder(w.key, true)
	if !ok {
		return
	}
	var earlier []dlock.LockInfo
	add := func(u dlock.LockInfo) {
		if u.Fence < h.Fence && !w.knows(u.Fence) && !excludes(h, u) && byFence(earlier, u.Fence) < 0 {
			earlier = append(earlier, u)
		}
	}
	for _, l := range later {
		if l.Kind == kindExpired {
			continue
		}
		if u, ok := l.holder(w.key, true); ok {
			add(u)
		}
	}
	for _, u := range now {
		if !slices.Contains(ended, int64(u.Fence)) {
			add(u)
		}
	}
	slices.SortFunc(earlier, func(a, b dlock.LockInfo) int { return cmp.Compare(a.Fence, b.Fence) })
	for _, u := range earlier {
		w.grant(u, reports)
	}
}

// byFence returns the index of the holder of fence f in hs, or -1.
func byFence(hs []dlock.LockInfo, f uint64) int {
	return slices.IndexFunc(hs, func(h dlock.LockInfo) bool { return h.Fence == f })
}

// knows reports whether the watcher holds the term of fence f as a holder.
func (w *holderWatch) knows(f uint64) bool {
	return byFence(w.known, f) >= 0
}

// change applies e to the known holders.
func (w *holderWatch) change(e entry, reports *[][]dlock.LockInfo) {
	i := byFence(w.known, uint64(e.Fence))
	if i < 0 {
		// A term the watcher has not seen granted. Only its holder
		// releases it or changes its metadata, and only holders are
		// released by force; a node deleted as expired may have been a
		// waiter, and is left out.
		if e.Kind == kindExpired {
			return
		}
		h, ok := e.holder(w.key, true)
		if !ok {
			return
		}
		w.grant(h, reports)
		i = byFence(w.known, uint64(e.Fence))
	}
	switch e.Kind {
	case kindMetadata:
		h, _ := e.holder(w.key, false)
		w.known[i].Metadata, w.known[i].ExpiresAt = h.Metadata, h.ExpiresAt
	default:
		w.known = slices.Delete(w.known, i, i+1)
	}
	w.report(reports)
}

// grant adds h, a new holder, and reports it. The holders it excludes (an
// exclusive grant excludes every other, a shared grant an exclusive
// holder) with a smaller fence have ended without an entry that the
// watcher read: their end is reported first.
func (w *holderWatch) grant(h dlock.LockInfo, reports *[][]dlock.LockInfo) {
	n := len(w.known)
	w.known = slices.DeleteFunc(w.known, func(k dlock.LockInfo) bool { return k.Fence < h.Fence && excludes(h, k) })
	if len(w.known) < n {
		w.report(reports)
	}
	w.known = append(w.known, h)
	slices.SortFunc(w.known, func(a, b dlock.LockInfo) int { return cmp.Compare(a.Fence, b.Fence) })
	w.report(reports)
}

// excludes reports whether holders a and b cannot hold a key together.
func excludes(a, b dlock.LockInfo) bool {
	switch {
	case a.Mode == dlock.ModeLimited || b.Mode == dlock.ModeLimited:
		return a.Mode != b.Mode || a.Limit != b.Limit
	default:
		return a.Mode == dlock.ModeExclusive || b.Mode == dlock.ModeExclusive
	}
}

// diff reports the changes from the known holders to hs, read at the
// journal's position that the watcher has reached: first the ends (in
// fence order), then the grants (in fence order).
func (w *holderWatch) diff(hs []dlock.LockInfo, reports *[][]dlock.LockInfo) {
	for i := 0; i < len(w.known); {
		j := byFence(hs, w.known[i].Fence)
		if j < 0 {
			w.known = slices.Delete(w.known, i, i+1)
			w.report(reports)
			continue
		}
		w.known[i].ExpiresAt = hs[j].ExpiresAt // renewals are not journaled
		i++
	}
	for _, h := range hs {
		if byFence(w.known, h.Fence) < 0 {
			w.grant(h, reports)
		}
	}
}

// report records the known holders as a report.
func (w *holderWatch) report(reports *[][]dlock.LockInfo) {
	*reports = append(*reports, slices.Clone(w.known))
}

// children reads path's children and its stat, and with watch sets a watch
// that fires at their next change, or when path is created if it does not
// exist (then names and st are nil).
func (b *Backend) children(path string, watch bool) ([]string, *zk.Stat, <-chan zk.Event, error) {
	for {
		if !watch {
			names, st, err := b.c.Children(path)
			if errors.Is(err, zk.ErrNoNode) {
				return nil, nil, nil, nil
			}
			return names, st, nil, err
		}
		names, st, ch, err := b.c.ChildrenW(path)
		if !errors.Is(err, zk.ErrNoNode) {
			return names, st, ch, err
		}
		ok, _, ch, err := b.c.ExistsW(path)
		if err != nil || !ok {
			return nil, nil, ch, err
		}
		// Created in between: read its children with a watch. The
		// existence watch fires at its next write, harmlessly.
	}
}

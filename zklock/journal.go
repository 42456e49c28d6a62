package zklock

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/go-zookeeper/zk"
)

// JournalNode is the name of the child of a key's directory that holds the
// key's change journal (see "Watching every change" in the package doc).
// It is not a queue node: tools that read the store's layout skip it.
const JournalNode = "j"

// Bounds of a key's journal: see "Watching every change".
const (
	// journalKeep is how many entries of a key the writers keep.
	journalKeep = 256
	// journalAge is how long a Backend keeps the entries it wrote.
	journalAge = time.Minute
)

// Kinds of entry.
const (
	kindReleased = "released" // the holder released the key (or a grant its caller gave up)
	kindMetadata = "metadata" // the holder's metadata changed to entry.Metadata
	kindExpired  = "expired"  // a node whose lease had run out was deleted
	kindForced   = "forced"   // ForceRelease deleted the holder
)

// entry is the data of a journal entry: a change, and the whole record of
// the term it changes, so that a watcher that had not seen the term's
// grant can report it first.
type entry struct {
	Kind     string `json:"kind"`
	Node     string `json:"node"` // the queue node's name: its mode and limit
	Fence    int64  `json:"fence"`
	Token    string `json:"token"`
	Owner    string `json:"owner,omitempty"`
	Initial  string `json:"initial_metadata,omitempty"` // at the grant
	Metadata string `json:"metadata,omitempty"`         // after the change
	Acquired int64  `json:"acquired_us"`
	TTL      int64  `json:"ttl_ms"`
}

// newEntry records a change of kind to the node named nm, with fence and
// data r (after the change).
func newEntry(kind, nm string, fence int64, r record) entry {
	return entry{
		Kind: kind, Node: nm, Fence: fence, Token: r.Token, Owner: r.Owner,
		Initial: r.initial(), Metadata: r.Metadata, Acquired: r.Acquired, TTL: r.TTL,
	}
}

// holder describes the term of e, with the metadata it had at its grant
// (initial) or after e; ExpiresAt is a lease from now.
func (e entry) holder(key string, initial bool) (dlock.LockInfo, bool) {
	n, ok := parseNode(e.Node)
	if !ok {
		return dlock.LockInfo{}, false
	}
	r := record{Token: e.Token, Owner: e.Owner, Metadata: e.Metadata, Acquired: e.Acquired, TTL: e.TTL}
	if initial {
		r.Metadata = e.Initial
	}
	h := info(key, n, r, &zk.Stat{Czxid: e.Fence})
	h.ExpiresAt = time.Now().Add(time.Duration(e.TTL) * time.Millisecond)
	return h, true
}

// jdir is the znode of key's journal.
func (b *Backend) jdir(key string) string { return b.dir(key) + "/" + JournalNode }

// ownEntry is a journal entry this Backend wrote, and when.
type ownEntry struct {
	path string
	at   time.Time
}

// journaled runs ops and the recording of e in the journal of the key
// whose directory is dir, in one
// transaction: an ephemeral sequential entry, and a write of the journal
// node whose version thus counts the entries. It returns the replies to
// ops, and the transaction's error.
func (b *Backend) journaled(dir string, e entry, ops ...any) ([]zk.MultiResponse, error) {
	jdir := dir + "/" + JournalNode
	data, _ := json.Marshal(e)
	all := append(slices.Clip(ops),
		&zk.CreateRequest{Path: jdir + "/e-", Data: data, Acl: b.acl, Flags: zk.FlagEphemeralSequential},
		&zk.SetDataRequest{Path: jdir, Data: nil, Version: -1},
	)
	for range 4 {
		res, err := b.c.Multi(all...)
		if err == nil {
			if len(res) != len(all) {
				return nil, fmt.Errorf("unexpected reply to a journaled change: %+v", res)
			}
			b.wrote(jdir, res[len(ops)].String)
			return res[:len(ops)], nil
		}
		if len(res) != len(all) || !errors.Is(res[len(ops)].Error, zk.ErrNoNode) {
			return res[:min(len(res), len(ops))], err
		}
		// The journal does not exist (yet, or the server removed it once
		// it was empty): create it and try again.
		if _, err := b.c.CreateContainer(jdir, nil, zk.FlagContainer, b.acl); err != nil && !errors.Is(err, zk.ErrNodeExists) {
			return nil, fmt.Errorf("create %s: %w", jdir, err)
		}
	}
	return nil, fmt.Errorf("journal %s vanishes", jdir)
}

// deleteHolder deletes the holder node nm of the key whose directory is
// dir, at version (-1: any), recording it as a change of kind with fence
// and data r.
func (b *Backend) deleteHolder(dir, nm string, version int32, kind string, fence int64, r record) error {
	_, err := b.journaled(dir, newEntry(kind, nm, fence, r), &zk.DeleteRequest{Path: dir + "/" + nm, Version: version})
	return err
}

// wrote notes the entry at path that this Backend wrote in the journal
// jdir: it deletes it after journalAge, and prunes the journal to its
// newest journalKeep entries in batches.
func (b *Backend) wrote(jdir, path string) {
	b.mu.Lock()
	b.mine = append(b.mine, ownEntry{path, time.Now()})
	if b.sweep == nil {
		b.sweep = time.AfterFunc(b.journalAge, b.sweepOwn)
	}
	keep := b.journalKeep
	b.mu.Unlock()
	// Sequence numbers count the deletions too: the test below comes about
	// once per keep/8 changes, whatever the deletions.
	if seq, ok := entrySeq(name(path)); ok && seq%max(int64(keep/8), 1) == 0 {
		b.prune(jdir, keep)
	}
}

// entrySeq returns the sequence number of a journal entry's name, and false
// for other names.
func entrySeq(nm string) (int64, bool) {
	if len(nm) != 12 || nm[:2] != "e-" {
		return 0, false
	}
	seq, err := strconv.ParseInt(nm[2:], 10, 64)
	return seq, err == nil && seq >= 0
}

// prune deletes the oldest entries of the journal jdir beyond its newest
// keep. Errors are ignored: the next prune tries again.
func (b *Backend) prune(jdir string, keep int) {
	names, _, err := b.c.Children(jdir)
	if err != nil {
		return
	}
	seqs := entries(names, -1)
	if len(seqs) <= keep {
		return
	}
	var paths []string
	for _, s := range seqs[:len(seqs)-keep] {
		paths = append(paths, entryPath(jdir, s))
	}
	b.deleteAll(paths)
}

// entries returns the sequence numbers of the journal entries among names
// that come after after, in order.
func entries(names []string, after int64) []int64 {
	var seqs []int64
	for _, nm := range names {
		if s, ok := entrySeq(nm); ok && s > after {
			seqs = append(seqs, s)
		}
	}
	slices.Sort(seqs)
	return seqs
}

func entryPath(jdir string, seq int64) string { return fmt.Sprintf("%s/e-%010d", jdir, seq) }

// deleteAll deletes paths, in transactions of up to 64, each path on its
// own when a transaction fails (another writer deleted some); errors are
// ignored.
func (b *Backend) deleteAll(paths []string) {
	for chunk := range slices.Chunk(paths, 64) {
		ops := make([]any, len(chunk))
		for i, p := range chunk {
			ops[i] = &zk.DeleteRequest{Path: p, Version: -1}
		}
		if _, err := b.c.Multi(ops...); err == nil {
			continue
		}
		for _, p := range chunk {
			_ = b.c.Delete(p, -1)
		}
	}
}

// sweepOwn deletes the entries this Backend wrote that are journalAge old,
// and comes back for the others.
func (b *Backend) sweepOwn() {
	b.mu.Lock()
	cut := time.Now().Add(-b.journalAge)
	i := 0
	for i < len(b.mine) && !b.mine[i].at.After(cut) {
		i++
	}
	var old []string
	for _, e := range b.mine[:i] {
		old = append(old, e.path)
	}
	b.mine = slices.Delete(b.mine, 0, i)
	if len(b.mine) > 0 {
		b.sweep = time.AfterFunc(time.Until(b.mine[0].at.Add(b.journalAge)), b.sweepOwn)
	} else {
		b.sweep = nil
	}
	b.mu.Unlock()
	b.deleteAll(old)
}

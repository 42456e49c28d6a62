// Package zklock is a dlock.Backend on Apache ZooKeeper
// (github.com/go-zookeeper/zk), using the classic lock recipes: every
// acquisition, and every waiting acquisition, is an ephemeral sequential
// znode under the key's directory, and the sequence order decides who
// holds the key. It grants every mode (dlock.Sharer): exclusive, shared
// (the reader-writer recipe of Curator's InterProcessReadWriteLock) and
// limited (a counting semaphore on the same queue); see "Modes".
//
//	conn, _, err := zk.Connect([]string{"zk1:2181", "zk2:2181", "zk3:2181"}, 30*time.Second)
//	b, err := zklock.New(conn, &zklock.Options{SessionTimeout: 30 * time.Second})
//	locker := dlock.New(b, nil)
//
// # Layout
//
//	<root>/k<escaped key>/n-0000000042  →  {"token":…, "owner":…, "metadata":…, "acquired_us":…, "ttl_ms":…}
//	<root>/k<escaped key>/r-0000000043  →  (the same)
//	<root>/k<escaped key>/l3-0000000044 →  (the same)
//	<root>/k<escaped key>/j             →  the key's change journal (JournalNode)
//	<root>/k<escaped key>/j/e-0000000007 →  {"kind":"released", "fence":…, "node":"n-0000000042", …}
//
// A node's name says its mode: "n-" exclusive, "r-" shared, "l<n>-"
// limited to n holders; ZooKeeper appends one sequence per directory, so
// nodes of every mode are ordered together. A writer mark (see "Modes")
// is an "n-" node whose data also has "mark":true. The journal is not a
// queue node (see "Watching every change").
//
// The root (Options.Root, "/dlock" by default) is created as persistent
// nodes on first use; each key's directory is a container node, which the
// server removes some time after its last child is gone. Keys are escaped
// byte by byte: ASCII letters, digits and "-_.~:@" stay, every other byte
// becomes %XX, and the name starts with "k", so any dlock key is one valid
// znode name and the mapping is one-to-one and keeps prefixes.
//
// # Leases, sessions and time
//
// A lock ends in two ways, whichever comes first:
//
//   - Its lease runs out. The holder's node records its TTL, and the node's
//     mtime, stamped by the ZooKeeper leader when it applies a write, is the
//     start of the lease. Extend rewrites the node (a conditional setData,
//     a write that the leader only accepts from a live session), which moves
//     mtime on. A contender that finds the holder's mtime+TTL behind the
//     leader's time of its own latest write deletes the holder's node, so
//     an abandoned lock (a crashed holder, a paused process) is free within
//     its TTL, as on every dlock backend. An Extend whose write lands a TTL
//     or more after the previous one deletes the node itself and reports
//     dlock.ErrNotHeld: an expired lease is never revived. The comparison
//     uses the leader's wall clock; after a leader change, it assumes the
//     members' clocks agree to well within the Locker's margin.
//   - The holder's ZooKeeper session ends (expires, or the Conn is closed):
//     the server deletes its ephemeral nodes at once, and the next renewal
//     reports the loss.
//
// Session expiry must never come before the dlock.Locker gives a lock up.
// The Locker considers a lock lost TTL minus its margin after it sent the
// last renewal the store confirmed; the server expires a session at least
// the negotiated session timeout after it last heard from the client, which
// is after that renewal was sent. So every TTL must be at most the session
// timeout. The Backend cannot read the negotiated timeout from a *zk.Conn,
// so Options.SessionTimeout must state it (the timeout passed to
// zk.Connect, unless the server's minSessionTimeout/maxSessionTimeout bound
// it), and acquisitions with a longer TTL are refused with an error
// matching dlock.ErrInvalidOption. dlock's DefaultTTL of 30 s therefore needs
// a session timeout of at least 30 s (ZooKeeper's default maxSessionTimeout is
// 20 ticks: 40 s with a 2 s tickTime).
//
// A Conn that is disconnected cannot renew: Extend fails, the Locker retries
// until its deadline and then reports the loss, before either the lease or
// the session can end in the ensemble.
//
// # Modes
//
// A node is live until it is deleted or its lease runs out (then it counts
// as gone, and whoever sees it deletes it). The rules, for a node N:
//
//   - Exclusive: N holds the key when no live node is ahead of it (the
//     lowest node), writer marks apart.
//   - Shared: N holds the key when no live exclusive node (a holder, a
//     waiting writer or a writer mark) is ahead of it. So a writer that
//     queues keeps every later reader out, and readers cannot starve it.
//   - Limited to n: N holds the key when fewer than n live nodes are ahead
//     of it.
//   - Exclusive and shared nodes are one class; limited nodes of one limit
//     another. A request whose first live node ahead is of another class is
//     refused with dlock.ErrModeMismatch and its node deleted; a live node
//     of another class further ahead is such a request, about to withdraw
//     (or to hold the key if the nodes ahead of it leave first), and N
//     waits for it rather than hold the key alongside it.
//   - Writer marks: an exclusive TryAcquire (Backend.Acquire) that finds
//     shared holders does not delete its node but rewrites it as a mark
//     with a lease of dlock.WriterMark: it keeps new shared requests out,
//     exclusive requests pass it (and delete it when they are granted),
//     and the Backend's next AcquireWait of the key for an exclusive
//     request takes it up as its queued node (the Locker calls it at once
//     when it waits). A mark not taken up is deleted after WriterMark;
//     the same Backend's next exclusive attempt that finds readers renews
//     it instead of leaving another.
//
// So the holders are always a prefix of the queue's live nodes of one
// class: readers before the first writer, or that writer, or the first n
// limited nodes. Each waiter watches only what blocks it, nearest first: an
// exclusive waiter its nearest live predecessor, a shared waiter the
// nearest live exclusive node ahead, a limited waiter its predecessor, and
// the first limited waiter (the n+1st live node) the n holders. A waiter
// wakes when that node is deleted or rewritten (a grant or a renewal) or
// its lease runs out, so every mode is woken by a release.
//
// # Fencing
//
// The fence is the holder node's czxid, the zxid of the transaction
// that created it. Zxids are global to the ensemble and strictly increase
// over its whole life (across leader elections and restarts), so tokens are
// strictly increasing per key even when the key's directory is removed and
// created again. They are large numbers (the leader epoch is in the high 32
// bits), not 1, 2, 3. Because the holders are always a prefix of the
// queue, nodes are granted in sequence order, which is czxid order: every
// grant's fence is larger than every earlier grant's, in every mode (nodes
// that one release admits together, such as the readers behind a writer,
// are granted at one instant in sequence order).
//
// # Waiting
//
// A waiting acquisition (dlock.Waiter), in every mode, keeps its node in
// the queue and watches only the node that blocks it, usually its
// predecessor (no thundering herd; see "Modes"), so the lock is handed
// over in arrival order. The waiter also wakes when that node's lease
// would end (a holder's, or a waiting node's that its waiter no longer
// renews: a paused, partitioned or dead process), and deletes the node if
// the lease has indeed expired by the leader's clock, so that a stalled
// waiter holds the queue up for at most its TTL, not until its session
// ends. Because the Locker measures a granted lease from the
// moment it called AcquireWait, each call waits at most a third of the TTL
// and then returns without the lock, leaving the node queued (parked) for
// the Locker's next call, which rewrites it with the new token (and so
// also keeps a live waiter's node from looking abandoned) and keeps its
// place. The Locker calls again at once; a parked node that no call takes
// up within a second (its caller's context ended between two calls) is
// deleted, and so is one whose turn comes while it is parked (each parked
// node keeps watching what blocks it): it would hold the key, or a slot,
// for nobody, so the next waiter proceeds at once. A call that takes up a
// shared or limited node whose turn has come all the same (the watch had
// no time to fire) deletes it and queues a new node: nodes behind it may
// hold the key already, with larger fences. A call that takes a node up
// only after its lease ran out (its write lands a TTL or more after the
// previous one) deletes it and queues a new node too: if the node had
// reached the head meanwhile, it held the key until its lease ended, and
// it must not hold it again under the same fence. When the caller's
// context ends during a call, the waiter's node is deleted at once.
//
// TryAcquire (Backend.Acquire) does not queue: it creates its node, and
// deletes it again unless the rules grant it (or leaves it as a writer
// mark, see "Modes").
//
// # Watching and metadata
//
// The Backend is a dlock.Watcher: a watch is a child watch and a data
// watch on the key's directory, set again each time one fires, and closed
// with the session. It reports grants, releases, metadata changes and the
// nodes that an ended session loses; an expired lease only when a
// contender deletes its node. It is a dlock.MetadataSetter: the holder's
// node is rewritten, which, like a renewal, moves its mtime on.
//
// # Watching every change
//
// The Backend is a dlock.HolderWatcher, so that an Election's observers
// see every term. ZooKeeper's watches fire once per setting and carry no
// data (and go-zookeeper has no persistent watches), so a reader that
// looks again after a watch fires misses what began and ended in between:
// the order of changes is kept in the store, in a journal per key. Every
// change that a Backend makes to a holder is recorded in the transaction
// (a multi) that makes it, by an entry under the journal node "j" of the
// key's directory, and a write of the journal node, whose version thus
// counts the entries: a release (and a granted node deleted because its
// caller gave up), a metadata change, a forced release, and the deletion
// of a node whose lease had run out (by a contender, or by its own late
// renewal). Each entry carries the whole record of its term (fence, node
// name and so mode, token, owner, the metadata of the grant and after the
// change, acquisition time, TTL), so that a watcher that learns of a term
// only from its first entry reports the grant, with its first metadata,
// before the change.
//
// A grant is not a write: a node holds the key when the nodes ahead of it
// are gone. WatchHolders reads the journal's position, the key's holders
// and the position again, until the two agree; then, woken by a child
// watch on the journal and one on the queue (never by a timer), it applies
// the new entries in order, then reads the holders again between two
// reads of the position that agree, and reports the difference: the ends
// that no entry told, then the grants, each in fence order. So:
//
//   - Exclusive terms are reported in fence order, each grant and change
//     on its own, however short, if the term changes its metadata or ends
//     by a release or a forced release: the watcher reads those entries in
//     order, and reads the queue only at a journal position that no later
//     entry contradicts. A term whose only write is its grant and that
//     ends without a release between two reads of the queue (its session
//     ends, its lease runs out) is not seen.
//   - Ends that the store makes itself have no entry: a session that ends
//     (the server deletes its nodes), and a node deleted without the
//     journal by a client that does not write one (an older version, a
//     parked node whose turn came). They are reported when the watcher
//     next reads the queue, after the entries it read so far, or at the
//     latest before the grant of the next term (which excludes it). A
//     node whose lease ran out counts until it is deleted; its ExpiresAt
//     tells when it ended (renewals are not journaled: ExpiresAt is as of
//     the last change the watcher saw, or its last read of the queue).
//   - Shared and limited holders: each grant, change and end is reported
//     on its own, but grants learnt from the queue come after the entries
//     read before them, so a reader whose first change came before the
//     watcher read the queue is reported before readers with smaller
//     fences that made no change yet. Which holders are reported together
//     after a writer's release is exact; the order of their grants is
//     fence order within one read of the queue. Writer marks hold nothing
//     and are never reported. An expired node that the watcher never saw
//     hold (a waiter, or a term shorter than a read of the queue that
//     ended by expiry) is not reported.
//
// Entries are ephemeral sequential nodes: ZooKeeper keeps every node in
// memory, so the journal must not outlive its use. Writers prune a key's
// journal to its newest 256 entries (checked about once per 32 entries,
// in one multi), and each Backend deletes the entries it wrote once they
// are a minute old; a session that ends takes its entries with it. The
// journal node is a container, which the server removes once it is
// empty, and then the key's directory. A watcher whose next entry is gone
// (it fell 256 changes or a minute behind, or the writer's session ended
// before it read it), whose entry count does not match the journal's
// version, or whose journal was removed, closes its channel: the caller
// watches anew and sees what happened meanwhile as of that instant. A
// journaled change costs two more operations in the multi it already
// made (no extra round trip), and a prune or a sweep now and then; the
// first one of a key whose journal does not exist (a new key, or one
// unused for a minute or more) costs two more round trips, to create it.
// The journal node is created only then, never empty: a container that
// never had a child is never removed, and neither would its key's
// directory be.
//
// # Limits
//
//   - A waiter whose process dies or stalls leaves its node in the queue
//     until its TTL runs out (its successor then deletes it) or its session
//     expires: once its turn comes, it holds the key up for that long.
//   - A create whose reply is lost with the connection is resolved by the
//     Locker's Release, which finds the node by its token. If the server
//     applies the create only after that (it was still in flight), the node
//     stays until its lease runs out or its session ends.
//   - The go-zookeeper client does not take contexts. Calls run in their
//     own goroutines, and a call abandoned because its context ended
//     finishes in the background (at the latest when the Conn is closed);
//     an acquisition that completes after its caller gave up deletes its
//     node.
//   - Closing the Conn ends the session and frees every lock it holds at
//     once, while Lockers may still consider them held until their next
//     renewal: close Lockers before the Conn.
//   - Every client of a key must know the modes: a client that only knows
//     "n-" nodes ignores shared and limited ones. Clients of a version
//     without the journal change keys unjournaled: their releases are
//     seen as ends without an entry (see "Watching every change").
//   - A refused limited request reads up to n nodes ahead of it, and List
//     reads every node of the keys it lists.
//
// The Backend uses the caller's connection and never closes it. One
// session can hold any number of locks.
package zklock

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/go-zookeeper/zk"
)

// DefaultRoot is the root znode used when Options.Root is empty.
const DefaultRoot = "/dlock"

// Conn is what a Backend needs of a ZooKeeper connection. *zk.Conn satisfies
// it. The caller owns the connection: the Backend never closes it.
type Conn interface {
	Children(path string) ([]string, *zk.Stat, error)
	ChildrenW(path string) ([]string, *zk.Stat, <-chan zk.Event, error)
	Get(path string) ([]byte, *zk.Stat, error)
	GetW(path string) ([]byte, *zk.Stat, <-chan zk.Event, error)
	ExistsW(path string) (bool, *zk.Stat, <-chan zk.Event, error)
	Create(path string, data []byte, flags int32, acl []zk.ACL) (string, error)
	CreateContainer(path string, data []byte, flags int32, acl []zk.ACL) (string, error)
	Set(path string, data []byte, version int32) (*zk.Stat, error)
	Delete(path string, version int32) error
	Multi(ops ...any) ([]zk.MultiResponse, error)
}

// Options configure a Backend.
type Options struct {
	// SessionTimeout is the session timeout the server granted to the Conn:
	// the timeout passed to zk.Connect, unless the server's
	// minSessionTimeout or maxSessionTimeout bounded it. It is required
	// (the Backend cannot read it from the Conn): acquisitions with a longer
	// TTL are refused, because the session could expire, and the lock pass
	// to another client, before the dlock.Locker gives it up.
	SessionTimeout time.Duration

	// Root is the absolute znode path under which the Backend keeps its
	// nodes; it is created on first use. Everything under it belongs to
	// the Backend. The default is DefaultRoot.
	Root string

	// ACL is applied to every node the Backend creates. The default is
	// zk.WorldACL(zk.PermAll).
	ACL []zk.ACL
}

// Backend is a dlock.Backend on one ZooKeeper ensemble, through one
// session. It is safe for concurrent use.
type Backend struct {
	c       Conn
	root    string
	acl     []zk.ACL
	session time.Duration

	mu      sync.Mutex
	held    map[dlock.Token]*node    // nodes this Backend holds, by token
	parked  map[string][]*parkedNode // waiting nodes between two AcquireWait calls, by key
	rooted  bool                     // the root exists
	parkFor time.Duration            // how long a waiting node is parked: parkTimeout

	mine        []ownEntry  // journal entries this Backend wrote, oldest first
	sweep       *time.Timer // deletes the oldest of mine when it is journalAge old
	journalKeep int         // journalKeep
	journalAge  time.Duration
}

var (
	_ dlock.Backend       = (*Backend)(nil)
	_ dlock.Lister        = (*Backend)(nil)
	_ dlock.ForceReleaser = (*Backend)(nil)
	_ dlock.Waiter        = (*Backend)(nil)
	_ dlock.Sharer        = (*Backend)(nil)
)

// New returns a Backend over c. It does no I/O. The error matches
// dlock.ErrInvalidOption for a nil Conn, a missing SessionTimeout or an
// invalid Root.
func New(c Conn, opts *Options) (*Backend, error) {
	if opts == nil {
		opts = &Options{}
	}
	if c == nil {
		return nil, fmt.Errorf("%w: zklock: nil Conn", dlock.ErrInvalidOption)
	}
	if opts.SessionTimeout <= 0 {
		return nil, fmt.Errorf("%w: zklock: Options.SessionTimeout must be the Conn's session timeout", dlock.ErrInvalidOption)
	}
	root := opts.Root
	if root == "" {
		root = DefaultRoot
	}
	if err := checkRoot(root); err != nil {
		return nil, err
	}
	acl := opts.ACL
	if acl == nil {
		acl = zk.WorldACL(zk.PermAll)
	}
	return &Backend{
		c: c, root: root, acl: acl, session: opts.SessionTimeout,
		held:        make(map[dlock.Token]*node),
		parked:      make(map[string][]*parkedNode),
		parkFor:     parkTimeout,
		journalKeep: journalKeep,
		journalAge:  journalAge,
	}, nil
}

// checkRoot accepts an absolute path of non-empty segments other than "."
// and "..", without characters ZooKeeper refuses, and not inside
// /zookeeper.
func checkRoot(root string) error {
	bad := func(why string) error {
		return fmt.Errorf("%w: zklock: root %q: %s", dlock.ErrInvalidOption, root, why)
	}
	if !strings.HasPrefix(root, "/") || root == "/" {
		return bad("must be an absolute path below /")
	}
	for _, seg := range strings.Split(root[1:], "/") {
		switch seg {
		case "":
			return bad("empty segment or trailing slash")
		case ".", "..":
			return bad("relative segment")
		}
		for _, r := range seg {
			if r < 0x20 || (r >= 0x7f && r <= 0x9f) || (r >= 0xd800 && r <= 0xf8ff) || r >= 0xfff0 {
				return bad("character ZooKeeper does not accept")
			}
		}
	}
	if root == "/zookeeper" || strings.HasPrefix(root, "/zookeeper/") {
		return bad("reserved for ZooKeeper")
	}
	return nil
}

// keyEscape maps a dlock key to one znode name: see the package doc.
func keyEscape(key string) string {
	var sb strings.Builder
	sb.Grow(1 + len(key))
	sb.WriteByte('k')
	for i := 0; i < len(key); i++ {
		c := key[i]
		if 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || strings.IndexByte("-_.~:@", c) >= 0 {
			sb.WriteByte(c)
			continue
		}
		sb.WriteByte('%')
		sb.WriteString(strings.ToUpper(hex.EncodeToString([]byte{c})))
	}
	return sb.String()
}

// KeyOfNode returns the dlock key that a key's znode name (one path element
// under the Backend's root) stands for, and false for names the Backend
// cannot have made. Tools that read the store's layout use it.
func KeyOfNode(name string) (string, bool) { return keyUnescape(name) }

// keyUnescape inverts keyEscape; false for names it cannot have made.
func keyUnescape(name string) (string, bool) {
	rest, ok := strings.CutPrefix(name, "k")
	if !ok || rest == "" {
		return "", false
	}
	var sb strings.Builder
	for i := 0; i < len(rest); i++ {
		if rest[i] != '%' {
			sb.WriteByte(rest[i])
			continue
		}
		if i+3 > len(rest) {
			return "", false
		}
		v, err := strconv.ParseUint(rest[i+1:i+3], 16, 8)
		if err != nil {
			return "", false
		}
		sb.WriteByte(byte(v))
		i += 2
	}
	if keyEscape(sb.String()) != name { // not canonical: not ours
		return "", false
	}
	return sb.String(), true
}

// dir is the znode of key's queue.
func (b *Backend) dir(key string) string { return b.root + "/" + keyEscape(key) }

// record is the data of a queue node.
type record struct {
	Token    string `json:"token"`
	Owner    string `json:"owner,omitempty"`
	Metadata string `json:"metadata,omitempty"`
	// Acquired is when the node was written for this acquisition, by the
	// client's clock, in microseconds since the epoch. For a node that
	// waited it is when its last wait began.
	Acquired int64 `json:"acquired_us"`
	// TTL is the lease in milliseconds, counted from the node's mtime.
	TTL int64 `json:"ttl_ms"`
	// Mark is set on the node of an exclusive attempt that found shared
	// holders and left it as a writer mark (see "Modes").
	Mark bool `json:"mark,omitempty"`
	// Initial is the metadata of the grant, once SetMetadata changed it.
	Initial *string `json:"initial_metadata,omitempty"`
}

// initial is the metadata the node had when it was granted.
func (r record) initial() string {
	if r.Initial != nil {
		return *r.Initial
	}
	return r.Metadata
}

func encode(req dlock.Request) []byte {
	v, _ := json.Marshal(newRecord(req))
	return v
}

func newRecord(req dlock.Request) record {
	return record{
		Token: req.Token.String(), Owner: req.Owner, Metadata: req.Metadata,
		Acquired: time.Now().UnixMicro(), TTL: req.TTL.Milliseconds(),
	}
}

// encodeMark is the data of a writer mark left by req: a lease of
// dlock.WriterMark.
func encodeMark(req dlock.Request) []byte {
	r := newRecord(req)
	r.TTL, r.Mark = dlock.WriterMark.Milliseconds(), true
	v, _ := json.Marshal(r)
	return v
}

func decode(v []byte) record {
	var r record
	_ = json.Unmarshal(v, &r) // a foreign value reads as a record without token
	return r
}

// expiry is the end of a node's lease on the leader's clock, in ms since the
// epoch. A node without a TTL (foreign) gets the smallest lease dlock allows.
func expiry(r record, st *zk.Stat) int64 {
	ttl := r.TTL
	if ttl <= 0 {
		ttl = dlock.MinTTL.Milliseconds()
	}
	return st.Mtime + ttl
}

// late reports whether a write that the leader stamped at mtime came after
// the end of the lease that the node's previous write, at prev, began: by
// expiry's rule a lease is live while the leader's time is before prev+ttl,
// and from then on a contender may delete the node.
func late(mtime, prev int64, ttl time.Duration) bool { return mtime-prev >= ttl.Milliseconds() }

// info describes the queue node n of key with data r and stat st.
func info(key string, n qnode, r record, st *zk.Stat) dlock.LockInfo {
	h := dlock.LockInfo{Key: key, Owner: r.Owner, Fence: uint64(st.Czxid), Metadata: r.Metadata, Mode: n.mode, Limit: n.limit}
	if tok, err := hex.DecodeString(r.Token); err == nil && len(tok) == len(h.Token) {
		copy(h.Token[:], tok)
	}
	if r.Acquired > 0 {
		h.AcquiredAt = time.UnixMicro(r.Acquired)
	}
	return h
}

// node is a queue node this Backend wrote, as last confirmed by the server.
type node struct {
	key     string
	path    string
	data    []byte
	version int32
	mtime   int64 // ms, leader's clock
	ttl     time.Duration
	fence   int64 // czxid
}

// checkRequest refuses leases the session cannot cover, and modes and
// limits out of range.
func (b *Backend) checkRequest(req dlock.Request) error {
	if req.TTL > b.session {
		return fmt.Errorf("%w: zklock: ttl %s exceeds the session timeout %s (see Options.SessionTimeout)",
			dlock.ErrInvalidOption, req.TTL, b.session)
	}
	return dlock.ValidateMode(req)
}

// SupportsMode implements dlock.Sharer: every mode (see "Modes").
func (b *Backend) SupportsMode(m dlock.Mode) bool { return m <= dlock.ModeLimited }

// ensureDir creates key's directory (and the root, the first time).
func (b *Backend) ensureDir(dir string) error {
	b.mu.Lock()
	rooted := b.rooted
	b.mu.Unlock()
	if !rooted {
		p := ""
		for _, seg := range strings.Split(b.root[1:], "/") {
			p += "/" + seg
			if _, err := b.c.Create(p, nil, zk.FlagPersistent, b.acl); err != nil && !errors.Is(err, zk.ErrNodeExists) {
				return fmt.Errorf("create %s: %w", p, err)
			}
		}
		b.mu.Lock()
		b.rooted = true
		b.mu.Unlock()
	}
	if _, err := b.c.CreateContainer(dir, nil, zk.FlagContainer, b.acl); err != nil && !errors.Is(err, zk.ErrNodeExists) {
		if errors.Is(err, zk.ErrNoNode) { // the root was removed behind our back
			b.mu.Lock()
			b.rooted = false
			b.mu.Unlock()
		}
		return fmt.Errorf("create %s: %w", dir, err)
	}
	return nil
}

// enqueue creates a queue node for req. In the same transaction it touches
// the directory, whose new stat gives the transaction's zxid (the node's
// czxid: the fence) and the leader's time (the node's mtime).
func (b *Backend) enqueue(req dlock.Request) (*node, int64, error) {
	dir := b.dir(req.Key)
	data := encode(req)
	var err error
	for range 4 {
		var res []zk.MultiResponse
		res, err = b.c.Multi(
			&zk.CreateRequest{Path: dir + "/" + prefixOf(req.Mode, req.Limit), Data: data, Acl: b.acl, Flags: zk.FlagEphemeralSequential},
			&zk.SetDataRequest{Path: dir, Data: nil, Version: -1},
		)
		if errors.Is(err, zk.ErrNoNode) {
			if err = b.ensureDir(dir); err != nil {
				return nil, 0, err
			}
			continue
		}
		if err != nil {
			return nil, 0, err
		}
		if len(res) != 2 || res[1].Stat == nil || !strings.HasPrefix(res[0].String, dir+"/") {
			return nil, 0, fmt.Errorf("unexpected reply to create: %+v", res)
		}
		st := res[1].Stat
		n := &node{key: req.Key, path: res[0].String, data: data, mtime: st.Mtime, ttl: req.TTL, fence: st.Mzxid}
		return n, st.Mzxid, nil
	}
	return nil, 0, err
}

// name is the last element of path.
func name(path string) string { return path[strings.LastIndexByte(path, '/')+1:] }

// hold records n as held for token.
func (b *Backend) hold(token dlock.Token, n *node) {
	b.mu.Lock()
	b.held[token] = n
	b.mu.Unlock()
}

// heldNode returns the node held for token on key, or nil.
func (b *Backend) heldNode(key string, token dlock.Token) *node {
	b.mu.Lock()
	defer b.mu.Unlock()
	if n := b.held[token]; n != nil && n.key == key {
		return n
	}
	return nil
}

func (b *Backend) forget(token dlock.Token, n *node) {
	b.mu.Lock()
	if b.held[token] == n {
		delete(b.held, token)
	}
	b.mu.Unlock()
}

// run runs op in a goroutine of its own (the client takes no context) and
// waits for it or ctx. If ctx ends first, it returns ctx's error, and undo
// is called with op's results when op completes.
func run[T any](ctx context.Context, op func() (T, error), undo func(T, error)) (T, error) {
	type result struct {
		v   T
		err error
	}
	var mu sync.Mutex
	abandoned := false
	ch := make(chan result, 1)
	go func() {
		v, err := op()
		mu.Lock()
		defer mu.Unlock()
		if abandoned {
			if undo != nil {
				undo(v, err)
			}
			return
		}
		ch <- result{v, err}
	}()
	select {
	case r := <-ch:
		return r.v, r.err
	case <-ctx.Done():
	}
	mu.Lock()
	defer mu.Unlock()
	select {
	case r := <-ch: // finished meanwhile
		return r.v, r.err
	default:
	}
	abandoned = true
	var zero T
	return zero, ctx.Err()
}

// deleteQuietly deletes path, ignoring errors: a node that stays behind
// ends with its lease or its session.
func (b *Backend) deleteQuietly(path string) {
	_ = b.c.Delete(path, -1)
}

// notHeld reports errors meaning the node is gone or was changed by
// someone else.
func notHeld(err error) bool {
	return errors.Is(err, zk.ErrNoNode) || errors.Is(err, zk.ErrBadVersion) ||
		errors.Is(err, zk.ErrSessionExpired)
}

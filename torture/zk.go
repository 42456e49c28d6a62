package torture

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/zklock"
	"github.com/go-zookeeper/zk"
)

// zkLease is zklock on the ZooKeeper at Env.ZKAddr, under a fresh root per run
// ("/torture-<tag>"). Workers connect through their fault proxies with a session timeout of
// 4×TTL (4 s at the harness's TTL of 1 s; see zkSessionTimeout).
//
// # History
//
// ZooKeeper keeps its own record: the transaction log in its dataDir (Env.ZKDataDir, the
// dlock-torture flag -zk-data-dir), every change in zxid order, stamped with the leader's wall
// clock. After the run, History makes one write through a session of its own and waits (bounded)
// until the log holds that write's zxid, reads the run's transactions (readZKLog) and replays them
// per key directory by zklock's own rules (zkLeaseEvents):
//
//   - The key's holder is its lowest-sequence child while that node's lease is live: the node's
//     mtime (its create's or latest setData's leader time) plus the ttl_ms in its data, which ends
//     at that millisecond (a contender whose own write is stamped mtime+ttl deletes the node).
//   - A grant is a transaction after which the lowest child is a node whose lease is live and
//     that was not holding: at the transaction's time, with fence = the node's czxid and expiry =
//     mtime + ttl. A queued node that reaches the head with its lease run out (its owner paused,
//     partitioned or dead) holds nothing: a later write of its owner grants it then, or a
//     contender deletes it.
//   - A setData of the holder's node while its lease is live is an extension: expiry = the
//     transaction's time + the new ttl_ms.
//   - The holder's node deleted while its lease is live ends the lease then: a delete by the
//     node's own session is a release (Release); the session's end (closeSession: the client
//     closed it or the server expired it) ends the lease at that instant without being a release,
//     so the holder must have learnt of it before. A delete by another session of a live lease
//     (which zklock never does: contenders delete only expired holders, by version) is left out,
//     so that the next grant is reported as a grant while the lease was live. A deletion after the
//     expiry is cleanup: the lease ended at its expiry.
//   - A setData of a node whose lease was granted and has run out does not extend it, whatever
//     request token it writes: zklock, finding its write a TTL or more after the previous one,
//     deletes the node (Extend reports the lock lost; AcquireWait, taking up a parked node for
//     a new request, queues a new node instead); until then the node is a zombie that blocks the
//     key (the liveness check sees the time) but holds nothing. A zklock that went on using such
//     a node would hold its fence past the lease's end in this history: the checker reports the
//     holder as keeping the lock past the store's expiry.
//
// Tokens: zklock hands a queued node from one acquisition request to the next of the same Backend
// (it rewrites the node with the new request's token when the Locker calls again), and ZooKeeper
// ties the node to its session, not to a request: the node's owner cannot change. So the token of
// a lease is the node's ephemeral owner (bytes 0–7) and the session that wrote the node's data
// last (bytes 8–15). A lease's token changes only if another session rewrites the holder's node:
// the checker's token-swap check then flags it. Request-token rewrites of a live holder are
// counted in zk-history.txt in the run's directory, with the other figures of the replay.
//
// Time resolution: the leader stamps transactions with its wall clock in milliseconds, so every
// store instant is a whole millisecond (the real instant is up to 1 ms later). Expiries are exact:
// zklock's own arithmetic is in those milliseconds.
//
// Without Env.ZKDataDir there is no history: History returns errNoZKLog (ErrNoHistory), and the
// store checks are inconclusive.
var zkLease = &Adapter{
	Name:      "zk-lease",
	Modes:     bothModes,
	Networked: true,
	Upstream:  addrUpstream("ZK", func(env *Env) string { return env.ZKAddr }),
	Prepare:   prepareZK,
	Open: func(ctx context.Context, a OpenArgs) (dlock.Backend, func() error, error) {
		st, err := parseZKStore(a.Store)
		if err != nil {
			return nil, nil, err
		}
		conn, _, err := zk.Connect([]string{a.Addr}, st.Session, zk.WithLogger(zkQuiet{}))
		if err != nil {
			return nil, nil, err
		}
		b, err := zklock.New(conn, &zklock.Options{SessionTimeout: st.Session, Root: st.Root})
		if err != nil {
			conn.Close()
			return nil, nil, err
		}
		return b, func() error { conn.Close(); return nil }, nil
	},
	History: zkHistory,
	Restart: func(ctx context.Context, env *Env) (int64, int64, error) {
		return restartListener(ctx, env, env.ZKAddr, zkReady(env.ZKAddr), nil)
	},
}

// errNoZKLog means zk-lease has no history: the harness cannot read the ZooKeeper's dataDir.
var errNoZKLog = fmt.Errorf("%w: zk-lease reads the ZooKeeper's transaction log (set -zk-data-dir / $DLOCK_ZK_DATA_DIR to the server's dataDir)", ErrNoHistory)

// zkSessionTimeout is the workers' session timeout for a TTL. zklock needs TTL ≤ session timeout.
// 4×TTL also outlasts every holder fault (stop and blackhole last 2×TTL, cut TTL) with room for
// the client's reconnection, so a faulted holder keeps its session and its lock ends by its
// lease, which is the mechanism under test (a contender deletes the expired holder's node); and
// it stays short enough that a killed worker's session, and any queued node of it, goes within
// seconds. The server must grant it as asked: the test server accepts 1–60 s, a default one
// (tickTime 2 s) 4–40 s.
func zkSessionTimeout(ttl time.Duration) time.Duration { return 4 * ttl }

// zkStore is what Prepare hands the workers and History (as JSON).
type zkStore struct {
	Root    string        `json:"root"`
	Session time.Duration `json:"session"`
	From    int64         `json:"from"` // the root's czxid: the run's transactions follow it
}

func parseZKStore(s string) (zkStore, error) {
	var st zkStore
	if err := json.Unmarshal([]byte(s), &st); err != nil || st.Root == "" || st.Session <= 0 {
		return st, fmt.Errorf("zk-lease: bad store %q: %v", s, err)
	}
	return st, nil
}

// zkQuiet silences go-zookeeper's logging (connection state chatter on every fault).
type zkQuiet struct{}

func (zkQuiet) Printf(string, ...any) {}

// zkDo runs fn with a fresh session on addr, bounded by ctx (go-zookeeper's calls take no
// context and wait for a connection forever: closing the Conn ends them).
func zkDo(ctx context.Context, addr string, fn func(c *zk.Conn) error) error {
	conn, _, err := zk.Connect([]string{addr}, 10*time.Second, zk.WithLogger(zkQuiet{}))
	if err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() { done <- fn(conn) }()
	select {
	case err = <-done:
		conn.Close()
	case <-ctx.Done():
		conn.Close()
		<-done
		err = fmt.Errorf("ZooKeeper at %s: %w", addr, ctx.Err())
	}
	return err
}

// prepareZK deletes what an earlier run with the same tag left under the run's root and creates
// the root afresh; its czxid marks where the run's history starts.
func prepareZK(ctx context.Context, env *Env) (string, error) {
	st := zkStore{Root: "/torture-" + env.Tag, Session: zkSessionTimeout(env.TTL)}
	if strings.ContainsAny(env.Tag, "/") || env.Tag == "" {
		return "", fmt.Errorf("zk-lease: run tag %q cannot name a znode", env.Tag)
	}
	err := zkDo(ctx, env.ZKAddr, func(c *zk.Conn) error {
		if err := zkDeleteAll(c, st.Root); err != nil {
			return fmt.Errorf("delete %s: %w", st.Root, err)
		}
		if _, err := c.Create(st.Root, nil, zk.FlagPersistent, zk.WorldACL(zk.PermAll)); err != nil {
			return fmt.Errorf("create %s: %w", st.Root, err)
		}
		_, stat, err := c.Exists(st.Root)
		if err != nil {
			return err
		}
		st.From = stat.Czxid
		return nil
	})
	if err != nil {
		return "", fmt.Errorf("zk-lease prepare: %w", err)
	}
	if env.ZKDataDir != "" { // fail now rather than after the run
		if _, err := zkLogFiles(env.ZKDataDir); err != nil {
			return "", fmt.Errorf("zk-lease: the ZooKeeper's dataDir: %w", err)
		}
	}
	js, _ := json.Marshal(st)
	return string(js), nil
}

// zkDeleteAll deletes path and everything under it.
func zkDeleteAll(c *zk.Conn, path string) error {
	for range 5 { // ephemeral nodes of lingering sessions may come and go
		kids, _, err := c.Children(path)
		if errors.Is(err, zk.ErrNoNode) {
			return nil
		}
		if err != nil {
			return err
		}
		for _, k := range kids {
			if err := zkDeleteAll(c, path+"/"+k); err != nil {
				return err
			}
		}
		err = c.Delete(path, -1)
		if err == nil || errors.Is(err, zk.ErrNoNode) {
			return nil
		}
		if !errors.Is(err, zk.ErrNotEmpty) {
			return err
		}
	}
	return fmt.Errorf("%s keeps getting children", path)
}

// zkHistory reads the run's history from the ZooKeeper's transaction log (see zkLease).
func zkHistory(ctx context.Context, env *Env, store string) ([]LeaseEvent, error) {
	st, err := parseZKStore(store)
	if err != nil {
		return nil, err
	}
	if env.ZKDataDir == "" {
		return nil, errNoZKLog
	}
	// The end mark: a write after everything the workers did (they have all exited).
	var end int64
	err = zkDo(ctx, env.ZKAddr, func(c *zk.Conn) error {
		stat, err := c.Set(st.Root, []byte("end"), -1)
		if err == nil {
			end = stat.Mzxid
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("zk-lease: mark the end of the run: %w", err)
	}
	// The server writes a transaction to its log (flushed to the file on commit; forceSync=no
	// skips only the fsync) before it applies it and replies, so the mark is normally there
	// already; in an ensemble, the server whose dataDir this is may lag the one we wrote through.
	var tl *zkLog
	deadline := time.Now().Add(10 * time.Second)
	for {
		tl, err = readZKLog(env.ZKDataDir, st.From)
		if err != nil {
			return nil, fmt.Errorf("zk-lease: %w", err)
		}
		if tl.Last >= end {
			break
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("zk-lease: the transaction log in %s ends at zxid %#x (%s), before the end mark %#x",
				env.ZKDataDir, tl.Last, tl.Tail, end)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	txns := tl.Txns
	for len(txns) > 0 && txns[len(txns)-1].Zxid > end {
		txns = txns[:len(txns)-1]
	}
	evs, stats, err := zkLeaseEvents(txns, st.Root)
	if err != nil {
		return nil, fmt.Errorf("zk-lease: replaying the transaction log: %w", err)
	}
	if env.Dir != "" {
		note := fmt.Sprintf("transactions %#x..%#x (%d): %s\n", st.From, end, len(txns), stats)
		_ = os.WriteFile(filepath.Join(env.Dir, "zk-history.txt"), []byte(note), 0o644)
	}
	return evs, nil
}

// zkReplayStats counts what the replay of the log saw.
type zkReplayStats struct {
	Txns, Failed                 int // transactions under the root; failed requests and multis
	Grants, Extensions, Releases int
	Expired                      int // leases that ran out (deleted later, or never)
	SessionEnded                 int // leases ended by their session's end
	DeadHeads                    int // nodes that reached the head with their lease run out
	Zombies                      int // setData of a node whose granted lease had run out
	LateTakeUps                  int // ... with a new request token (a parked node taken up late)
	RequestSwaps                 int // request token rewritten on a live holder (same session)
	ForeignEnds                  int // a live holder deleted by another session
	MaxQueue                     int // most nodes in one key's queue
	ZombieMs                     int64
	firstZombie                  map[*zkNode]int64
	keysSeen                     map[string]bool
}

func (s *zkReplayStats) String() string {
	return fmt.Sprintf("%d under the root, %d failed requests (anywhere); %d keys; %d grants, %d extensions, %d releases, %d expired, "+
		"%d ended by their session, %d foreign deletions of a live lease; %d queued nodes reached the head expired; "+
		"%d late writes to an expired holder (zombie, %d ms in all before deletion), %d of them for a new request; "+
		"%d request-token rewrites of a live holder; longest queue %d",
		s.Txns, s.Failed, len(s.keysSeen), s.Grants, s.Extensions, s.Releases, s.Expired, s.SessionEnded, s.ForeignEnds,
		s.DeadHeads, s.Zombies, s.ZombieMs, s.LateTakeUps, s.RequestSwaps, s.MaxQueue)
}

// zkNode is a queue node in the replay.
type zkNode struct {
	name     string
	seq      int64
	czxid    int64
	owner    int64 // ephemeral owner session (0: persistent)
	writer   int64 // the session that wrote its data last
	mtimeMs  int64
	ttlMs    int64
	reqToken string // the request token in its data
	pid      int    // the pid in its data's metadata (0 if none)
	leaseTok string // the request token when it last held (granted or extended)
	ended    bool   // its lease ran out or ended while it held
	// deadCounted: counted as having reached the head with its lease run out.
	deadCounted bool
}

func (n *zkNode) expMs() int64 { return n.mtimeMs + n.ttlMs }

func (n *zkNode) token() [16]byte {
	var t [16]byte
	binary.BigEndian.PutUint64(t[:8], uint64(n.owner))
	binary.BigEndian.PutUint64(t[8:], uint64(n.writer))
	return t
}

// setData records a write of the node's data at timeMs by session.
func (n *zkNode) setData(data []byte, timeMs, session int64) {
	var r struct {
		Token    string `json:"token"`
		TTL      int64  `json:"ttl_ms"`
		Metadata string `json:"metadata"`
	}
	_ = json.Unmarshal(data, &r) // foreign data: no token, the shortest lease (as zklock reads it)
	if r.TTL <= 0 {
		r.TTL = dlock.MinTTL.Milliseconds()
	}
	n.reqToken, n.ttlMs, n.mtimeMs, n.writer, n.pid = r.Token, r.TTL, timeMs, session, metadataPid(r.Metadata)
}

// zkKeyState is one key directory in the replay.
type zkKeyState struct {
	key    string
	nodes  map[string]*zkNode
	holder *zkNode // the node holding a live lease, or nil
}

func (k *zkKeyState) head() *zkNode {
	var h *zkNode
	for _, n := range k.nodes {
		if h == nil || n.seq < h.seq {
			h = n
		}
	}
	return h
}

// zkLeaseEvents replays the transactions (in zxid order) under root by zklock's rules (see
// zkLease) and returns the lease events, in order.
func zkLeaseEvents(txns []zkTxn, root string) ([]LeaseEvent, *zkReplayStats, error) {
	stats := &zkReplayStats{firstZombie: map[*zkNode]int64{}, keysSeen: map[string]bool{}}
	keys := map[string]*zkKeyState{}     // by directory name
	owned := map[int64]map[string]bool{} // session → its ephemeral nodes under root (paths)
	var out []LeaseEvent
	us := func(ms int64) int64 { return ms * 1000 }
	prefix := root + "/"
	// locate splits a path under root into the key directory and the node name ("" for the
	// directory itself); ok is false for other paths.
	locate := func(path string) (dir, name string, ok bool) {
		rel, ok := strings.CutPrefix(path, prefix)
		if !ok || rel == "" {
			return "", "", false
		}
		dir, name, _ = strings.Cut(rel, "/")
		if key, isKey := zklock.KeyOfNode(dir); isKey && (key == rwKey || key == semKey) {
			return "", "", false // a mode key's queue: the mode keys' checks do not read this record
		}
		if name == zklock.JournalNode || strings.HasPrefix(name, zklock.JournalNode+"/") {
			return "", "", false // the key's change journal: no lease lives there
		}
		return dir, name, !strings.Contains(name, "/")
	}
	for i := range txns {
		t := &txns[i]
		T := t.TimeMs
		if !t.Applied() {
			stats.Failed++ // nothing changed (a failed request or multi, under any root)
			continue
		}
		type deletion struct {
			by      int64
			session bool // by the end of its owner's session
		}
		deleted := map[*zkNode]deletion{}
		written := map[*zkNode]bool{}
		touched := map[*zkKeyState]bool{}
		// The paths this transaction changes, and with closeSession the session's nodes.
		var ops []zkOp
		for _, o := range t.Ops {
			if o.Type == zkOpCloseSession {
				var mine []string
				for p := range owned[t.Session] {
					mine = append(mine, p)
				}
				sort.Strings(mine)
				if o.HasPaths {
					var listed []string
					for _, p := range o.Paths2Delete {
						// Only the nodes the replay follows (not a mode
						// key's, which locate leaves out).
						if _, _, ok := locate(p); ok {
							listed = append(listed, p)
						}
					}
					sort.Strings(listed)
					if strings.Join(listed, " ") != strings.Join(mine, " ") {
						return nil, nil, fmt.Errorf("zxid %#x: closeSession of %#x deletes %v, the replay has %v", t.Zxid, t.Session, listed, mine)
					}
				}
				for _, p := range mine {
					ops = append(ops, zkOp{Type: zkOpCloseSession, Path: p})
				}
				continue
			}
			if _, _, ok := locate(o.Path); ok {
				ops = append(ops, o)
			}
		}
		if len(ops) == 0 {
			continue
		}
		stats.Txns++
		// Leases that ran out before this transaction.
		for _, o := range ops {
			dir, _, _ := locate(o.Path)
			if k := keys[dir]; k != nil && k.holder != nil && k.holder.expMs() <= T {
				k.holder.ended = true
				k.holder = nil
				stats.Expired++
			}
		}
		for _, o := range ops {
			dir, name, _ := locate(o.Path)
			k := keys[dir]
			if name == "" { // the key directory itself
				switch o.Type {
				case zkOpCreate, zkOpCreate2, zkOpCreateContainer, zkOpCreateTTL:
					if k == nil {
						key, ok := zklock.KeyOfNode(dir)
						if !ok {
							return nil, nil, fmt.Errorf("zxid %#x: %s is not a key directory of zklock", t.Zxid, o.Path)
						}
						keys[dir] = &zkKeyState{key: key, nodes: map[string]*zkNode{}}
						stats.keysSeen[key] = true
					}
				case zkOpDelete, zkOpDeleteContainer:
					if k != nil && len(k.nodes) > 0 {
						return nil, nil, fmt.Errorf("zxid %#x: %s deleted with %d children in the replay", t.Zxid, o.Path, len(k.nodes))
					}
					delete(keys, dir)
				}
				continue
			}
			if k == nil {
				return nil, nil, fmt.Errorf("zxid %#x: %s outside a known key directory", t.Zxid, o.Path)
			}
			touched[k] = true
			n := k.nodes[name]
			switch o.Type {
			case zkOpCreate, zkOpCreate2, zkOpCreateContainer, zkOpCreateTTL:
				seq, ok := zkSeq(name)
				if !ok {
					return nil, nil, fmt.Errorf("zxid %#x: %s is not a queue node", t.Zxid, o.Path)
				}
				if n != nil {
					return nil, nil, fmt.Errorf("zxid %#x: %s created twice", t.Zxid, o.Path)
				}
				n = &zkNode{name: name, seq: seq, czxid: t.Zxid}
				if o.Ephemeral {
					n.owner = t.Session
					if owned[t.Session] == nil {
						owned[t.Session] = map[string]bool{}
					}
					owned[t.Session][o.Path] = true
				}
				n.setData(o.Data, T, t.Session)
				k.nodes[name] = n
				stats.MaxQueue = max(stats.MaxQueue, len(k.nodes))
			case zkOpSetData:
				if n == nil {
					return nil, nil, fmt.Errorf("zxid %#x: setData of %s, unknown to the replay", t.Zxid, o.Path)
				}
				n.setData(o.Data, T, t.Session)
				written[n] = true
			case zkOpDelete, zkOpDeleteContainer, zkOpCloseSession:
				if n == nil {
					return nil, nil, fmt.Errorf("zxid %#x: delete of %s, unknown to the replay", t.Zxid, o.Path)
				}
				delete(k.nodes, name)
				delete(owned[n.owner], o.Path)
				deleted[n] = deletion{by: t.Session, session: o.Type == zkOpCloseSession}
				if z, ok := stats.firstZombie[n]; ok {
					stats.ZombieMs += T - z
					delete(stats.firstZombie, n)
				}
			case zkOpCheck:
			default:
				return nil, nil, fmt.Errorf("zxid %#x: transaction type %d on %s", t.Zxid, o.Type, o.Path)
			}
		}
		// Each key touched, in a fixed order.
		var ks []*zkKeyState
		for k := range touched {
			ks = append(ks, k)
		}
		sort.Slice(ks, func(i, j int) bool { return ks[i].key < ks[j].key })
		for _, k := range ks {
			ev := func(n *zkNode, expMs int64) LeaseEvent {
				return LeaseEvent{Seq: t.Zxid, Key: k.key, Fence: uint64(n.czxid), Token: n.token(), AtUs: us(T), ExpUs: us(expMs), Pid: n.pid}
			}
			if h := k.holder; h != nil {
				if d, gone := deleted[h]; gone {
					switch {
					case d.session:
						out = append(out, ev(h, T)) // the lease ended now: its expiry moves here
						stats.SessionEnded++
					case d.by == h.owner:
						e := ev(h, T)
						e.Release = true
						out = append(out, e)
						stats.Releases++
					default:
						stats.ForeignEnds++ // the next grant is flagged as a grant while held
					}
					h.ended = true
					k.holder = nil
				} else if written[h] {
					if h.reqToken != h.leaseTok {
						stats.RequestSwaps++
						h.leaseTok = h.reqToken
					}
					out = append(out, ev(h, h.expMs()))
					stats.Extensions++
				}
			}
			if k.holder != nil {
				continue
			}
			n := k.head()
			if n == nil {
				continue
			}
			switch {
			case n.ended && !written[n]:
				continue
			case n.ended:
				// A late write (a renewal, or a parked node taken up for a new
				// request): zklock deletes the node; it holds nothing.
				stats.Zombies++
				if n.reqToken != n.leaseTok {
					stats.LateTakeUps++
				}
				if _, ok := stats.firstZombie[n]; !ok {
					stats.firstZombie[n] = T
				}
				continue
			case n.expMs() <= T:
				if !n.deadCounted {
					n.deadCounted = true
					stats.DeadHeads++
				}
				continue
			}
			n.leaseTok = n.reqToken
			k.holder = n
			out = append(out, ev(n, n.expMs()))
			stats.Grants++
		}
	}
	return out, stats, nil
}

// zkSeq returns the sequence number of a queue node's name (zklock's "n-" and 10 digits).
func zkSeq(name string) (int64, bool) {
	digits, ok := strings.CutPrefix(name, "n-")
	if !ok || len(digits) != 10 {
		return 0, false
	}
	n, err := strconv.ParseInt(digits, 10, 64)
	return n, err == nil
}

package zklock

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/dlock-dev/dlock"
	"github.com/go-zookeeper/zk"
)

// qnode is a queue node's name, parsed: its prefix says how it shares the
// key (see "Modes" in the package doc), and ZooKeeper appends the sequence.
type qnode struct {
	name  string
	seq   int64
	mode  dlock.Mode
	limit int
}

// prefixOf is the name prefix of nodes of mode m (and limit, for
// ModeLimited).
func prefixOf(m dlock.Mode, limit int) string {
	switch m {
	case dlock.ModeShared:
		return "r-"
	case dlock.ModeLimited:
		return "l" + strconv.Itoa(limit) + "-"
	}
	return "n-"
}

// parseNode parses a queue node's name; false for other names.
func parseNode(name string) (qnode, bool) {
	if len(name) < 12 {
		return qnode{}, false
	}
	prefix, digits := name[:len(name)-10], name[len(name)-10:]
	for i := range len(digits) {
		if digits[i] < '0' || digits[i] > '9' {
			return qnode{}, false
		}
	}
	seq, _ := strconv.ParseInt(digits, 10, 64)
	n := qnode{name: name, seq: seq}
	switch prefix {
	case "n-":
	case "r-":
		n.mode = dlock.ModeShared
	default:
		v, ok := strings.CutPrefix(prefix, "l")
		v, ok2 := strings.CutSuffix(v, "-")
		limit, err := strconv.Atoi(v)
		if !ok || !ok2 || err != nil || limit < 1 || limit > dlock.MaxLimit || strconv.Itoa(limit) != v {
			return qnode{}, false
		}
		n.mode, n.limit = dlock.ModeLimited, limit
	}
	return n, true
}

// sameClass reports whether nodes of a and b may hold the key together or
// queue for it together: exclusive and shared nodes are one class (a
// reader-writer lock), limited nodes of one limit another.
func sameClass(a, b qnode) bool {
	if a.mode == dlock.ModeLimited || b.mode == dlock.ModeLimited {
		return a.mode == b.mode && a.limit == b.limit
	}
	return true
}

// describe names a node's mode for errors.
func describe(n qnode) string {
	return dlock.DescribeMode(n.mode, n.limit)
}

// queue returns the queue nodes under dir in sequence order, and an empty
// queue if dir does not exist.
func (b *Backend) queue(dir string) ([]qnode, error) {
	names, _, err := b.c.Children(dir)
	if errors.Is(err, zk.ErrNoNode) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var q []qnode
	for _, nm := range names {
		if n, ok := parseNode(nm); ok {
			q = append(q, n)
		}
	}
	slices.SortFunc(q, func(a, b qnode) int { return int(a.seq - b.seq) })
	return q, nil
}

// indexOf returns the index of the node named nm in q, or -1.
func indexOf(q []qnode, nm string) int {
	return slices.IndexFunc(q, func(n qnode) bool { return n.name == nm })
}

// view is one reading of a key's queue, through which the rules of the
// package doc ("Modes") decide about its nodes. It reads a node's data
// only when a rule needs it, once.
type view struct {
	b     *Backend
	dir   string
	q     []qnode
	now   int64 // the leader's time (ms): a node whose lease ended by then is dead
	watch bool  // read with GetW: a waiter watches what blocks it
	prune bool  // delete dead nodes
	seen  map[int]*seenNode
}

// seenNode is what a view read of a node.
type seenNode struct {
	data []byte
	r    record
	st   *zk.Stat
	end  int64 // end of its lease, the leader's time (ms)
	ch   <-chan zk.Event
	dead bool // gone, or its lease ended by view.now
}

// frozen is a view.now for which no node is dead: decisions that only
// need to be conservative, or that are an administrator's.
const frozen = math.MinInt64

func (b *Backend) newView(dir string, q []qnode, now int64) *view {
	return &view{b: b, dir: dir, q: q, now: now, seen: make(map[int]*seenNode)}
}

// look reads node j (once).
func (v *view) look(j int) (*seenNode, error) {
	if s := v.seen[j]; s != nil {
		return s, nil
	}
	path := v.dir + "/" + v.q[j].name
	var (
		data []byte
		st   *zk.Stat
		ch   <-chan zk.Event
		err  error
	)
	if v.watch {
		data, st, ch, err = v.b.c.GetW(path)
	} else {
		data, st, err = v.b.c.Get(path)
	}
	s := &seenNode{}
	switch {
	case errors.Is(err, zk.ErrNoNode):
		s.dead = true
	case err != nil:
		return nil, err
	default:
		s.data, s.r, s.st, s.ch = data, decode(data), st, ch
		s.end = expiry(s.r, st)
		if s.end <= v.now {
			// Its lease ended: it is never revived (a late write deletes
			// its node), so it counts as gone whether or not the delete
			// below wins.
			s.dead = true
			if v.prune {
				del := func() error { return v.b.c.Delete(path, st.Version) }
				if !s.r.Mark { // a waiter's or a holder's: the journal tells
					del = func() error { return v.b.deleteHolder(v.dir, v.q[j].name, st.Version, kindExpired, st.Czxid, s.r) }
				}
				if err := del(); err != nil && !notHeld(err) {
					return nil, err
				}
			}
		}
	}
	v.seen[j] = s
	return s, nil
}

// verdict is what the rules say of one node.
type verdict struct {
	granted bool
	// mismatch is the index of the live node of another class that heads
	// the queue (the key is held in another mode), or -1.
	mismatch int
	// block are live nodes that keep the node waiting.
	block []int
	// marks are live writer marks ahead of an exclusive node, which its
	// grant deletes: with no block, it is granted once they are gone.
	marks []int
}

// judge applies the rules to node i, reading nodes ahead of it in sequence
// order (forward) or from the nearest (!forward). A waiter judges backwards,
// so that it watches only the nearest node that blocks it.
func (v *view) judge(i int, forward bool) (verdict, error) {
	me := v.q[i]
	vd := verdict{mismatch: -1}
	// A live node of another class ahead: the key is held in another mode
	// if it is the first live node, and otherwise it is a request that
	// will find the mismatch and withdraw (wait for it to go: it may yet
	// be granted if the nodes ahead of it leave first).
	for j := range i {
		if sameClass(v.q[j], me) {
			continue
		}
		s, err := v.look(j)
		if err != nil || s.dead {
			if err != nil {
				return vd, err
			}
			continue
		}
		first := true
		for k := range j {
			sk, err := v.look(k)
			if err != nil {
				return vd, err
			}
			if !sk.dead {
				first = false
				break
			}
		}
		if first {
			vd.mismatch = j
		} else {
			vd.block = []int{j}
		}
		return vd, nil
	}
	order := make([]int, i)
	for k := range i {
		if forward {
			order[k] = k
		} else {
			order[k] = i - 1 - k
		}
	}
	switch me.mode {
	case dlock.ModeExclusive:
		// Granted when it is the lowest live node; writer marks ahead do
		// not count (and are deleted by the grant).
		for _, j := range order {
			s, err := v.look(j)
			if err != nil {
				return vd, err
			}
			switch {
			case s.dead:
			case s.r.Mark:
				vd.marks = append(vd.marks, j)
			default:
				vd.block = []int{j}
				return vd, nil
			}
		}
		vd.granted = len(vd.marks) == 0
	case dlock.ModeShared:
		// Granted when no live exclusive node (a holder, a waiting writer
		// or a writer mark) is ahead.
		for _, j := range order {
			if v.q[j].mode != dlock.ModeExclusive {
				continue
			}
			s, err := v.look(j)
			if err != nil {
				return vd, err
			}
			if !s.dead {
				vd.block = []int{j}
				return vd, nil
			}
		}
		vd.granted = true
	case dlock.ModeLimited:
		// Granted when fewer than limit live nodes are ahead.
		if i < me.limit {
			vd.granted = true
			return vd, nil
		}
		dead := 0
		for _, j := range order {
			s, err := v.look(j)
			if err != nil {
				return vd, err
			}
			if s.dead {
				dead++
				continue
			}
			vd.block = append(vd.block, j)
			if !forward && i-dead > me.limit {
				// Not the first waiter: it waits for its predecessor
				// (whose grant, renewal or removal wakes it) rather than
				// for every holder.
				return vd, nil
			}
			if len(vd.block) == me.limit {
				return vd, nil
			}
		}
		vd.block = nil
		vd.granted = true
	}
	return vd, nil
}

// holds reports whether node j holds the key by the rules (an exclusive
// node with only writer marks ahead does: it deletes them when it looks).
// A mark never holds.
func (v *view) holds(j int) (bool, error) {
	s, err := v.look(j)
	if err != nil || s.dead || s.r.Mark {
		return false, err
	}
	vd, err := v.judge(j, true)
	return err == nil && vd.mismatch < 0 && len(vd.block) == 0, err
}

// find returns the index of the node that carries token, or -1.
func (v *view) find(token dlock.Token) (int, error) {
	tok := token.String()
	for j := range v.q {
		s, err := v.look(j)
		if err != nil {
			return -1, err
		}
		if !s.dead && s.r.Token == tok {
			return j, nil
		}
	}
	return -1, nil
}

// deleteMarks deletes the writer marks js that v read, each only if
// unchanged since (a mark taken up by its writer's wait is a waiting
// writer).
func (v *view) deleteMarks(js []int) error {
	for _, j := range js {
		s := v.seen[j]
		if err := v.b.c.Delete(v.dir+"/"+v.q[j].name, s.st.Version); err != nil && !notHeld(err) {
			return err
		}
	}
	return nil
}

// soonest returns, of the nodes js that v read, the one whose lease ends
// first.
func (v *view) soonest(js []int) int {
	best := js[0]
	for _, j := range js[1:] {
		if v.seen[j].end < v.seen[best].end {
			best = j
		}
	}
	return best
}

// holderInfo describes node j, which v read; of a writer mark, which holds
// nothing, only the key.
func (v *view) holderInfo(key string, j int) dlock.LockInfo {
	s := v.seen[j]
	if s.r.Mark {
		return dlock.LockInfo{Key: key}
	}
	return info(key, v.q[j], s.r, s.st)
}

// mismatchError is the error of the request of node me for a key whose
// queue is headed by node other, of another class.
func mismatchError(me, other qnode) error {
	return fmt.Errorf("held %s, asked %s: %w", describe(other), describe(me), dlock.ErrModeMismatch)
}

// wake returns a channel closed when a watch that v set on one of the
// nodes js fires, and the function that stops waiting for them.
func (v *view) wake(js []int) (<-chan struct{}, func()) {
	woke, done := make(chan struct{}), make(chan struct{})
	var once sync.Once
	for _, j := range js {
		ch := v.seen[j].ch
		if ch == nil {
			continue
		}
		go func() {
			select {
			case <-ch:
				once.Do(func() { close(woke) })
			case <-done:
			}
		}()
	}
	return woke, func() { close(done) }
}

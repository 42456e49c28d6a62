package torture

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strings"

	"github.com/dlock-dev/dlock"
)

// Mode keys. Besides its exclusive keys, a run with Config.ModeKeys has a
// reader-writer key (rwKey: shared holds, and a share of exclusive ones) on
// strategies that grant shared locks, and a semaphore key (semKey, semLimit
// holders) on those that grant limited ones. The checker judges them by the
// workers' records and the resource log (checkModes); the store-history
// checks cover the exclusive keys only.
const (
	rwKey     = "rw"
	semKey    = "sem"
	leaderKey = "ld" // taken through an Election: an exclusive key for every check
	semLimit  = 2
)

// rwDraws are the modes a lane asks the reader-writer key in, true for
// shared, drawn without replacement and refilled when drawn out: three
// shared asks in four, and every lane asks exclusive at least once in any
// four asks in a row, so that even a short or slow run takes the key in
// both modes (the checker needs both).
var rwDraws = [...]bool{true, true, true, false}

// modeKeys returns the mode keys of a strategy that grants modes.
func modeKeys(modes []dlock.Mode) map[string]int {
	out := map[string]int{}
	if slices.Contains(modes, dlock.ModeShared) {
		out[rwKey] = 0
	}
	if slices.Contains(modes, dlock.ModeLimited) {
		out[semKey] = semLimit
	}
	return out
}

// SupportsMode passes the wrapped backend's dlock.Sharer through, so that
// the Locker grants the modes the store does.
func (b *timedBackend) SupportsMode(m dlock.Mode) bool {
	if s, ok := b.Backend.(dlock.Sharer); ok {
		return s.SupportsMode(m)
	}
	return m == dlock.ModeExclusive
}

// supportsModes checks that a worker's backend grants its mode keys' modes:
// an Adapter's Modes that the backend does not keep is a harness bug.
func supportsModes(b dlock.Backend, keys map[string]int) error {
	for k, n := range keys {
		m := dlock.ModeShared
		if n > 0 {
			m = dlock.ModeLimited
		}
		if s, ok := b.(dlock.Sharer); !ok || !s.SupportsMode(m) {
			return fmt.Errorf("key %s: the backend does not grant %s locks", k, dlock.DescribeMode(m, n))
		}
	}
	return nil
}

// plain reports whether key is an exclusive key taken with Acquire (not a
// mode key, not the election's): the keys of the Do and deadline faults.
func (w *worker) plain(key string) bool {
	_, mode := w.cfg.ModeKeys[key]
	return !mode && key != w.cfg.Leader
}

// observe records every leader an Election observer of the worker's
// Locker reports ("obs" events), until ctx ends.
func (w *worker) observe(ctx context.Context) {
	for ld := range dlock.NewElection(w.locker, w.cfg.Leader).Observe(ctx) {
		w.rec.rec(Event{Ev: "obs", K: w.cfg.Leader, F: ld.Fence, Val: ld.Value})
	}
}

// List, Watch and SetMetadata pass the wrapped backend's capabilities
// through (an Election needs them).
func (b *timedBackend) List(ctx context.Context, prefix string) ([]dlock.LockInfo, error) {
	if l, ok := b.Backend.(dlock.Lister); ok {
		return l.List(ctx, prefix)
	}
	return nil, dlock.ErrUnsupported
}

func (b *timedBackend) Watch(ctx context.Context, key string) (<-chan struct{}, error) {
	if w, ok := b.Backend.(dlock.Watcher); ok {
		return w.Watch(ctx, key)
	}
	return nil, dlock.ErrUnsupported
}

func (b *timedBackend) WatchHolders(ctx context.Context, key string) ([]dlock.LockInfo, <-chan []dlock.LockInfo, error) {
	if w, ok := b.Backend.(dlock.HolderWatcher); ok {
		return w.WatchHolders(ctx, key)
	}
	return nil, nil, dlock.ErrUnsupported
}

func (b *timedBackend) SetMetadata(ctx context.Context, key string, token dlock.Token, metadata string) error {
	if m, ok := b.Backend.(dlock.MetadataSetter); ok {
		return m.SetMetadata(ctx, key, token, metadata)
	}
	return dlock.ErrUnsupported
}

// acquireOptions are a lane's options for acquiring key: the worker's TTL,
// and the mode the key is taken in (for the reader-writer key, drawn from
// rwDraws).
func (l *lane) acquireOptions(key string) []dlock.AcquireOption {
	opts := []dlock.AcquireOption{dlock.WithTTL(l.w.cfg.TTL)}
	n, ok := l.w.cfg.ModeKeys[key]
	switch {
	case !ok:
	case n > 0:
		opts = append(opts, dlock.WithLimit(n))
	case l.drawShared():
		opts = append(opts, dlock.Shared())
	}
	return opts
}

// drawShared draws the lane's next mode for the reader-writer key from its
// bag of rwDraws: true for shared.
func (l *lane) drawShared() bool {
	if len(l.rwBag) == 0 {
		l.rwBag = append(l.rwBag, rwDraws[:]...)
		l.rng.Shuffle(len(l.rwBag), func(i, j int) { l.rwBag[i], l.rwBag[j] = l.rwBag[j], l.rwBag[i] })
	}
	shared := l.rwBag[len(l.rwBag)-1]
	l.rwBag = l.rwBag[:len(l.rwBag)-1]
	return shared
}

// describeModeKeys names a run's mode keys for its progress line.
func describeModeKeys(keys map[string]int, leader string) string {
	var out []string
	if leader != "" {
		out = append(out, leader+" (election)")
	}
	if _, ok := keys[rwKey]; ok {
		out = append(out, rwKey+" (shared/exclusive)")
	}
	if n, ok := keys[semKey]; ok {
		out = append(out, fmt.Sprintf("%s (limit %d)", semKey, n))
	}
	if len(out) == 0 {
		return ""
	}
	return " + " + strings.Join(out, ", ")
}

// accessOf is the resource's access mode for a lock's mode.
func accessOf(m dlock.Mode) string {
	switch m {
	case dlock.ModeShared:
		return accessShared
	case dlock.ModeLimited:
		return accessLimited
	}
	return accessExclusive
}

// modeField is an access mode as events record it (empty: exclusive).
func modeField(mode string) string {
	if mode == accessExclusive {
		return ""
	}
	return mode
}

// Violation kinds of the mode keys.
const (
	// vOverClaimed: the Locker said "held" (Err nil before an access) to
	// more holders at one instant than the key's mode allows.
	vOverClaimed = "client: more holders told \"held\" at once than the mode allows"
	// vOverLimit: more holders of a semaphore used the resource in
	// overlapping spans than its limit, with an access that no lock
	// check preceded (fencing cannot order a semaphore's holders; see
	// checkModes).
	vOverLimit = "resource: more semaphore holders at once than the limit"
)

func init() { resourceKinds[vOverLimit] = true }

// ModeStats are a run's figures for its mode keys.
type ModeStats struct {
	Key          string `json:"key"`
	Limit        int    `json:"limit,omitempty"` // semaphore: its limit; 0: reader-writer
	Shared       int    `json:"shared,omitempty"`
	Exclusive    int    `json:"exclusive,omitempty"`
	Limited      int    `json:"limited,omitempty"`
	MaxHolders   int    `json:"max_holders"`   // most holders told "held" at once
	Overlapping  int    `json:"overlapping"`   // holds told "held" while another holder of the key was
	OpsAccepted  int    `json:"ops_accepted"`  // accesses the resource took
	OpsRejected  int    `json:"ops_rejected"`  // accesses the resource refused (fencing)
	AfterPause   int    `json:"after_pause"`   // semaphore: over-limit spans made by an access whose check came before a newer holder's grant
	AccessesSeen int    `json:"accesses_seen"` // resource log rows of the key
	Violations   int    `json:"violations"`    // found on the key, known limitations left out
}

// splitModes moves the mode keys' holds, failed waits, store history and
// resource rows out of the exclusive keys' checks, into c.modeHolds and
// c.modeLog.
func (c *checker) splitModes() {
	if len(c.in.ModeKeys) == 0 {
		return
	}
	isMode := func(k string) bool { _, ok := c.in.ModeKeys[k]; return ok }
	var excl []*hold
	for _, h := range c.holds {
		if isMode(h.key) {
			c.modeHolds = append(c.modeHolds, h)
		} else {
			excl = append(excl, h)
		}
	}
	c.holds = excl
	for k := range c.in.ModeKeys {
		delete(c.failed, k)
		delete(c.cutAcq, k)
	}
	c.in.History = slices.DeleteFunc(slices.Clone(c.in.History), func(e LeaseEvent) bool { return isMode(e.Key) })
	var res []logRow
	for _, r := range c.in.ResLog {
		if isMode(r.Key) {
			c.modeLog = append(c.modeLog, r)
		} else {
			res = append(res, r)
		}
	}
	c.in.ResLog = res
}

// knownUnder returns the fault under which the strategy declares kind a
// known limitation, for the first of hs that such a fault hit, or "".
func (c *checker) knownUnder(kind string, hs ...*hold) string {
	for _, h := range hs {
		for _, f := range []*FaultRecord{h.hitBy, h.restarted} {
			if f != nil && slices.Contains(c.in.Known[f.Kind], kind) {
				return f.Kind
			}
		}
	}
	return ""
}

// violateAmong records a violation involving hs, as known when a fault
// that hit one of them makes it a known limitation of the strategy.
func (c *checker) violateAmong(hs []*hold, kind, format string, args ...any) {
	if f := c.knownUnder(kind, hs...); f != "" {
		if c.rep.Known == nil {
			c.rep.Known = map[string]int{}
		}
		c.rep.Known[kind+" (under "+f+")"]++
		return
	}
	c.violate(kind, format, args...)
}

// checkModes checks the mode keys:
//
//   - What the Locker told: a hold was told "held" from its acquisition's
//     return to its last check of Err before an access (both certain:
//     loss is final, and the check's instant is a lower bound). At no
//     instant may more holds be told so than the mode allows: one
//     exclusive holder alone, any number of shared ones, at most the limit
//     of a semaphore's.
//   - What the resource took, in its commit order: with fencing it refuses
//     a shared access whose fence is below an exclusive one it took, and an
//     exclusive access below any (resource.go); the replay checks that it
//     did, that an exclusive holder's accesses were never interleaved with
//     another holder's, and that no write was lost. A semaphore's holders
//     cannot be fenced: the replay counts holders whose accesses span one
//     another, and more than the limit is a violation unless one of them
//     made its later access on a check that came before the newer holder's
//     grant (a pause between check and access, which only the holder's own
//     clock could catch; counted in AfterPause).
func (c *checker) checkModes() {
	keys := make([]string, 0, len(c.in.ModeKeys))
	for k := range c.in.ModeKeys {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		ms := &ModeStats{Key: k, Limit: c.in.ModeKeys[k]}
		c.rep.Modes = append(c.rep.Modes, ms)
		before := c.rep.ViolationCount
		var hs []*hold
		for _, h := range c.modeHolds {
			if h.key != k {
				continue
			}
			hs = append(hs, h)
			switch h.mode {
			case accessShared:
				ms.Shared++
			case accessLimited:
				ms.Limited++
				if h.limit != ms.Limit {
					c.violate(vModeMismatch, "%s fence %d (%s): limit %d, the key's is %d", k, h.fence, h.worker, h.limit, ms.Limit)
				}
			default:
				ms.Exclusive++
			}
		}
		c.checkClaims(ms, hs)
		var rows []logRow
		for _, r := range c.modeLog {
			if r.Key == k {
				rows = append(rows, r)
			}
		}
		c.checkModeResource(ms, hs, rows)
		ms.Violations = c.rep.ViolationCount - before
		if !c.in.Control {
			switch {
			case ms.Limit > 0 && ms.Limited == 0:
				c.inconclusive("semaphore key %s: no acquisition", k)
			case ms.Limit == 0 && (ms.Shared == 0 || ms.Exclusive == 0):
				c.inconclusive("reader-writer key %s: %d shared and %d exclusive acquisitions; both are needed", k, ms.Shared, ms.Exclusive)
			}
		}
	}
}

// vModeMismatch: a hold of a mode key in a mode or limit other than the
// key's (a harness bug, or the Locker granting what was not asked).
const vModeMismatch = "client: hold in a mode other than its key's"

// checkClaims sweeps the spans in which the holds of one key were told
// "held".
func (c *checker) checkClaims(ms *ModeStats, hs []*hold) {
	var spans []*hold
	for _, h := range hs {
		if h.lastChk >= h.acqOK && h.lastChk > 0 {
			spans = append(spans, h)
		}
	}
	sort.Slice(spans, func(i, j int) bool { return spans[i].acqOK < spans[j].acqOK })
	var active []*hold
	for _, h := range spans {
		active = slices.DeleteFunc(active, func(a *hold) bool { return a.lastChk < h.acqOK })
		if len(active) > 0 {
			ms.Overlapping++
		}
		var bad []*hold
		switch {
		case h.mode == accessLimited:
			if len(active)+1 > ms.Limit {
				bad = active
			}
		case h.mode == accessShared:
			for _, a := range active {
				if a.mode != accessShared {
					bad = append(bad, a)
				}
			}
		default:
			bad = active
		}
		active = append(active, h)
		ms.MaxHolders = max(ms.MaxHolders, len(active))
		if len(bad) > 0 {
			var who []string
			for _, b := range bad {
				who = append(who, fmt.Sprintf("%s %d (%s, until %s)", describeAccess(b.mode), b.fence, b.worker, c.rel(b.lastChk)))
			}
			c.violateAmong(append(slices.Clone(bad), h), vOverClaimed, "%s: %s %d (%s) held from %s while %s", h.key,
				describeAccess(h.mode), h.fence, h.worker, c.rel(h.acqOK), strings.Join(who, ", "))
		}
	}
}

func describeAccess(mode string) string {
	switch mode {
	case accessShared:
		return "shared"
	case accessLimited:
		return "limited"
	}
	return "exclusive"
}

// checkModeResource replays one mode key's resource log.
func (c *checker) checkModeResource(ms *ModeStats, hs []*hold, rows []logRow) {
	byFence := map[uint64]*hold{}
	for _, h := range hs {
		byFence[h.fence] = h
	}
	type span struct{ first, last int }
	spans := map[uint64]*span{}
	var order []uint64 // fences by first accepted access
	var seen, xseen uint64
	var value int64
	for i, r := range rows {
		ms.AccessesSeen++
		if r.Seen != seen || r.XSeen != xseen || r.CurVal != value {
			c.violate(vResourceBadLog, "%s id %d: log says seen %d/%d value %d, replay has %d/%d and %d", r.Key, r.ID, r.Seen, r.XSeen, r.CurVal, seen, xseen, value)
			seen, xseen, value = r.Seen, r.XSeen, r.CurVal
		}
		if h := byFence[r.Fence]; h != nil && h.mode != r.Mode {
			c.violate(vModeMismatch, "%s id %d: fence %d accessed as %s, granted as %s", r.Key, r.ID, r.Fence, describeAccess(r.Mode), describeAccess(h.mode))
		}
		ok := admits(r.Mode, r.Fence, seen, xseen)
		if !r.Accepted {
			ms.OpsRejected++
			if ok {
				c.violate(vFreshRejected, "%s id %d: %s fence %d, seen %d/%d", r.Key, r.ID, describeAccess(r.Mode), r.Fence, seen, xseen)
			}
			continue
		}
		ms.OpsAccepted++
		if !ok {
			c.violate(vStaleAccepted, "%s id %d: %s (%s) presented fence %d after fence %d (exclusive %d) was seen", r.Key, r.ID, r.Worker, describeAccess(r.Mode), r.Fence, seen, xseen)
		}
		if r.Op == "w" && r.Mode == accessExclusive && r.ReadVal != value {
			c.violate(vLostUpdate, "%s id %d: %s/%d wrote %d+1 over %d", r.Key, r.ID, r.Worker, r.Fence, r.ReadVal, value)
		}
		if s := spans[r.Fence]; s != nil {
			s.last = i
		} else {
			spans[r.Fence] = &span{i, i}
			order = append(order, r.Fence)
		}
		seen = max(seen, r.Fence)
		if r.Mode == accessExclusive {
			xseen = max(xseen, r.Fence)
		}
		value = r.NewVal
	}
	if ms.Limit == 0 {
		// An exclusive holder's span holds no other holder's accepted access.
		for _, f := range order {
			s := spans[f]
			if rows[s.first].Mode != accessExclusive {
				continue
			}
			for i := s.first + 1; i < s.last; i++ {
				if r := rows[i]; r.Accepted && r.Fence != f {
					c.violate(vInterleaved, "%s id %d: %s (%s, fence %d) accessed inside exclusive fence %d's span (ids %d–%d)", r.Key, r.ID,
						r.Worker, describeAccess(r.Mode), r.Fence, f, rows[s.first].ID, rows[s.last].ID)
					break
				}
			}
		}
		return
	}
	// Semaphore: at each holder's first access, the holders whose spans
	// cover it.
	for _, f := range order {
		s := spans[f]
		var cover []uint64
		for _, g := range order {
			if t := spans[g]; t.first <= s.first && t.last >= s.first {
				cover = append(cover, g)
			}
		}
		if len(cover) <= ms.Limit {
			continue
		}
		// The newest grant among them, and the holders whose accesses after
		// its first were all made on checks older than that grant.
		newest := byFence[f]
		for _, g := range cover {
			if h := byFence[g]; h != nil && (newest == nil || h.acqOK > newest.acqOK) {
				newest = h
			}
		}
		paused := 0
		if newest != nil {
			for _, g := range cover {
				if g == newest.fence {
					continue
				}
				after, old := 0, 0
				for i := spans[newest.fence].first + 1; i <= spans[g].last; i++ {
					if r := rows[i]; r.Accepted && r.Fence == g {
						after++
						if r.Chk > 0 && r.Chk < newest.acqOK {
							old++
						}
					}
				}
				if after > 0 && after == old {
					paused++
				}
			}
		}
		if len(cover)-paused <= ms.Limit {
			ms.AfterPause++
			continue
		}
		var involved []*hold
		for _, g := range cover {
			if h := byFence[g]; h != nil {
				involved = append(involved, h)
			}
		}
		c.violateAmong(involved, vOverLimit, "%s id %d: %d holders' spans cover it (fences %v), limit %d", rows[s.first].Key, rows[s.first].ID, len(cover), cover, ms.Limit)
	}
}

// vObserved: an Election observer reported a leader out of fence order, or
// a term with the value of another term's leader.
const vObserved = "observer: leader reported out of order or with another term's value"

// ObserverStats are a run's figures for its election's observers.
type ObserverStats struct {
	Reports int `json:"reports"` // leaders (and "nobody") reported, every worker
	Terms   int `json:"terms"`   // terms of the election key acquired by workers
	Seen    int `json:"seen"`    // of those, terms some observer reported
	// Failover: a leader's SIGKILL → the next term's Campaign returned;
	// Observed: → the first observer's report of that term (ms).
	Failover Stats `json:"failover"`
	Observed Stats `json:"observed"`
}

// checkObservers checks the election's observers: each one's reports of a
// leader come in increasing fence order (a value change keeps the fence),
// and the value reported with a fence is the ID of the worker that was
// granted that term (the value it campaigned with).
func (c *checker) checkObservers() {
	if c.in.Leader == "" {
		return
	}
	st := &ObserverStats{}
	c.rep.Observers = st
	seen := map[uint64]bool{}
	for _, h := range c.holds {
		if h.key == c.in.Leader {
			st.Terms++
		}
	}
	for _, w := range c.in.Workers {
		var last uint64
		for _, e := range w.Events {
			if e.Ev != "obs" {
				continue
			}
			st.Reports++
			if e.F == 0 {
				continue
			}
			if e.F < last {
				c.violate(vObserved, "%s: %s reported fence %d after fence %d", e.K, w.ID, e.F, last)
			}
			last = e.F
			if h := c.byKF[kf(e.K, e.F)]; h != nil {
				if !seen[e.F] {
					seen[e.F] = true
					st.Seen++
				}
				if name, _, _ := strings.Cut(e.Val, " "); h.worker != name {
					c.violate(vObserved, "%s: %s reported fence %d with value %q; that term is %s's", e.K, w.ID, e.F, e.Val, h.worker)
				}
			}
		}
	}
	for _, f := range c.in.Faults {
		if f.Kind != FaultKill || f.Key != c.in.Leader {
			continue
		}
		var next *hold
		for _, h := range c.holds {
			if h.key == f.Key && h.fence > f.Fence && (next == nil || h.fence < next.fence) {
				next = h
			}
		}
		if next == nil {
			continue
		}
		st.Failover.add(float64(next.acqOK-f.Start) / 1e6)
		first := int64(0)
		for _, w := range c.in.Workers {
			for _, e := range w.Events {
				if e.Ev == "obs" && e.F == next.fence && (first == 0 || e.T < first) {
					first = e.T
				}
			}
		}
		if first > 0 {
			st.Observed.add(float64(first-f.Start) / 1e6)
		}
	}
	st.Failover.finish()
	st.Observed.finish()
	if st.Reports == 0 && !c.in.Control {
		c.inconclusive("election key %s: no observer reported anything", c.in.Leader)
	}
}

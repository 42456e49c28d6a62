package torture

import (
	"cmp"
	"encoding/hex"
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/dlock-dev/dlock"
)

// The checker reads three records that share one clock domain or one order:
//
//   - the store's lease history (Adapter.History): every grant, extension and
//     release in the store's apply order, with the store's own clock;
//   - the resource log: every access the resource decided on, in commit order
//     per key, with the server's clock;
//   - the workers' event files, with the system-wide monotonic clock.
//
// Store and resource times are wall-clock instants of this host; they are
// converted to the monotonic clock with the offset the harness sampled
// through the run (a step of the wall clock makes those comparisons
// inconclusive, and says so).

// Violation kinds. The resource kinds are what the positive control must
// produce; every other kind is a bug whatever the mode.
const (
	// Store (lease history).
	vGrantWhileHeld  = "store: key granted while its lease was live"
	vFenceNotUp      = "store: fence not increasing"
	vRevived         = "store: expired lease extended"
	vTokenSwap       = "store: owner token changed without a new fence"
	vUnknownFence    = "client: holds a fence the store never granted"
	vFenceTwice      = "client: one fence handed to two acquisitions"
	vLateNotice      = "notification: holder told of the loss after the store's expiry"
	vNoNotice        = "notification: holder kept the lock past the store's expiry untold"
	vLiveness        = "liveness: free key not taken by a waiter in time"
	vErrNilAfterEnd  = "client: Err() nil after the store ended the lease"
	vPanicKept       = "client: lock kept after a panic in Do"
	vObsPanicKept    = "client: lock kept after a panic in an Observer"
	vResourceBadLog  = "resource: log inconsistent"
	vStaleAccepted   = "resource: stale token accepted after a newer holder's access"
	vLostUpdate      = "resource: lost update (write based on a value since overwritten)"
	vInterleaved     = "resource: holders' accepted accesses interleaved"
	vFreshRejected   = "resource: token refused although no newer token existed"
	vLateReturn      = "client: call returned long after its caller's deadline"
	maxListedViolate = 50
)

// resourceKinds are the violations a missing fence check produces.
var resourceKinds = map[string]bool{vStaleAccepted: true, vLostUpdate: true, vInterleaved: true, vNotLinearizable: true}

// workerLog is one worker process's record.
type workerLog struct {
	ID     string
	Pid    int
	Events []Event
	Killed int64 // Mono() of the harness's SIGKILL, or 0
}

// pool is the store pool size the worker recorded at its start (0: the
// adapter's default).
func (w *workerLog) pool() int {
	for _, e := range w.Events {
		if e.Ev == "start" {
			return e.Pool
		}
	}
	return 0
}

type checkInput struct {
	Name      string
	Strategy  string
	TTL       time.Duration
	NoFencing bool
	Control   bool
	// SessionHeld: locks end with the holder's server session (no TTL
	// takeover target).
	SessionHeld bool
	// PauseStallsStore: any worker's pause stalls the store (Adapter).
	PauseStallsStore bool
	Known            map[string][]string // fault kind → violation kinds known under it
	Started          int64               // Mono()
	Ended            int64
	Workers          []*workerLog
	HasHistory       bool
	// NoHistory, if set, says why the run reads no store history by
	// design: the checks that need it are then reported as not checked
	// rather than inconclusive.
	NoHistory string
	History   []LeaseEvent
	ResLog    []logRow
	Faults    []FaultRecord
	Offset    int64 // wall minus mono, ns
	// StoreClock maps the store's instants when its server runs on a clock
	// of its own (nil: this host's wall clock, by Offset).
	StoreClock *clockMap
	OffsetSkew int64 // spread of the offset samples, ns
	Problems   []string
	KnownRaces int // the workers' race reports that are knownRaces
	// ModeKeys are the run's keys taken in other modes (workerConfig).
	ModeKeys map[string]int
	// Leader is the run's key taken through an Election (workerConfig).
	Leader string
}

// hold is one acquisition as a worker saw it.
type hold struct {
	worker    string
	key       string
	fence     uint64
	mode      string // accessExclusive, accessShared, accessLimited
	limit     int    // of a limited hold
	acqStart  int64
	acqOK     int64
	doneAt    int64 // Done closed
	lost      bool  // ... because the lock was lost
	doneByRel bool  // ... because its holder released it (Err: ErrNotHeld)
	relStart  int64
	relEnd    int64
	relErr    string
	relCf     string // the release's client fault
	deathAt   int64  // the worker was killed during the hold
	lastChk   int64  // the last instant at or after which Err was nil before an access
	client    string // the client faults of the hold: its acquisition's, its release's, the worker's pool
	lease     *lease
	hitBy     *FaultRecord // the holder fault aimed at this hold
	pausedBy  *FaultRecord // a stop overlapping the hold
	restarted *FaultRecord // a server restart overlapping the hold
}

// faultKind is the kind of the fault a hold's outcome is attributed to: the
// holder fault aimed at it, else a server restart during it, else "none".
func (h *hold) faultKind() string {
	switch {
	case h.hitBy != nil:
		return h.hitBy.Kind
	case h.restarted != nil:
		return h.restarted.Kind
	}
	return "none"
}

// faults names the hold's fault (faultKind) and its client faults, if any,
// for a violation's description.
func (h *hold) faults() string {
	if h.client == "" {
		return h.faultKind()
	}
	return h.faultKind() + ", client " + h.client
}

// addClient adds a client fault kind to the hold's.
func (h *hold) addClient(kind string) {
	if kind == "" || strings.Contains("+"+h.client+"+", "+"+kind+"+") {
		return
	}
	if h.client != "" {
		h.client += "+"
	}
	h.client += kind
}

// end is when the worker stopped believing it held the lock (0: never
// recorded, i.e. the worker died holding it).
func (h *hold) end() int64 {
	e := int64(0)
	for _, t := range []int64{h.doneAt, h.relStart, h.deathAt} {
		if t > 0 && (e == 0 || t < e) {
			e = t
		}
	}
	return e
}

// lease is one lease as the store granted it.
type lease struct {
	key     string
	fence   uint64
	token   [16]byte
	grantUs int64
	expUs   int64 // the last expiry the store set (the planned end)
	relUs   int64 // when released, or 0
	lostUs  int64 // when the store forgot it with a killed server (relUs too), or 0
	open    bool  // the store does not record the end (session locks)
	nextUs  int64 // the next grant of the key (for open leases, the next one a worker got), or 0
	pid     int   // the worker process that wrote the grant, if the store says (LeaseEvent.Pid)
	hold    *hold
}

// endUs is when the store let the key go, or for an open lease the latest
// it can have: the next grant (MaxInt64 if none).
func (l *lease) endUs() int64 {
	switch {
	case l.open && l.nextUs > 0:
		return l.nextUs
	case l.open:
		return 1<<63 - 1
	case l.relUs > 0:
		return l.relUs
	}
	return l.expUs
}

type checker struct {
	in     checkInput
	rep    *RunReport
	holds  []*hold
	byKF   map[string]*hold    // key/fence → hold
	leases map[string][]*lease // key → leases in grant order
	byLF   map[string]*lease   // key/fence → lease
	slow   map[string][]span   // worker → its slow backend calls
	tokens map[[16]byte]wait   // token of a slow or failed acquisition's request → its call
	failed map[string][]wait   // key → acquisitions that ended in an error
	// cutAcq: key → acquisitions that their caller's deadline ended
	// (the acqdeadline client fault), which may have been granted in the
	// store without any record before their clean-up undid it.
	cutAcq  map[string][]wait
	pool    map[string]int // worker → its store pool's size, if smallpool set it
	clockOK bool
	// The mode keys' holds and resource rows (splitModes).
	modeHolds []*hold
	modeLog   []logRow
}

// wait is an acquisition call of a worker from t0 to t: one that ended in
// an error, or (in checker.tokens) one that was slow or failed.
type wait struct {
	worker string
	t0, t  int64
}

// span is a call's start and end, Mono() ns.
type span struct{ t0, t int64 }

func kf(k string, f uint64) string { return k + "/" + fmt.Sprint(f) }

// mono converts a store instant (Unix µs) to Mono() ns.
func (c *checker) mono(us int64) int64 {
	if c.in.StoreClock != nil {
		return c.in.StoreClock.mono(us)
	}
	return us*1000 - c.in.Offset
}

// resMono converts a resource instant (Unix µs, this host's clock) to Mono() ns.
func (c *checker) resMono(us int64) int64 { return us*1000 - c.in.Offset }

// violateUnder records a violation of hold h, as a known limitation if the
// strategy declares it one under a fault that hit h (the holder fault aimed
// at it, or a server restart during it).
func (c *checker) violateUnder(h *hold, kind, format string, args ...any) {
	for _, f := range []*FaultRecord{h.hitBy, h.restarted} {
		if f == nil {
			continue
		}
		for _, k := range c.in.Known[f.Kind] {
			if k == kind {
				if c.rep.Known == nil {
					c.rep.Known = map[string]int{}
				}
				c.rep.Known[kind+" (under "+f.Kind+")"]++
				return
			}
		}
	}
	c.violate(kind, format, args...)
}

func (c *checker) violate(kind, format string, args ...any) {
	if c.rep.Violations == nil {
		c.rep.Violations = map[string]int{}
	}
	c.rep.Violations[kind]++
	c.rep.ViolationCount++
	// Up to maxListedViolate of each class: in a positive control the
	// resource kinds are expected by the hundred and must not crowd out
	// the others, which fail it.
	listed := 0
	for _, v := range c.rep.ViolationList {
		if resourceKinds[violationKind(v)] == resourceKinds[kind] {
			listed++
		}
	}
	if listed < maxListedViolate {
		c.rep.ViolationList = append(c.rep.ViolationList, kind+": "+fmt.Sprintf(format, args...))
	}
}

// violationKind is the kind of a ViolationList entry.
func violationKind(entry string) string {
	for k := range resourceKinds {
		if strings.HasPrefix(entry, k+": ") {
			return k
		}
	}
	return ""
}

func (c *checker) inconclusive(format string, args ...any) {
	c.rep.Inconclusive = append(c.rep.Inconclusive, fmt.Sprintf(format, args...))
}

func (c *checker) fault(kind string) *FaultStats {
	for _, f := range c.rep.Faults {
		if f.Kind == kind {
			return f
		}
	}
	f := &FaultStats{Kind: kind}
	c.rep.Faults = append(c.rep.Faults, f)
	return f
}

// check analyses one run.
func check(in checkInput) *RunReport {
	c := &checker{in: in, byKF: map[string]*hold{}, leases: map[string][]*lease{}, byLF: map[string]*lease{}, slow: map[string][]span{}, tokens: map[[16]byte]wait{}, failed: map[string][]wait{}, cutAcq: map[string][]wait{}, pool: map[string]int{}}
	c.rep = &RunReport{
		Name: in.Name, Strategy: in.Strategy, Fencing: !in.NoFencing, Control: in.Control,
		DurationS: float64(in.Ended-in.Started) / 1e9, Workers: len(in.Workers), TTLms: in.TTL.Milliseconds(),
		Problems: in.Problems, KnownRaces: in.KnownRaces,
	}
	if in.StoreClock != nil {
		c.rep.StoreClock = in.StoreClock.String()
		c.rep.StoreClockErrMs = float64(in.StoreClock.errorNs()) / 1e6
	}
	c.clockOK = in.OffsetSkew <= int64(2*time.Millisecond)
	if !c.clockOK {
		c.inconclusive("the wall clock stepped by %s during the run: store-time vs worker-time checks (notification, staleness) are not conclusive", time.Duration(in.OffsetSkew))
	}
	c.buildHolds()
	c.splitModes()
	c.buildLeases()
	c.matchHoldsLeases()
	c.attributeFaults()
	c.checkResource()
	c.checkModes()
	c.checkObservers()
	c.checkLinearizable()
	c.checkNotification()
	c.checkErrBeforeAccess()
	c.faultFigures()
	c.liveness()
	c.rep.verdict()
	return c.rep
}

// buildHolds turns the workers' events into holds.
func (c *checker) buildHolds() {
	for _, w := range c.in.Workers {
		open := map[string]*hold{}
		pool := w.pool()
		if pool > 0 {
			c.client(ClientSmallPool).Injected++
			c.pool[w.ID] = pool
		}
		for _, e := range w.Events {
			switch e.Ev {
			case "acq":
				h := &hold{worker: w.ID, key: e.K, fence: e.F, mode: accessExclusive, limit: e.N, acqStart: e.T0, acqOK: e.T}
				if e.M != "" {
					h.mode = e.M
				}
				h.addClient(e.Cf)
				if pool > 0 {
					h.addClient(ClientSmallPool)
				}
				c.clientCall(w.ID, e, false)
				c.rep.Acquisitions++
				if prev := c.byKF[kf(e.K, e.F)]; prev != nil {
					c.violate(vFenceTwice, "%s fence %d: %s and %s", e.K, e.F, prev.worker, w.ID)
				} else {
					c.byKF[kf(e.K, e.F)] = h
				}
				open[kf(e.K, e.F)] = h
				c.holds = append(c.holds, h)
			case "acqerr":
				if e.Cf != "" {
					c.clientCall(w.ID, e, true)
					if e.Cf == ClientAcqDeadline && !strings.Contains(e.Err, " is held") {
						c.cutAcq[e.K] = append(c.cutAcq[e.K], wait{w.ID, e.T0, e.T})
					}
					break
				}
				c.rep.AcquireErrors++
				c.failed[e.K] = append(c.failed[e.K], wait{w.ID, e.T0, e.T})
			case "skip":
				c.rep.SkippedWrites++
			case "dofree":
				cf := cmp.Or(e.Cf, ClientDoPanic)
				cs := c.client(cf)
				if cf == ClientObsPanic {
					cs.Injected++
				}
				if e.Err != "" {
					cs.Failed++
					v := vPanicKept
					if cf == ClientObsPanic {
						v = vObsPanicKept
					}
					c.violate(v, "%s fence %d (%s): %s after the panic at %s", e.K, e.F, w.ID,
						time.Duration(e.T-e.T0).Round(time.Millisecond), c.rel(e.T0))
				} else {
					cs.Freed.add(float64(e.T-e.T0) / 1e6)
				}
			case "slow", "acqfail":
				if e.Ev == "slow" {
					c.slow[w.ID] = append(c.slow[w.ID], span{e.T0, e.T})
				}
				var tok [16]byte
				if b, err := hex.DecodeString(e.Tok); err == nil && len(b) == len(tok) {
					copy(tok[:], b)
					c.tokens[tok] = wait{w.ID, e.T0, e.T}
				}
			case "done":
				if h := open[kf(e.K, e.F)]; h != nil {
					h.doneAt, h.lost = e.T, e.OK
					h.doneByRel = !e.OK && e.Err == dlock.ErrNotHeld.Error()
				}
			case "rel":
				if h := open[kf(e.K, e.F)]; h != nil {
					h.relStart, h.relEnd, h.relErr, h.relCf = e.T0, e.T, e.Err, e.Cf
					h.addClient(e.Cf)
				}
				if e.Cf == ClientDoPanic {
					c.client(ClientDoPanic).Injected++
				} else if e.Cf != "" && e.Cf != ClientObsPanic {
					c.clientCall(w.ID, e, e.Err != "")
				}
			case "op":
				if e.Chk > 0 {
					c.rep.CheckedAccesses++
					if h := open[kf(e.K, e.F)]; h != nil {
						h.lastChk = max(h.lastChk, e.Chk)
					}
				}
				switch {
				case e.Err != "":
					c.rep.OpsFailed++
				case e.OK:
					c.rep.OpsAccepted++
				default:
					c.rep.OpsRejected++
				}
			}
		}
		if w.Killed > 0 {
			for _, h := range open {
				if h.acqOK <= w.Killed && (h.end() == 0 || h.end() > w.Killed) {
					h.deathAt = w.Killed
				}
			}
		}
	}
	sort.Slice(c.holds, func(i, j int) bool { return c.holds[i].acqOK < c.holds[j].acqOK })
}

// buildLeases replays the store's history per key and checks that the store
// kept its own rules, judged by the store's own clock and order.
func (c *checker) buildLeases() {
	if !c.in.HasHistory {
		if c.in.NoHistory != "" {
			c.rep.NotChecked = append(c.rep.NotChecked, "store-side exclusion and liveness (lead times estimated): "+c.in.NoHistory)
			return
		}
		c.inconclusive("no store history for %s: store-side exclusion not checked, lead times estimated", c.in.Strategy)
		return
	}
	cur := map[string]*lease{}
	for _, e := range c.in.History {
		l := cur[e.Key]
		if l == nil || e.Fence != l.fence {
			if l != nil {
				l.nextUs = e.AtUs
				if e.Fence <= l.fence {
					c.violate(vFenceNotUp, "%s: fence %d after %d (seq %d)", e.Key, e.Fence, l.fence, e.Seq)
				}
				if !l.open && l.relUs == 0 && l.expUs > e.AtUs {
					c.violate(vGrantWhileHeld, "%s: fence %d granted at %d µs, fence %d live until %d µs (seq %d)",
						e.Key, e.Fence, e.AtUs, l.fence, l.expUs, e.Seq)
				}
			}
			l = &lease{key: e.Key, fence: e.Fence, token: e.Token, grantUs: e.AtUs, expUs: e.ExpUs, open: e.Open, pid: e.Pid}
			if e.Release {
				l.relUs = e.AtUs
			}
			cur[e.Key] = l
			c.leases[e.Key] = append(c.leases[e.Key], l)
			c.byLF[kf(e.Key, e.Fence)] = l
			continue
		}
		if e.Token != l.token && !(e.Release && e.Token == [16]byte{}) { // a release clears the token
			c.violate(vTokenSwap, "%s fence %d (seq %d)", e.Key, e.Fence, e.Seq)
		}
		if l.relUs > 0 || l.expUs <= e.AtUs {
			c.violate(vRevived, "%s fence %d changed at %d µs after its end (seq %d)", e.Key, e.Fence, e.AtUs, e.Seq)
		}
		if e.Release {
			l.relUs = e.AtUs
			if e.Lost {
				l.lostUs = e.AtUs
			}
		} else {
			l.expUs = e.ExpUs
		}
	}
	for _, ls := range c.leases {
		c.rep.Grants += len(ls)
		c.rep.Handoffs += len(ls) - 1
	}
}

// matchHoldsLeases ties each client acquisition to the store's grant.
func (c *checker) matchHoldsLeases() {
	if !c.in.HasHistory {
		// The workers' acquisitions alone, in the order they were told
		// (c.holds is sorted by it).
		last := map[string]*hold{}
		for _, h := range c.holds {
			if p := last[h.key]; p != nil {
				c.rep.Handoffs++
				if p.worker != h.worker {
					c.rep.CrossHandoffs++
				}
			}
			last[h.key] = h
		}
		return
	}
	for _, h := range c.holds {
		l := c.byLF[kf(h.key, h.fence)]
		if l == nil {
			c.violate(vUnknownFence, "%s fence %d held by %s", h.key, h.fence, h.worker)
			continue
		}
		h.lease, l.hold = l, h
	}
	for _, ls := range c.leases {
		// A session lock's end is bounded by the next grant that a worker
		// was told of. A fence no worker got may have been written by an
		// acquisition that then failed without the lock (mysql-rowlock
		// writes the fence on another connection and fails if the row was
		// not held across that write; a grant whose session the server
		// had already ended): it bounds nothing. The next told grant is
		// later than any real grant before it, so the bound stays certain.
		next := int64(0)
		for i := len(ls) - 1; i >= 0; i-- {
			if ls[i].open {
				ls[i].nextUs = next
			}
			if ls[i].hold != nil {
				next = ls[i].grantUs
			}
		}
		for i, l := range ls {
			if l.hold == nil {
				c.rep.UnconfirmedGrants++
			}
			if i > 0 && l.hold != nil && ls[i-1].hold != nil && l.hold.worker != ls[i-1].hold.worker {
				c.rep.CrossHandoffs++
			}
		}
	}
}

// serverFault reports whether a fault kind hits the store's server, and so
// every client, rather than one holder.
func serverFault(kind string) bool { return kind == FaultDBRestart || kind == FaultFailover }

// attributeFaults marks the holds each fault hit, the mode keys' too.
func (c *checker) attributeFaults() {
	all := append(slices.Clone(c.holds), c.modeHolds...)
	byWorker := map[string][]*hold{}
	for _, h := range all {
		byWorker[h.worker] = append(byWorker[h.worker], h)
	}
	for i := range c.in.Faults {
		f := &c.in.Faults[i]
		switch f.Kind {
		case FaultDBRestart, FaultFailover:
			for _, h := range all {
				if e := h.end(); h.acqOK <= f.End && (e == 0 || e >= f.Start) {
					h.restarted = f
				}
			}
		case FaultKill, FaultStop, FaultBlackhole, FaultCut, FaultLatency, FaultPartition:
			for _, h := range byWorker[f.Worker] {
				e := h.end()
				if f.Kind == FaultStop && h.acqStart <= f.End && (e == 0 || e >= f.Start) {
					h.pausedBy = f
				}
				if h.acqOK <= f.Start && (e == 0 || e >= f.Start) {
					h.hitBy = f
				}
			}
		}
	}
}

// checkResource replays the resource log per key in commit order.
func (c *checker) checkResource() {
	type state struct {
		seen     uint64
		value    int64
		current  string          // worker/fence of the last accepted access
		finished map[string]bool // holders superseded by a later one
		fenceOf  map[uint64]string
	}
	st := map[string]*state{}
	for _, r := range c.in.ResLog {
		s := st[r.Key]
		if s == nil {
			s = &state{finished: map[string]bool{}, fenceOf: map[uint64]string{}}
			st[r.Key] = s
		}
		if r.Seen != s.seen || r.CurVal != s.value {
			c.violate(vResourceBadLog, "%s id %d: log says seen %d value %d, replay has %d and %d", r.Key, r.ID, r.Seen, r.CurVal, s.seen, s.value)
			s.seen, s.value = r.Seen, r.CurVal
		}
		if w, ok := s.fenceOf[r.Fence]; ok && w != r.Worker {
			c.violate(vFenceTwice, "%s fence %d used by %s and %s at the resource", r.Key, r.Fence, w, r.Worker)
		}
		s.fenceOf[r.Fence] = r.Worker
		// Stale: the store had ended this lease when the resource saw it.
		stale := false
		if l := c.byLF[kf(r.Key, r.Fence)]; l != nil && c.clockOK && l.endUs() < 1<<63-1 && c.resMono(r.AtUs) > c.mono(l.endUs()) {
			stale = true
		}
		h := c.byKF[kf(r.Key, r.Fence)]
		var fs *FaultStats
		if stale && h != nil && h.hitBy != nil {
			fs = c.fault(h.hitBy.Kind)
		}
		if !r.Accepted {
			if r.Fence >= s.seen {
				c.violate(vFreshRejected, "%s id %d fence %d, seen %d", r.Key, r.ID, r.Fence, s.seen)
			}
			if stale {
				c.rep.StaleOps++
				c.rep.StaleRejected++
				if fs != nil {
					fs.StaleOps++
					fs.StaleRejected++
				}
			}
			continue
		}
		holder := r.Worker + "/" + fmt.Sprint(r.Fence)
		if r.Fence < s.seen {
			c.violate(vStaleAccepted, "%s id %d: %s presented fence %d after fence %d was seen", r.Key, r.ID, r.Worker, r.Fence, s.seen)
		} else if stale {
			// The store had moved on, but no newer holder had reached the
			// resource yet: the access is ordered before the newer holder's
			// and fencing cannot refuse it.
			c.rep.StaleOps++
			c.rep.StaleBeforeNewer++
			if fs != nil {
				fs.StaleOps++
				fs.StaleBeforeNewer++
			}
		}
		if holder != s.current {
			if s.finished[holder] {
				c.violate(vInterleaved, "%s id %d: %s accessed again after %s", r.Key, r.ID, holder, s.current)
			}
			if s.current != "" {
				s.finished[s.current] = true
			}
			s.current = holder
		}
		if r.Op == "w" && r.ReadVal != s.value {
			c.violate(vLostUpdate, "%s id %d: %s wrote %d+1 over %d", r.Key, r.ID, holder, r.ReadVal, s.value)
		}
		s.seen = max(s.seen, r.Fence)
		s.value = r.NewVal
	}
}

// checkNotification checks that every holder that could run learnt of the
// loss of its lease before the store let the lease go.
func (c *checker) checkNotification() {
	for _, h := range c.holds {
		if h.deathAt > 0 && (h.end() == h.deathAt) {
			continue // died holding it: nobody to tell
		}
		if !c.in.HasHistory || h.lease == nil {
			if h.lost {
				if next := c.nextHold(h); next != nil {
					c.addLead(h, float64(next.acqOK-h.doneAt)/1e6, true)
				} else {
					c.rep.LeadUnknown++
				}
			}
			continue
		}
		if !c.clockOK {
			continue
		}
		l := h.lease
		if l.lostUs > 0 && h.pausedBy == nil {
			// The server forgot the lease when it was killed: no holder can
			// be told before that. The figure is how soon it stopped
			// believing it held the lock; fencing covers the gap.
			kind := FaultDBRestart
			if h.restarted != nil {
				kind = h.restarted.Kind
			}
			c.fault(kind).LossNotice.add(float64(h.end()-c.mono(l.lostUs)) / 1e6)
			continue
		}
		// The store's end of the lease: its expiry, or for a session lock
		// the next grant (an upper bound, so a negative lead is still
		// certain).
		expiry, estimated := c.mono(l.expUs), false
		if l.lostUs > 0 {
			expiry = c.mono(l.lostUs) // a paused holder's lease the server forgot
		}
		if l.open {
			if l.nextUs == 0 {
				if h.lost {
					c.rep.LeadUnknown++
				}
				continue
			}
			expiry, estimated = c.mono(l.nextUs), true
		}
		if h.lost {
			c.addLead(h, float64(expiry-h.doneAt)/1e6, estimated)
			continue
		}
		// Kept to the end: it must have stopped believing it held the lock
		// (release or close) before the store's expiry, unless it released it
		// at the store first.
		if !l.open && l.relUs > 0 {
			continue
		}
		slack := int64(0)
		if c.in.StoreClock != nil {
			slack = c.in.StoreClock.errorNs()
		}
		if e := h.end(); e == 0 || e > expiry+slack {
			if h.pausedBy != nil {
				continue
			}
			c.violateUnder(h, vNoNotice, "%s fence %d (%s, fault %s): store expiry at %s, holder until %s", h.key, h.fence, h.worker,
				h.faults(), c.rel(expiry), c.rel(e))
		}
	}
}

// addLead records a loss-notification lead time (store expiry minus the
// holder's notification).
func (c *checker) addLead(h *hold, leadMs float64, estimated bool) {
	if h.pausedBy != nil {
		// A stopped process cannot be told anything: its lead is negative by
		// the length of the pause, and fencing must cover it.
		fs := c.fault(FaultStop)
		fs.PausedLate.add(-leadMs)
		return
	}
	kind := h.faultKind()
	c.fault(kind).Lead.add(leadMs)
	c.rep.Lead.add(leadMs)
	if estimated {
		// Measured against an upper bound of the store's end: the true lead
		// is smaller, so a negative estimate is a certain violation.
		c.rep.LeadEstimated++
	}
	if leadMs < 0 && c.in.StoreClock != nil && -leadMs*1e6 <= float64(c.in.StoreClock.errorNs()) {
		c.rep.LeadInClockError++ // the two instants' order is not known
		return
	}
	if leadMs < 0 {
		c.violateUnder(h, vLateNotice, "%s fence %d (%s, fault %s): told %.1f ms after the store's expiry", h.key, h.fence, h.worker, h.faults(), -leadMs)
	}
}

// client returns the figures of a client fault kind.
func (c *checker) client(kind string) *ClientFaultStats {
	for _, f := range c.rep.ClientFaults {
		if f.Kind == kind {
			return f
		}
	}
	f := &ClientFaultStats{Kind: kind}
	c.rep.ClientFaults = append(c.rep.ClientFaults, f)
	return f
}

// lateBound is how long after its caller's deadline a call of a worker may
// return (the time the worker was stopped by a fault left out) before it
// is a violation: every blocking call returns promptly when its context
// ends, whatever the store does, and the bound leaves room for a loaded
// machine, not for a statement that runs to its own bound.
const lateBound = 5 * time.Second

// clientCall counts a call of worker made with a deadline fault (e.Cf,
// e.Dl): failed if it returned an error, and how long after the deadline it
// returned, which must stay within lateBound.
func (c *checker) clientCall(worker string, e Event, failed bool) {
	if e.Cf == "" || e.Cf == ClientDoPanic || e.Cf == ClientObsPanic {
		return
	}
	cs := c.client(e.Cf)
	cs.Injected++
	if failed {
		cs.Failed++
	}
	if e.Dl <= 0 {
		return
	}
	late := max(e.T-e.Dl, 0)
	cs.Late.add(float64(late) / 1e6)
	if paused := c.stoppedDuring(worker, e.Dl, e.T); time.Duration(late-paused) > lateBound {
		c.violate(vLateReturn, "%s %s (%s, fault %s): returned %s after its caller's deadline at %s",
			e.Ev, e.K, worker, e.Cf, time.Duration(late).Round(time.Millisecond), c.rel(e.Dl))
	}
}

// stoppedDuring is how long of [from, to] worker was stopped by a fault.
func (c *checker) stoppedDuring(worker string, from, to int64) int64 {
	var d int64
	for _, f := range c.in.Faults {
		if f.Kind == FaultStop && f.Worker == worker {
			d += max(min(to, f.End)-max(from, f.Start), 0)
		}
	}
	return d
}

// checkErrBeforeAccess checks the workers' checks before each access: a
// Lock's Err (or Do's context) must not say "held" once the store has ended
// the lease (its expiry, or a release that was not the holder's own), nor,
// for a session lock, once the store granted the key to the next holder.
// The check's instant is a lower bound (the clock was read before asking),
// so a flagged check is certain. Leases a killed server forgot are left
// out: nobody can be told before the store itself forgets.
func (c *checker) checkErrBeforeAccess() {
	if !c.in.HasHistory || !c.clockOK {
		return
	}
	slack := int64(0)
	if c.in.StoreClock != nil {
		slack = c.in.StoreClock.errorNs()
	}
	for _, h := range c.holds {
		l := h.lease
		if h.lastChk == 0 || l == nil || l.lostUs > 0 || (l.open && l.nextUs == 0) {
			continue
		}
		end := c.mono(l.endUs())
		relStart := h.relStart
		if h.doneAt > 0 && (h.doneByRel || h.lost) && (relStart == 0 || h.doneAt < relStart) {
			// Done closed when the holder's release began (its record
			// may be missing: the holder was killed during it), or when
			// the holder was told of a loss, after which its Locker
			// releases the lease in the background.
			relStart = h.doneAt
		}
		if !l.open && l.relUs > 0 && relStart > 0 && end > relStart-int64(relLowerBound) {
			// The holder's own release, whose instant the store may record
			// early (a lower bound): every check came before the release.
			end = max(end, relStart)
		}
		if h.lastChk > end+slack {
			c.violateUnder(h, vErrNilAfterEnd, "%s fence %d (%s, fault %s): Err nil at %s, the store ended the lease at %s%s", h.key, h.fence, h.worker,
				h.faults(), c.rel(h.lastChk), c.rel(end), map[bool]string{true: " (next grant)", false: ""}[l.open])
		}
	}
}

// relLowerBound is how much earlier than its statement's instant a store may
// record a release (mysql-lease: a release that reserves nothing for a
// waiter sets the expiry up to 100 ms before its now), with a margin.
const relLowerBound = 150 * time.Millisecond

// nextHold returns the first later acquisition of h's key.
func (c *checker) nextHold(h *hold) *hold {
	var best *hold
	for _, o := range c.holds {
		if o.key == h.key && o.fence > h.fence && (best == nil || o.fence < best.fence) {
			best = o
		}
	}
	return best
}

// faultFigures computes the per-fault figures.
func (c *checker) faultFigures() {
	target := float64(c.in.TTL.Milliseconds() + 250)
	c.rep.TakeoverTargetMs = target
	for i := range c.in.Faults {
		f := &c.in.Faults[i]
		fs := c.fault(f.Kind)
		fs.Injected++
		if f.Err != "" {
			fs.Errors++
			if serverFault(f.Kind) || f.Kind == "spawn-error" {
				c.rep.Problems = append(c.rep.Problems, fmt.Sprintf("%s failed: %s", f.Kind, f.Err))
			}
		}
		if serverFault(f.Kind) {
			for _, h := range c.holds {
				if h.restarted == f {
					fs.HitHolder++
				}
			}
			fs.Downtime.add(float64(f.End-f.Start) / 1e6)
			first := int64(0)
			for _, h := range c.holds {
				if h.acqOK > f.Start && (first == 0 || h.acqOK < first) {
					first = h.acqOK
				}
			}
			if first > 0 {
				fs.Recovery.add(float64(first-f.End) / 1e6)
			} else {
				fs.RecoveryUnseen++
			}
			continue
		}
		var h *hold
		for _, o := range c.holds {
			if o.hitBy == f {
				h = o
			}
		}
		if h == nil {
			continue
		}
		fs.HitHolder++
		next := c.nextHold(h)
		if next == nil {
			fs.TakeoverUnseen++
			continue
		}
		if f.Kind == FaultStop && next.acqOK < f.End {
			c.rep.PausesTakenOver++
		}
		// A takeover is timed only if the next holder was already waiting
		// when the store let the lease go (or, when the store does not say,
		// when the fault struck): with many keys the next acquisition of an
		// idle key says nothing about the lock.
		freed := f.Start
		if l := h.lease; l != nil && !l.open && c.clockOK {
			freed = max(freed, c.mono(l.endUs()))
		}
		if next.acqStart > freed {
			fs.TakeoverNoWaiter++
			continue
		}
		ms := float64(next.acqOK-f.Start) / 1e6
		fs.Takeover.add(ms)
		if (f.Kind == FaultKill || (f.Kind == FaultStop && !c.in.SessionHeld)) && ms > target {
			fs.TargetMissed++
		}
	}
}

// liveness checks that a key the store has let go is taken again soon when
// someone is waiting for it: from each lease's end at the store to the next
// grant that a worker was told of (a backend may take and hand back a lease
// on its own), or to a grant made to a waiter that a fault cut off (it holds
// the key although no worker was told), if a worker that no fault touched
// was in Acquire for that key across that instant (a worker stuck in a backend call that began under a
// fault of its own is not waiting in the store either). A waiter never sleeps past the holder's remaining
// lease, so after an expiry the next grant should come within a round trip
// (the figure FreeWait shows it; the takeover target is 250 ms); the hard
// bound, set to flag stuck keys rather than slow machines, is TTL. After a
// release a polling waiter may be in its longest backoff (1 s): TTL + 1 s.
// A grant in between that no worker reported, whose entry belongs to a worker
// that a fault touched (a queued waiter that could not take its turn), held
// the key as that worker's lease would have: it holds the queue up until the
// store ends it, as a faulted holder does, and the wait counts from its end.
// A session strategy's server hands a released key to the first waiter in
// its queue: a waiter whose process a fault stopped or cut off may hold it,
// unrecorded, until the fault ends plus a TTL (its session's idle timeout),
// and the wait counts from then.
// An acquisition that its caller's deadline cut off while the key was free
// may have been granted in the store and held the key, unrecorded, until its
// clean-up: the wait counts from when its caller gave up, with the release
// bound (a waiter that polls may have looked just before).
// Also records how long acquisitions wait in all (a fairness figure: polling
// waiters barge).
func (c *checker) liveness() {
	boundRel, boundExp := c.in.TTL+time.Second, c.in.TTL
	c.rep.LivenessBoundMs = boundRel.Milliseconds()
	for _, h := range c.holds {
		c.rep.AcquireWait.add(float64(h.acqOK-h.acqStart) / 1e6)
	}
	if !c.in.HasHistory || !c.clockOK {
		if c.in.HasHistory || c.in.NoHistory == "" || !c.clockOK {
			c.inconclusive("liveness (free key with waiters) not checked: no store history or clock stepped")
		}
		return
	}
	// faultedAt: a fault touched the worker within [a, b] or a TTL before;
	// or the worker was inside a slow backend call across [a, b] that began
	// while a fault touched it (a call started under a partition or a cut
	// can run on for seconds in the client's retries and TCP's
	// retransmission backoff after the fault ends, and the waiter is not
	// waiting in the store meanwhile).
	inFault := func(worker string, a, b int64) bool {
		for _, f := range c.in.Faults {
			anyone := serverFault(f.Kind) || (f.Kind == FaultStop && c.in.PauseStallsStore)
			if (f.Worker == worker || anyone) && f.Start <= b && f.End+int64(c.in.TTL) >= a {
				return true
			}
		}
		return false
	}
	faultedAt := func(worker string, a, b int64) bool {
		if inFault(worker, a, b) {
			return true
		}
		for _, s := range c.slow[worker] {
			if s.t0 <= b && s.t >= a && inFault(worker, s.t0, s.t0) {
				return true
			}
		}
		return false
	}
	byKey := map[string][]*hold{}
	for _, h := range c.holds {
		byKey[h.key] = append(byKey[h.key], h)
	}
	workerOf := map[int]string{}
	for _, w := range c.in.Workers {
		if w.Pid != 0 {
			workerOf[w.Pid] = w.ID
		}
	}
	// cutOff: a grant no worker was told of went to a worker that a fault
	// cut off while it waited (its slow or failed call's token names it),
	// or before the grant's reply reached it (a fault from the grant to the
	// end of that call): the key was taken then, and stays taken until the
	// store ends that grant (a session's idle timeout, a lease's TTL).
	cutOff := func(l *lease) bool {
		call, ok := c.tokens[l.token]
		g := c.mono(l.grantUs)
		return ok && faultedAt(call.worker, g, max(g, call.t))
	}
	for k, ls := range c.leases {
		for i := range ls {
			if ls[i].hold == nil {
				continue // handed back by the backend itself, or a cut-off waiter's
			}
			var next *lease
			var between []*lease // grants no worker reported, before next
			for _, n := range ls[i+1:] {
				if n.hold != nil || cutOff(n) {
					next = n
					break
				}
				between = append(between, n)
			}
			end, released := c.mono(ls[i].endUs()), ls[i].relUs > 0
			if ls[i].open {
				// The session lock ended at the latest when its holder's
				// release returned, or if that release failed by its
				// caller's deadline, a TTL after it began (the library's
				// contract: the lease then ends by its TTL); other ends
				// (death, timeouts) are unknown.
				h := ls[i].hold
				switch {
				case h.relEnd == 0 || h.lost:
					continue
				case h.relErr == "":
					end, released = h.relEnd, true
				case h.relCf == ClientRelDeadline:
					end = h.relStart + int64(c.in.TTL)
				default:
					continue
				}
			}
			for _, u := range between {
				w, ok := workerOf[u.pid]
				if uEnd := c.mono(u.endUs()); ok && !u.open && uEnd > end && faultedAt(w, c.mono(u.grantUs), uEnd) {
					end, released = uEnd, u.relUs > 0
				}
			}
			// No later grant: the key stayed free until the run ended.
			nextAt := c.in.Ended
			if next != nil {
				nextAt = c.mono(next.grantUs)
			}
			// An acquisition that its caller's deadline cut off while the
			// key was free may have been granted in the store (a session
			// lock taken before its fence was written, a lease whose grant
			// never reached its caller) and held the key, unrecorded, until
			// its clean-up undid it: the free period counts from when its
			// caller gave up, as after a release.
			cutBy := ""
			for _, a := range c.cutAcq[k] {
				if a.t > end && a.t < nextAt {
					end, released, cutBy = a.t, true, a.worker
				}
			}
			// A session strategy's server grants a released key to the
			// first waiter in its queue. A waiter whose process a fault
			// stopped or cut off then holds the key, unrecorded (it cannot
			// write its fence), until it comes back or the server ends its
			// idle session, a TTL after the grant at the latest: the free
			// period counts from then.
			if c.in.SessionHeld {
				if e := c.faultedWaitersHold(k, ls[i].hold, end, nextAt, byKey[k]); e > end {
					end, released, cutBy = e, false, ""
				}
			}
			bound := boundExp
			if released {
				bound = boundRel
			}
			var waiters []string
			for _, h := range byKey[k] {
				// Not the lease's own holder: a release instant recorded as
				// a lower bound (mysql-lease: up to 100 ms early) can come
				// before the holder's own acquisition returned.
				if next != nil && h != ls[i].hold && h.acqStart < end && h.acqOK > end && !faultedAt(h.worker, end, nextAt) {
					w := h.worker
					if n := c.pool[w]; n > 0 {
						w += fmt.Sprintf(" (pool of %d)", n)
					}
					waiters = append(waiters, w)
				}
			}
			waiting := len(waiters) > 0
			// A waiter that gave up (its Acquire ended in an error) while
			// the key was free: the key was free for longer than the bound
			// while it waited.
			var gaveUp *wait
			for j, w := range c.failed[k] {
				if w.t0 < end && min(w.t, nextAt)-end > int64(bound) && !faultedAt(w.worker, end, min(w.t, nextAt)) {
					gaveUp = &c.failed[k][j]
					break
				}
			}
			if !waiting && gaveUp == nil {
				continue
			}
			wait := time.Duration(nextAt - end)
			if waiting {
				c.rep.FreeWait.add(float64(wait) / 1e6)
				if released {
					c.rep.HandoffWait.add(float64(wait) / 1e6)
				}
			}
			how := map[bool]string{true: "released", false: "expired"}[released]
			if cutBy != "" {
				how = "released, then " + cutBy + "'s acquisition cut off by its deadline"
			}
			switch {
			case gaveUp != nil:
				c.violate(vLiveness, "%s: free from %s (fence %d %s) while %s waited until it gave up at %s (next grant %s)", k, c.rel(end), ls[i].fence,
					how, gaveUp.worker, c.rel(gaveUp.t), map[bool]string{true: c.rel(nextAt), false: "never"}[next != nil])
			case wait > bound:
				c.violate(vLiveness, "%s: free from %s (fence %d %s) to %s (fence %d) while %s waited", k, c.rel(end), ls[i].fence,
					how, c.rel(nextAt), next.fence, strings.Join(waiters, ", "))
			}
		}
	}
}

// faultedWaitersHold returns the latest instant until which a waiter for
// key whose process a fault touched while the key was free (from end to
// next) may have held it server-side, unrecorded, or 0: the end of that
// fault plus a TTL, capped at next. holder is the lease's own hold, which
// is not its own waiter.
func (c *checker) faultedWaitersHold(key string, holder *hold, end, next int64, holds []*hold) int64 {
	var waiting []string
	for _, h := range holds {
		if h != holder && h.acqStart < end && h.acqOK > end {
			waiting = append(waiting, h.worker)
		}
	}
	for _, w := range c.failed[key] {
		if w.t0 < end && w.t > end {
			waiting = append(waiting, w.worker)
		}
	}
	var until int64
	for _, w := range waiting {
		for _, f := range c.in.Faults {
			if f.Worker == w && f.Start <= next && f.End >= end {
				until = max(until, min(f.End+int64(c.in.TTL), next))
			}
		}
	}
	return until
}

// rel formats a Mono() instant relative to the run's start.
func (c *checker) rel(t int64) string {
	if t == 0 {
		return "never"
	}
	return "+" + time.Duration(t-c.in.Started).Round(time.Millisecond).String()
}

// Stats summarises durations in milliseconds.
type Stats struct {
	vals []float64
	N    int     `json:"n"`
	Min  float64 `json:"min_ms"`
	P50  float64 `json:"p50_ms"`
	P99  float64 `json:"p99_ms"`
	Max  float64 `json:"max_ms"`
}

func (s *Stats) add(v float64) { s.vals = append(s.vals, v) }

func (s *Stats) finish() {
	s.N = len(s.vals)
	if s.N == 0 {
		return
	}
	sort.Float64s(s.vals)
	q := func(p float64) float64 { return s.vals[min(len(s.vals)-1, int(p*float64(len(s.vals))))] }
	s.Min, s.P50, s.P99, s.Max = s.vals[0], q(0.5), q(0.99), s.vals[len(s.vals)-1]
}

// String shows p50 / p99 / max (or min / p50 for leads).
func (s *Stats) String() string {
	if s.N == 0 {
		return "–"
	}
	return fmt.Sprintf("%.0f / %.0f / %.0f (n=%d)", s.P50, s.P99, s.Max, s.N)
}

func (s *Stats) minString() string {
	if s.N == 0 {
		return "–"
	}
	return fmt.Sprintf("%.0f / %.0f (n=%d)", s.Min, s.P50, s.N)
}

// violationKinds returns the kinds present, sorted.
func violationKinds(m map[string]int) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

func summarizeViolations(m map[string]int) string {
	var parts []string
	for _, k := range violationKinds(m) {
		parts = append(parts, fmt.Sprintf("%d× %s", m[k], k))
	}
	return strings.Join(parts, "; ")
}

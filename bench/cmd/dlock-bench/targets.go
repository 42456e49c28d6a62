package main

import (
	"fmt"
	"io"
	"strings"
)

// Verdicts of a target.
const (
	met         = "met"
	missed      = "MISSED"
	notMeasured = "not measured"
)

// The project's performance targets, as the report names them.
const (
	tOverhead   = "uncontended overhead over own raw SQL/commands ≤ 10% (p50 ÷ floor p50)"
	tSession    = "contended true handoffs/s ≥ 90% of raw GET_LOCK blocking"
	tSessionPG  = "contended true handoffs/s ≥ 90% of raw pg_advisory_lock blocking"
	tRowSession = "contended true handoffs/s ≥ 90% of raw SELECT … FOR UPDATE blocking"
	tWakeUps    = "contended true handoffs/s ≥ 100× the 100 ms-polling recipe"
	tWakeUpsPG  = "contended true handoffs/s ≥ 50× the PostgreSQL 100 ms-polling recipe"
	tRedis      = "contended true handoffs/s ≥ 15× bsm/redislock, 10 ms linear retry"
	tRedsync    = "contended true handoffs/s ≥ 100× go-redsync/redsync with its defaults"
	tContended  = "contended true handoffs/s"
	tFair       = "8 contenders: smallest share ≥ 0.5 of a fair share (fair strategies)"
	tConns      = "10,000 held locks: ≤ 4 connections"
	tStatements = "10,000 held locks: renewal ≤ 100 statements per period"
	tGoroutines = "10,000 held locks: no goroutine per held lock (< 0.1 added per lock)"
)

// Target is one of the performance targets evaluated for one strategy.
type Target struct {
	Target  string `json:"target"`
	Subject string `json:"subject"`
	// Value is the measured ratio or count that the verdict compares with
	// the target's limit; absent when not measured.
	Value *float64 `json:"value,omitempty"`
	// Measured gives the figures behind Value and what they compare.
	Measured string `json:"measured,omitempty"`
	Verdict  string `json:"verdict"`
	// Reason says why a target was not measured, or qualifies a verdict
	// (fewer locks than 10,000, locks lost during the run).
	Reason string `json:"reason,omitempty"`
}

// partialFloors are floor rows that are a lower bound of a strategy's work
// rather than its own commands, so its overhead over them is not the
// target's.
var partialFloors = map[string]string{
	etcdFloor: "one put, not etcdlock's own lease grant + transaction + revoke",
	zkFloor:   "one create and one delete, not zklock's own operations",
}

// evaluateTargets judges the performance targets from the rows of one run, for
// every strategy the bench knows: a strategy or a figure the run did not
// measure is reported as not measured, with the reason.
func evaluateTargets(rows []Row) []Target {
	x := rowIndex(rows)
	var out []Target
	for _, name := range allStrategies {
		out = append(out, x.overhead(name))
	}
	contended := []struct {
		name, target, floor string
		limit               float64
		why                 string // when there is no floor
	}{
		{mysqlGetLock, tSession, rawGetLock, 0.9, ""},
		{mysqlRowLock, tRowSession, rawForUpdate, 0.9, ""},
		{pgAdvisory, tSessionPG, rawPGAdvisory, 0.9, ""},
		{mysqlLease, tWakeUps, naive, 100, ""},
		{pgLease, tWakeUpsPG, naivePG, 50, ""},
		{redisStrategy, tRedis, bsmRetry, 15, ""},
		{redisStrategy, tRedsync, redsyncDefaults, 100, ""},
		{sqliteLease, tContended, "", 0, "no contended target is set for this store and the bench has no floor for it"},
		{etcdStrategy, tContended, "", 0, "no contended target is set for this store and the bench has no floor for it"},
		{zkStrategy, tContended, "", 0, "no contended target is set for this store and the bench has no floor for it"},
	}
	for _, c := range contended {
		out = append(out, x.handoffs(c.name, c.target, c.floor, c.limit, c.why))
	}
	for _, name := range fairStrategies {
		out = append(out, x.fair(name))
	}
	for _, name := range allStrategies {
		out = append(out, x.many(name)...)
	}
	return out
}

// fairStrategies are the strategies that queue their waiters: each of 8
// contenders must get at least half of a fair share.
var fairStrategies = []string{mysqlGetLock, mysqlRowLock, mysqlLease, pgLease, pgAdvisory, etcdStrategy, zkStrategy}

// fair judges the smallest share of name's contended run.
func (x index) fair(name string) Target {
	t := Target{Target: tFair, Subject: name, Verdict: notMeasured}
	r, why := x.usable(secContended, name)
	switch {
	case why != "":
		t.Reason = why
		return t
	case r.MinShare == nil:
		t.Reason = "the run recorded no shares"
		return t
	}
	t.Measured = fmt.Sprintf("smallest share %.2f", *r.MinShare)
	return judge(t, *r.MinShare, *r.MinShare >= 0.5)
}

type index map[[2]string]Row

func rowIndex(rows []Row) index {
	x := index{}
	for _, r := range rows {
		x[[2]string{r.Section, r.Name}] = r
	}
	return x
}

func (x index) find(section, name string) (Row, bool) {
	r, ok := x[[2]string{section, name}]
	return r, ok
}

// absent says why the run has no row for name in section: its store was
// left out, or the row is simply missing.
func (x index) absent(section, name string) string {
	store := ""
	switch {
	case strings.HasPrefix(name, "dlock pg "):
		store = "PostgreSQL"
	case strings.HasPrefix(name, "dlock etcd"):
		store = "etcd"
	case strings.HasPrefix(name, "dlock zk"):
		store = "ZooKeeper"
	}
	if r, ok := x.find(secFloor, store); ok && r.Note != "" {
		return store + " " + r.Note
	}
	return fmt.Sprintf("no row %q in %q", name, section)
}

// usable returns the row for name in section, or the reason it cannot be
// judged (absent, failed, not run).
func (x index) usable(section, name string) (Row, string) {
	r, ok := x.find(section, name)
	switch {
	case !ok:
		return r, x.absent(section, name)
	case strings.HasPrefix(r.Note, "error"):
		return r, r.Note
	case section == secMany && r.Many == nil:
		return r, r.Note
	case section != secMany && r.P50us == 0 && r.OpsPerS == 0:
		return r, strings.TrimSpace("nothing measured " + r.Note)
	}
	return r, ""
}

func judge(t Target, value float64, ok bool) Target {
	t.Value = &value
	t.Verdict = missed
	if ok {
		t.Verdict = met
	}
	return t
}

func (x index) overhead(name string) Target {
	t := Target{Target: tOverhead, Subject: name, Verdict: notMeasured}
	r, why := x.usable(secUncontended, name)
	if why != "" {
		t.Reason = why
		return t
	}
	if r.Floor == "" {
		t.Reason = "no row of this strategy's own raw SQL/commands in the bench"
		return t
	}
	if p, ok := partialFloors[r.Floor]; ok {
		t.Reason = fmt.Sprintf("the only floor, %q, is %s", r.Floor, p)
		return t
	}
	f, why := x.usable(secFloor, r.Floor)
	if why != "" {
		t.Reason = fmt.Sprintf("floor %q: %s", r.Floor, why)
		return t
	}
	ratio := r.P50us / f.P50us
	t.Measured = fmt.Sprintf("p50 %s ÷ %s (%s) = %.2f×", dur(r.P50us), dur(f.P50us), r.Floor, ratio)
	return judge(t, ratio, ratio <= 1.10)
}

func (x index) handoffs(name, target, floor string, limit float64, noFloor string) Target {
	t := Target{Target: target, Subject: name, Verdict: notMeasured}
	r, why := x.usable(secContended, name)
	if why != "" {
		t.Reason = why
		return t
	}
	t.Measured = fmt.Sprintf("%.0f true handoffs/s", r.Handoffs)
	if floor == "" {
		t.Reason = noFloor
		return t
	}
	f, why := x.usable(secContended, floor)
	switch {
	case why != "":
		t.Reason = fmt.Sprintf("floor %q: %s", floor, why)
		return t
	case f.Handoffs == 0:
		t.Reason = fmt.Sprintf("floor %q measured no true handoffs", floor)
		return t
	}
	ratio := r.Handoffs / f.Handoffs
	t.Measured = fmt.Sprintf("%.0f ÷ %.0f (%s) = %.2f×", r.Handoffs, f.Handoffs, floor, ratio)
	if floor == rawGetLock {
		if ff, why := x.usable(secContended, rawGetLockFenced); why == "" && ff.Handoffs > 0 {
			t.Measured += fmt.Sprintf("; %.2f× %s", r.Handoffs/ff.Handoffs, rawGetLockFenced)
		}
	}
	return judge(t, ratio, ratio >= limit)
}

// many judges the many-locks targets for one strategy.
func (x index) many(name string) []Target {
	conns := Target{Target: tConns, Subject: name, Verdict: notMeasured}
	stmts := Target{Target: tStatements, Subject: name, Verdict: notMeasured}
	gor := Target{Target: tGoroutines, Subject: name, Verdict: notMeasured}
	r, why := x.usable(secMany, name)
	if why != "" {
		conns.Reason, stmts.Reason, gor.Reason = why, why, why
		return []Target{conns, stmts, gor}
	}
	m := r.Many
	var caveats []string
	if m.Locks != 10000 {
		caveats = append(caveats, fmt.Sprintf("%d locks held, not 10,000", m.Locks))
	}
	if m.Lost > 0 {
		caveats = append(caveats, fmt.Sprintf("%d locks lost during the run", m.Lost))
	}
	caveat := strings.Join(caveats, "; ")
	if m.Conns == nil {
		conns.Reason = "the client's pool does not report its connections"
	} else {
		conns.Measured = fmt.Sprintf("%d open", *m.Conns)
		conns = judge(conns, float64(*m.Conns), *m.Conns <= 4)
		conns.Reason = caveat
	}
	if m.PerPeriod == nil {
		stmts.Reason = "the client's statements are not counted"
	} else {
		stmts.Measured = fmt.Sprintf("%.0f %s", *m.PerPeriod, m.Unit)
		if m.TripsPerPeriod != nil {
			stmts.Measured += fmt.Sprintf(" in %.0f round trips", *m.TripsPerPeriod)
		}
		if m.ServerEvalsPerPeriod != nil {
			stmts.Measured += fmt.Sprintf(" (server: %.0f EVALSHA/EVAL)", *m.ServerEvalsPerPeriod)
		}
		stmts = judge(stmts, *m.PerPeriod, *m.PerPeriod <= 100)
		stmts.Reason = caveat
		if m.TripsPerPeriod != nil {
			stmts.Reason = strings.TrimPrefix(caveat+"; judged on "+m.Unit+", not round trips", "; ")
		}
	}
	if m.Locks > 0 {
		per := float64(m.Goroutines) / float64(m.Locks)
		gor.Measured = fmt.Sprintf("%d added for %d locks", m.Goroutines, m.Locks)
		gor = judge(gor, per, per < 0.1)
		gor.Reason = caveat
	} else {
		gor.Reason = "no locks held"
	}
	return []Target{conns, stmts, gor}
}

// reportTargets prints the targets as a Markdown section.
func reportTargets(w io.Writer, targets []Target) {
	n := map[string]int{}
	for _, t := range targets {
		n[t.Verdict]++
	}
	fmt.Fprintf(w, "\n### Targets\n\n")
	fmt.Fprintf(w, "From this run's rows: %d met, %d missed, %d not measured. Overhead compares p50 latencies; "+
		"handoffs compare true handoffs/s; renewal counts what the strategy's client sent over three renewal "+
		"periods (TTL/3 each), divided by three. A short run (small -duration, -n, -many) proves nothing.\n\n",
		n[met], n[missed], n[notMeasured])
	fmt.Fprintln(w, "| target | strategy | measured | verdict |")
	fmt.Fprintln(w, "|---|---|---|---|")
	for _, t := range targets {
		v := t.Verdict
		switch {
		case t.Reason != "" && t.Verdict == notMeasured:
			v += ": " + t.Reason
		case t.Reason != "":
			v += " (" + t.Reason + ")"
		}
		fmt.Fprintf(w, "| %s | %s | %s | %s |\n", t.Target, t.Subject, cell(t.Measured), cell(v))
	}
}

// cell makes s safe inside a Markdown table cell.
func cell(s string) string {
	return strings.NewReplacer("|", `\|`, "\n", " ").Replace(s)
}

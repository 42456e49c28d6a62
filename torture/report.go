package torture

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"slices"
	"sort"
	"strings"
	"time"
)

// Report is the outcome of one harness invocation.
type Report struct {
	Config   map[string]any `json:"config"`
	Started  time.Time      `json:"started"`
	Finished time.Time      `json:"finished"`
	Runs     []*RunReport   `json:"runs"`
	// Failed: a violation in a fencing run, a positive control that found
	// nothing, or a problem (crash, race report, failed fault).
	Failed bool `json:"failed"`
	// Inconclusive: no failure, but some check could not decide.
	Inconclusive bool `json:"inconclusive"`
}

// RunReport is one strategy in one mode.
type RunReport struct {
	Name      string  `json:"name"`
	Strategy  string  `json:"strategy"`
	Fencing   bool    `json:"fencing"`
	Control   bool    `json:"control"`
	DurationS float64 `json:"duration_s"`
	Workers   int     `json:"workers"`
	TTLms     int64   `json:"ttl_ms"`
	// StoreClock describes the store server's own clock (Config.StoreDSN).
	StoreClock      string  `json:"store_clock,omitempty"`
	StoreClockErrMs float64 `json:"store_clock_error_ms,omitempty"` // bound of a mapped instant's error

	Acquisitions      int   `json:"acquisitions"`       // confirmed to a worker
	AcquireErrors     int   `json:"acquire_errors"`     // Acquire returned an error (outage, timeout)
	Grants            int   `json:"grants"`             // by the store
	Handoffs          int   `json:"handoffs"`           // successive grants of a key
	CrossHandoffs     int   `json:"cross_handoffs"`     // ... to another worker
	UnconfirmedGrants int   `json:"unconfirmed_grants"` // granted, but no worker was told (outcome unknown, resolved)
	HandoffWait       Stats `json:"handoff_wait"`       // store release → next grant, with a waiter
	FreeWait          Stats `json:"free_wait"`          // store release or expiry → next grant, with a waiter
	AcquireWait       Stats `json:"acquire_wait"`       // Acquire call → lock, per acquisition
	OpsAccepted       int   `json:"ops_accepted"`
	OpsRejected       int   `json:"ops_rejected"`
	OpsFailed         int   `json:"ops_failed"`
	// CheckedAccesses counts accesses made after the worker saw the lock's
	// Err nil (every access but a positive control's writes);
	// SkippedWrites the writes left out because it was not.
	CheckedAccesses  int `json:"checked_accesses"`
	SkippedWrites    int `json:"skipped_writes"`
	StaleOps         int `json:"stale_ops"`          // accesses after the store ended the lease
	StaleRejected    int `json:"stale_rejected"`     // ... refused by fencing
	StaleBeforeNewer int `json:"stale_before_newer"` // ... accepted before any newer holder reached the resource
	// LinearizableOps counts the work cycles porcupine checked (see
	// linearize.go), LinearizableKeys the keys whose cycles it found
	// linearizable.
	LinearizableOps  int   `json:"linearizable_ops"`
	LinearizableKeys int   `json:"linearizable_keys"`
	Lead             Stats `json:"lead"` // loss notification lead, running holders
	LeadEstimated    int   `json:"lead_estimated"`
	// LeadInClockError counts negative leads no larger than the error of a
	// store clock mapped by samples (Config.StoreDSN): not counted as
	// violations, since the order of the two instants is not known.
	LeadInClockError int     `json:"lead_in_clock_error,omitempty"`
	LeadUnknown      int     `json:"lead_unknown"`
	TakeoverTargetMs float64 `json:"takeover_target_ms"`
	LivenessBoundMs  int64   `json:"liveness_bound_ms"`

	// Modes: the figures of the mode keys (Config.ModeKeys).
	Modes []*ModeStats `json:"modes,omitempty"`
	// Observers: the figures of the election's observers (Config.ModeKeys).
	Observers *ObserverStats `json:"observers,omitempty"`

	Faults       []*FaultStats       `json:"faults"`
	ClientFaults []*ClientFaultStats `json:"client_faults,omitempty"`

	ViolationCount int            `json:"violation_count"`
	Violations     map[string]int `json:"violations,omitempty"`
	Known          map[string]int `json:"known_limitations,omitempty"` // violations the strategy declares known
	// PausesTakenOver counts SIGSTOPs during which another worker got the
	// paused holder's key: the situation the positive control needs.
	PausesTakenOver int      `json:"pauses_taken_over"`
	ViolationList   []string `json:"violation_list,omitempty"`
	Inconclusive    []string `json:"inconclusive,omitempty"`
	// NotChecked: checks the run's configuration leaves out by design
	// (not a reason for doubt, unlike Inconclusive).
	NotChecked []string `json:"not_checked,omitempty"`
	Problems   []string `json:"problems,omitempty"`
	// KnownRaces counts the workers' data race reports that lie inside a
	// store client and are known upstream (collect.go's knownRaces): not
	// problems of the run.
	KnownRaces int `json:"known_races,omitempty"`

	// Verdict: PASS, FAIL, INCONCLUSIVE; for a control run DETECTED or
	// NOT DETECTED (a failure).
	Verdict string `json:"verdict"`
	Failed  bool   `json:"failed"`
}

// FaultStats are the figures for one fault kind in one run.
type FaultStats struct {
	Kind             string `json:"kind"`
	Injected         int    `json:"injected"`
	Errors           int    `json:"errors,omitempty"`
	HitHolder        int    `json:"hit_holder"` // the target still held its key when hit
	Takeover         Stats  `json:"takeover"`   // fault → next acquisition of the key
	TakeoverUnseen   int    `json:"takeover_unseen,omitempty"`
	TakeoverNoWaiter int    `json:"takeover_no_waiter,omitempty"` // nobody was waiting: not timed
	TargetMissed     int    `json:"target_missed,omitempty"`      // kill/stop takeovers over TTL+250ms
	Lead             Stats  `json:"lead"`                         // store expiry − notification, running holders
	PausedLate       Stats  `json:"paused_late"`                  // stopped holders: notification − store expiry
	StaleOps         int    `json:"stale_ops"`
	StaleRejected    int    `json:"stale_rejected"`
	StaleBeforeNewer int    `json:"stale_before_newer"`
	Downtime         Stats  `json:"downtime"` // dbrestart: kill → serving
	Recovery         Stats  `json:"recovery"` // dbrestart: serving → first acquisition
	RecoveryUnseen   int    `json:"recovery_unseen,omitempty"`
	// LossNotice: dbrestart of a server without persistence, which forgets
	// the leases: its kill → the holder stops believing it holds the lock.
	LossNotice Stats `json:"loss_notice"`
}

// ClientFaultStats are the figures for one client fault kind in one run.
type ClientFaultStats struct {
	Kind string `json:"kind"`
	// Injected: calls with a deadline (acqdeadline, reldeadline), panics
	// (dopanic), workers (smallpool).
	Injected int `json:"injected"`
	// Failed: calls that returned an error (for acquisitions: not
	// acquired), or locks a panicking Do kept (each also a violation).
	Failed int   `json:"failed"`
	Late   Stats `json:"late"`  // how long after the caller's deadline the call returned
	Freed  Stats `json:"freed"` // dopanic: panic → the worker's Locker no longer holds the key
}

func (r *RunReport) verdict() {
	for _, s := range []*Stats{&r.HandoffWait, &r.FreeWait, &r.AcquireWait, &r.Lead} {
		s.finish()
	}
	for _, f := range r.Faults {
		for _, s := range []*Stats{&f.Takeover, &f.Lead, &f.PausedLate, &f.Downtime, &f.Recovery, &f.LossNotice} {
			s.finish()
		}
	}
	for _, f := range r.ClientFaults {
		f.Late.finish()
		f.Freed.finish()
	}
	other := 0 // violations that are bugs whatever the mode
	for k, n := range r.Violations {
		if !resourceKinds[k] {
			other += n
		}
	}
	switch {
	case r.Control && r.ViolationCount-other > 0 && other == 0 && len(r.Problems) == 0:
		r.Verdict = "DETECTED"
	case r.Control && r.ViolationCount-other > 0:
		r.Verdict, r.Failed = "DETECTED, but FAIL", true
	case r.Control && r.PausesTakenOver == 0:
		r.Verdict, r.Failed = "NOT EXERCISED", true
		r.Inconclusive = append(r.Inconclusive, "no key changed hands while its holder was stopped, so the control could not show anything (see liveness)")
	case r.Control:
		r.Verdict, r.Failed = "NOT DETECTED", true
	case r.ViolationCount > 0 || len(r.Problems) > 0:
		r.Verdict, r.Failed = "FAIL", true
	case len(r.Inconclusive) > 0:
		r.Verdict = "INCONCLUSIVE"
	case r.Acquisitions == 0:
		r.Verdict = "INCONCLUSIVE"
		r.Inconclusive = append(r.Inconclusive, "no acquisition at all")
	default:
		r.Verdict = "PASS"
	}
}

func (rep *Report) finish() {
	for _, r := range rep.Runs {
		if r.Failed {
			rep.Failed = true
		}
		if r.Verdict == "INCONCLUSIVE" {
			rep.Inconclusive = true
		}
	}
}

// ExitCode is 0 when everything passed, 1 on a failure, 3 when no check
// failed but some were inconclusive.
func (rep *Report) ExitCode() int {
	switch {
	case rep.Failed:
		return 1
	case rep.Inconclusive:
		return 3
	}
	return 0
}

func reportConfig(c Config) map[string]any {
	return map[string]any{
		"strategies": c.Strategies, "duration": c.Duration.String(), "workers": c.Workers, "keys": c.Keys, "mode_keys": c.ModeKeys,
		"ttl": c.TTL.String(), "seed": c.Seed, "faults": c.Faults, "fault_every": c.FaultEvery.String(),
		"long_frac": c.LongFrac, "db_restart": c.DBRestart, "db_restart_every": c.DBRestartEvery.String(),
		"no_fencing": c.NoFencing, "control": c.Control.String(), "tag": c.Tag,
		"clock_skew": c.ClockSkew, "client_faults": c.ClientFaults, "lanes": c.Lanes,
	}
}

// WriteFiles writes summary.json and summary.md into dir.
func (rep *Report) WriteFiles(dir string) error {
	js, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(dir+"/summary.json", append(js, '\n'), 0o644); err != nil {
		return err
	}
	var b strings.Builder
	rep.Markdown(&b)
	return os.WriteFile(dir+"/summary.md", []byte(b.String()), 0o644)
}

// Markdown writes the summary tables.
func (rep *Report) Markdown(w io.Writer) {
	fmt.Fprintf(w, "## dlock torture: %s\n\n", map[bool]string{true: "FAILED", false: "passed"}[rep.Failed])
	fmt.Fprintln(w, "| run | fencing | s | verdict | violations | acquisitions | handoffs (cross-worker) | unconfirmed grants | ops ok / refused / failed | stale ops: refused / before newer | porcupine: cycles (keys linearizable) | lead ms min / p50 | free key → next grant ms p50/p99/max | acquire wait ms p50/p99/max |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
	for _, r := range rep.Runs {
		fmt.Fprintf(w, "| %s | %v | %.0f | **%s** | %d | %d | %d (%d) | %d | %d / %d / %d | %d / %d | %d (%d) | %s | %s | %s |\n",
			r.Name, r.Fencing, r.DurationS, r.Verdict, r.ViolationCount, r.Acquisitions, r.Handoffs, r.CrossHandoffs,
			r.UnconfirmedGrants, r.OpsAccepted, r.OpsRejected, r.OpsFailed, r.StaleRejected, r.StaleBeforeNewer,
			r.LinearizableOps, r.LinearizableKeys,
			r.Lead.minString(), r.FreeWait.String(), r.AcquireWait.String())
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Per fault (times in ms; takeover = fault → next acquisition of the holder's key by a worker already waiting when the store freed it, target for kill/stop on lease strategies ≤ TTL+250 ms; lead = store expiry − holder's notification, must be ≥ 0; paused late = notification − store expiry for stopped holders, covered by fencing):")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "| run | fault | injected | hit a holder | takeover p50/p99/max | over target | lead min / p50 | paused late p50/p99/max | stale ops refused / total | downtime p50/p99/max | recovery p50/p99/max | lease forgotten → holder stops p50/p99/max |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|---|---|---|---|")
	for _, r := range rep.Runs {
		for _, f := range r.Faults {
			fmt.Fprintf(w, "| %s | %s | %d | %d | %s | %d | %s | %s | %d / %d | %s | %s | %s |\n",
				r.Name, f.Kind, f.Injected, f.HitHolder, f.Takeover.String(), f.TargetMissed, f.Lead.minString(),
				f.PausedLate.String(), f.StaleRejected, f.StaleOps, f.Downtime.String(), f.Recovery.String(), f.LossNotice.String())
		}
	}
	client := false
	for _, r := range rep.Runs {
		client = client || len(r.ClientFaults) > 0
	}
	if client {
		fmt.Fprintln(w)
		fmt.Fprintln(w, "Client faults (injected by the workers; times in ms): failed = calls that returned an error, or locks a panicking Do kept; late = how long after the caller's deadline the call returned; freed = panic → the Locker no longer holds the key. Accesses checked = made after Err() said held; writes skipped = Err() said lost.")
		fmt.Fprintln(w)
		fmt.Fprintln(w, "| run | client fault | injected | failed | late p50/p99/max | freed p50/p99/max | accesses checked | writes skipped |")
		fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|")
		for _, r := range rep.Runs {
			for _, f := range r.ClientFaults {
				fmt.Fprintf(w, "| %s | %s | %d | %d | %s | %s | %d | %d |\n", r.Name, f.Kind, f.Injected, f.Failed,
					f.Late.String(), f.Freed.String(), r.CheckedAccesses, r.SkippedWrites)
			}
		}
	}
	modes := false
	for _, r := range rep.Runs {
		modes = modes || len(r.Modes) > 0
	}
	if modes {
		fmt.Fprintln(w)
		fmt.Fprintln(w, "Mode keys (a reader-writer key and a semaphore): acquisitions by mode; most holders told \"held\" at once; holds told \"held\" while another was; resource accesses taken / refused; semaphore spans over the limit made by an access checked before a newer grant (a pause; not fenceable); violations on the key.")
		fmt.Fprintln(w)
		fmt.Fprintln(w, "| run | key | shared / exclusive / limited | most at once | overlapping | ops ok / refused | after a pause | violations |")
		fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|")
		for _, r := range rep.Runs {
			for _, m := range r.Modes {
				key := m.Key
				if m.Limit > 0 {
					key = fmt.Sprintf("%s (limit %d)", m.Key, m.Limit)
				}
				fmt.Fprintf(w, "| %s | %s | %d / %d / %d | %d | %d | %d / %d | %d | %d |\n", r.Name, key, m.Shared, m.Exclusive, m.Limited,
					m.MaxHolders, m.Overlapping, m.OpsAccepted, m.OpsRejected, m.AfterPause, m.Violations)
			}
		}
	}
	obs := false
	for _, r := range rep.Runs {
		obs = obs || r.Observers != nil
	}
	if obs {
		fmt.Fprintln(w)
		fmt.Fprintln(w, "Election key (taken through dlock.Election, observed by every worker): observers' reports; the key's terms; the terms some observer reported; a leader's SIGKILL → the next term began, and → an observer reported it (ms).")
		fmt.Fprintln(w)
		fmt.Fprintln(w, "| run | reports | terms | terms reported | failover p50/p99/max | observed p50/p99/max |")
		fmt.Fprintln(w, "|---|---|---|---|---|---|")
		for _, r := range rep.Runs {
			if o := r.Observers; o != nil {
				fmt.Fprintf(w, "| %s | %d | %d | %d | %s | %s |\n", r.Name, o.Reports, o.Terms, o.Seen, o.Failover.String(), o.Observed.String())
			}
		}
	}
	for _, r := range rep.Runs {
		if r.StoreClock != "" {
			fmt.Fprintf(w, "\n%s: %s; %d negative leads within its error (±%.1f ms) not judged\n", r.Name, r.StoreClock, r.LeadInClockError, r.StoreClockErrMs)
		}
	}
	for _, r := range rep.Runs {
		if r.ViolationCount == 0 && len(r.Inconclusive) == 0 && len(r.Problems) == 0 && len(r.Known) == 0 && len(r.NotChecked) == 0 {
			continue
		}
		fmt.Fprintf(w, "\n### %s: %s\n", r.Name, r.Verdict)
		if len(r.Known) > 0 {
			fmt.Fprintf(w, "\nKnown limitations (not failures): %s\n", summarizeViolations(r.Known))
		}
		if r.ViolationCount > 0 {
			fmt.Fprintf(w, "\nViolations: %s\n\n", summarizeViolations(r.Violations))
			// Those that fail the run first (in a control, the resource
			// kinds are what it must find).
			list := slices.Clone(r.ViolationList)
			sort.SliceStable(list, func(i, j int) bool {
				return !resourceKinds[violationKind(list[i])] && resourceKinds[violationKind(list[j])]
			})
			for _, v := range list[:min(10, len(list))] {
				fmt.Fprintf(w, "- %s\n", v)
			}
		}
		for _, s := range r.Inconclusive {
			fmt.Fprintf(w, "- inconclusive: %s\n", s)
		}
		for _, s := range r.NotChecked {
			fmt.Fprintf(w, "- not checked: %s\n", s)
		}
		for _, s := range r.Problems {
			fmt.Fprintf(w, "- problem: %s\n", s)
		}
		if r.KnownRaces > 0 {
			fmt.Fprintf(w, "- %d data race report(s) inside the store client, known upstream (see torture/collect.go)\n", r.KnownRaces)
		}
	}
}

package torture

import (
	"strings"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
)

// The checker's own tests: synthetic records with a known flaw must be
// flagged, and clean ones must pass.

const ms = int64(time.Millisecond)

// base returns an input with two workers, one key, and a clean history:
// w1 holds k fence 1 from 100 to 600 ms (released), w2 fence 2 from 650 ms
// (released at 900 ms). Store times equal worker times (offset 0).
func base() checkInput {
	us := func(t int64) int64 { return t / 1000 }
	tok := func(b byte) [16]byte { return [16]byte{b} }
	return checkInput{
		Name: "synthetic", Strategy: "synthetic", TTL: time.Second,
		Started: 0, Ended: 10_000 * ms, HasHistory: true,
		Workers: []*workerLog{
			{ID: "w1", Events: []Event{
				{T0: 50 * ms, T: 100 * ms, Ev: "acq", K: "k", F: 1},
				{T0: 110 * ms, T: 120 * ms, Ev: "op", Op: "r", K: "k", F: 1, OK: true},
				{T0: 130 * ms, T: 140 * ms, Ev: "op", Op: "w", K: "k", F: 1, OK: true},
				{T: 600 * ms, Ev: "done", K: "k", F: 1, Err: "dlock: not held"},
				{T0: 600 * ms, T: 601 * ms, Ev: "rel", K: "k", F: 1},
			}},
			{ID: "w2", Events: []Event{
				{T0: 200 * ms, T: 650 * ms, Ev: "acq", K: "k", F: 2},
				{T0: 660 * ms, T: 670 * ms, Ev: "op", Op: "r", K: "k", F: 2, OK: true, V: 1},
				{T0: 680 * ms, T: 690 * ms, Ev: "op", Op: "w", K: "k", F: 2, OK: true},
				{T: 900 * ms, Ev: "done", K: "k", F: 2, Err: "dlock: not held"},
				{T0: 900 * ms, T: 901 * ms, Ev: "rel", K: "k", F: 2},
			}},
		},
		History: []LeaseEvent{
			{Seq: 1, Key: "k", Fence: 1, Token: tok(1), AtUs: us(90 * ms), ExpUs: us(1090 * ms)},
			{Seq: 2, Key: "k", Fence: 1, Token: tok(1), AtUs: us(600 * ms), ExpUs: us(600 * ms), Release: true},
			{Seq: 3, Key: "k", Fence: 2, Token: tok(2), AtUs: us(640 * ms), ExpUs: us(1640 * ms)},
			{Seq: 4, Key: "k", Fence: 2, Token: tok(2), AtUs: us(900 * ms), ExpUs: us(900 * ms), Release: true},
		},
		ResLog: []logRow{
			{ID: 1, Key: "k", Op: "r", Fence: 1, Worker: "w1", Accepted: true, Seen: 0, ReadVal: 0, CurVal: 0, NewVal: 0, AtUs: us(115 * ms)},
			{ID: 2, Key: "k", Op: "w", Fence: 1, Worker: "w1", Accepted: true, Seen: 1, ReadVal: 0, CurVal: 0, NewVal: 1, AtUs: us(135 * ms)},
			{ID: 3, Key: "k", Op: "r", Fence: 2, Worker: "w2", Accepted: true, Seen: 1, ReadVal: 1, CurVal: 1, NewVal: 1, AtUs: us(665 * ms)},
			{ID: 4, Key: "k", Op: "w", Fence: 2, Worker: "w2", Accepted: true, Seen: 2, ReadVal: 1, CurVal: 1, NewVal: 2, AtUs: us(685 * ms)},
		},
	}
}

func TestCheckClean(t *testing.T) {
	r := check(base())
	if r.Verdict != "PASS" || r.ViolationCount != 0 {
		t.Fatalf("clean record: %s %v %v", r.Verdict, r.ViolationList, r.Inconclusive)
	}
	if r.Acquisitions != 2 || r.Handoffs != 1 || r.CrossHandoffs != 1 {
		t.Errorf("counts: %+v", r)
	}
}

// A run that reads no store history by design (a failover) passes on the
// workers' and the resource's records, counts hand-offs from the workers'
// acquisitions, and says what it did not check.
func TestCheckNoHistoryByDesign(t *testing.T) {
	in := base()
	in.HasHistory, in.History, in.NoHistory = false, nil, "a failover loses part of the store's history"
	r := check(in)
	if r.Verdict != "PASS" || len(r.Inconclusive) > 0 || len(r.NotChecked) == 0 {
		t.Fatalf("no history by design: %s, inconclusive %v, not checked %v", r.Verdict, r.Inconclusive, r.NotChecked)
	}
	if r.Handoffs != 1 || r.CrossHandoffs != 1 {
		t.Errorf("hand-offs from the workers' records: %d (cross-worker %d); want 1 (1)", r.Handoffs, r.CrossHandoffs)
	}
	in.NoHistory = ""
	if r := check(in); r.Verdict != "INCONCLUSIVE" {
		t.Errorf("no history, no reason: %s; want INCONCLUSIVE", r.Verdict)
	}
}

func wantViolation(t *testing.T, in checkInput, kind string) *RunReport {
	t.Helper()
	r := check(in)
	if r.Violations[kind] == 0 {
		t.Fatalf("want %q, got %s %v", kind, r.Verdict, r.ViolationList)
	}
	if !r.Failed {
		t.Errorf("a violation must fail the run: %s", r.Verdict)
	}
	return r
}

func TestCheckGrantWhileHeld(t *testing.T) {
	in := base()
	in.History[1].Release, in.History[1].ExpUs = false, in.History[0].ExpUs // no release: live until 1090 ms
	in.History[1].AtUs = in.History[1].ExpUs - 1e6                          // a no-op extension
	wantViolation(t, in, vGrantWhileHeld)
}

func TestCheckFenceReused(t *testing.T) {
	in := base()
	in.History[2].Fence, in.History[3].Fence = 1, 1
	in.Workers[1].Events[0].F = 1
	wantViolation(t, in, vFenceTwice)
}

func TestCheckLostUpdateAndInterleaving(t *testing.T) {
	in := base()
	// w1 read 0, then w2 read and wrote 1, then w1 wrote 0+1 with its old
	// token: what a resource without fencing accepts.
	in.ResLog = []logRow{
		{ID: 1, Key: "k", Op: "r", Fence: 1, Worker: "w1", Accepted: true, AtUs: 115_000},
		{ID: 2, Key: "k", Op: "r", Fence: 2, Worker: "w2", Accepted: true, Seen: 1, AtUs: 665_000},
		{ID: 3, Key: "k", Op: "w", Fence: 2, Worker: "w2", Accepted: true, Seen: 2, ReadVal: 0, CurVal: 0, NewVal: 1, AtUs: 685_000},
		{ID: 4, Key: "k", Op: "w", Fence: 1, Worker: "w1", Accepted: true, Seen: 2, ReadVal: 0, CurVal: 1, NewVal: 1, AtUs: 686_000},
	}
	r := wantViolation(t, in, vLostUpdate)
	for _, k := range []string{vStaleAccepted, vInterleaved} {
		if r.Violations[k] == 0 {
			t.Errorf("want %q too: %v", k, r.ViolationList)
		}
	}
	// The same history as a positive control is a detection.
	in.Control, in.NoFencing = true, true
	in.Faults = []FaultRecord{{Kind: FaultStop, Worker: "w1", Start: 200 * ms, End: 700 * ms}}
	if r := check(in); r.Verdict != "DETECTED" {
		t.Errorf("control: %s %v", r.Verdict, r.ViolationList)
	}
}

func TestCheckFencedStaleWriteIsFine(t *testing.T) {
	in := base()
	// w1's write after w2's read is refused: fencing did its job.
	in.ResLog = []logRow{
		{ID: 1, Key: "k", Op: "r", Fence: 1, Worker: "w1", Accepted: true, AtUs: 115_000},
		{ID: 2, Key: "k", Op: "r", Fence: 2, Worker: "w2", Accepted: true, Seen: 1, AtUs: 665_000},
		{ID: 3, Key: "k", Op: "w", Fence: 1, Worker: "w1", Accepted: false, Seen: 2, AtUs: 670_000},
		{ID: 4, Key: "k", Op: "w", Fence: 2, Worker: "w2", Accepted: true, Seen: 2, ReadVal: 0, CurVal: 0, NewVal: 1, AtUs: 685_000},
	}
	r := check(in)
	if r.Verdict != "PASS" {
		t.Fatalf("%s %v", r.Verdict, r.ViolationList)
	}
	if r.StaleOps != 1 || r.StaleRejected != 1 {
		t.Errorf("stale ops %d refused %d", r.StaleOps, r.StaleRejected)
	}
}

func TestCheckLateNotification(t *testing.T) {
	in := base()
	// w1 lost its lease at 600 ms (no release at the store: it expired at
	// 1090 ms) but was told only at 1200 ms.
	in.History = append(in.History[:1:1], in.History[2:]...)
	in.History[1].AtUs = 1100_000 // w2 granted after the expiry
	ev := in.Workers[0].Events
	ev[3] = Event{T: 1200 * ms, Ev: "done", K: "k", F: 1, OK: true, Err: "dlock: lock lost"}
	ev[4] = Event{T0: 1200 * ms, T: 1201 * ms, Ev: "rel", K: "k", F: 1, Err: "dlock: not held"}
	in.Workers[1].Events[0].T = 1110 * ms
	in.ResLog = in.ResLog[:2]
	r := wantViolation(t, in, vLateNotice)
	if r.Lead.N != 1 || r.Lead.Min > -100 {
		t.Errorf("lead %+v", r.Lead)
	}
	// Stopped during the hold: a stopped process cannot be told; that is
	// fencing's case, not a violation.
	in.Faults = []FaultRecord{{Kind: FaultStop, Worker: "w1", Start: 500 * ms, End: 1190 * ms}}
	if r := check(in); r.ViolationCount != 0 {
		t.Errorf("paused holder: %v", r.ViolationList)
	}
}

func TestCheckSessionLeaseEstimate(t *testing.T) {
	in := base()
	for i := range in.History {
		in.History[i].Open = true
	}
	in.History = []LeaseEvent{in.History[0], in.History[2]} // grants only
	// w1 learns of the loss at 700 ms, after w2's grant at 640 ms.
	ev := in.Workers[0].Events
	ev[3] = Event{T: 700 * ms, Ev: "done", K: "k", F: 1, OK: true, Err: "dlock: lock lost"}
	ev[4] = Event{T0: 700 * ms, T: 701 * ms, Ev: "rel", K: "k", F: 1, Err: "dlock: not held"}
	wantViolation(t, in, vLateNotice)
	// Declared known under the fault that hit it: reported, not failed.
	in.Faults = []FaultRecord{{Kind: FaultCut, Worker: "w1", Start: 500 * ms, End: 900 * ms}}
	in.Known = map[string][]string{FaultCut: {vLateNotice}}
	r := check(in)
	if r.ViolationCount != 0 || len(r.Known) != 1 {
		t.Errorf("known limitation: %v known %v", r.ViolationList, r.Known)
	}
}

func TestCheckLiveness(t *testing.T) {
	in := base()
	// w1 released at 600 ms but w2, waiting since 200 ms, got the key only
	// at 2650 ms.
	in.History[2].AtUs, in.History[2].ExpUs = 2640_000, 3640_000
	in.History[3].AtUs, in.History[3].ExpUs = 2900_000, 2900_000
	in.Workers[1].Events[0].T = 2650 * ms
	r := wantViolation(t, in, vLiveness)
	if r.ViolationCount != 1 || !strings.Contains(r.ViolationList[0], "released") {
		t.Error(r.ViolationList)
	}
	// A third worker's pause across that time excuses the wait only where
	// a pause stalls the whole store (SQLite's file lock).
	in.Faults = []FaultRecord{{Kind: FaultStop, Worker: "w3", Start: 700 * ms, End: 2600 * ms}}
	wantViolation(t, in, vLiveness)
	in.PauseStallsStore = true
	if r := check(in); r.ViolationCount != 0 {
		t.Errorf("pause that stalls the store: %v", r.ViolationList)
	}
}

// A grant that no worker reported, to a queued waiter under a fault, holds
// the key as a faulted holder's lease does: w1's lease ends at 600 ms, the
// head passes to w3's entry (fence 2), which w3, paused, cannot take up
// until the store ends it at 1.9 s; w2, waiting since 200 ms, gets the key
// then (fence 3). The wait counts from 1.9 s. The same entry of a worker no
// fault touched (a waiter that gave up and left its entry at the head) is a
// free key with a waiter.
func TestCheckLivenessFaultedWaitersGrant(t *testing.T) {
	in := base()
	const shift = 1300 * ms
	in.History[1].Release = false // ended as etcd's history ends every lease
	in.History = []LeaseEvent{
		in.History[0], in.History[1],
		{Seq: 3, Key: "k", Fence: 2, Token: [16]byte{3}, AtUs: 600_000, ExpUs: 9000_000, Pid: 333},
		{Seq: 4, Key: "k", Fence: 2, Token: [16]byte{3}, AtUs: 1900_000, ExpUs: 1900_000, Pid: 333},
		{Seq: 5, Key: "k", Fence: 3, Token: [16]byte{2}, AtUs: 1900_000, ExpUs: 2900_000, Pid: 222},
		{Seq: 6, Key: "k", Fence: 3, Token: [16]byte{2}, AtUs: 900_000 + shift/1000, ExpUs: 900_000 + shift/1000, Release: true, Pid: 222},
	}
	in.Workers[0].Pid, in.Workers[1].Pid = 111, 222
	for i := range in.Workers[1].Events {
		e := &in.Workers[1].Events[i]
		e.F = 3
		if i > 0 {
			e.T0 += shift
		}
		e.T += shift
	}
	for i := 2; i < 4; i++ {
		in.ResLog[i].Fence = 3
		in.ResLog[i].AtUs += shift / 1000
	}
	in.ResLog[3].Seen = 3
	in.Workers = append(in.Workers, &workerLog{ID: "w3", Pid: 333})
	in.Faults = []FaultRecord{{Kind: FaultStop, Worker: "w3", Start: 500 * ms, End: 2500 * ms}}
	if r := check(in); r.ViolationCount != 0 {
		t.Errorf("a paused waiter's entry at the head: %v", r.ViolationList)
	}
	in.Faults = nil
	wantViolation(t, in, vLiveness)
}

// lateGrant is base() with w1's release at 2 s and w2, waiting since
// 200 ms, granted the key only at 4.04 s: 2.04 s of a free key with a
// waiter, past the release bound (TTL + 1 s).
func lateGrant() checkInput {
	in := base()
	in.History[0].ExpUs = 2500_000
	in.History[1].AtUs, in.History[1].ExpUs = 2000_000, 2000_000
	in.Workers[0].Events[3].T = 2000 * ms
	in.Workers[0].Events[4].T0, in.Workers[0].Events[4].T = 2000*ms, 2001*ms
	in.History[2].AtUs, in.History[2].ExpUs = 4040_000, 5040_000
	in.History[3].AtUs, in.History[3].ExpUs = 4300_000, 4300_000
	in.Workers[1].Events[0].T = 4050 * ms
	for i := 1; i < len(in.Workers[1].Events); i++ {
		in.Workers[1].Events[i].T0 += 3400 * ms
		in.Workers[1].Events[i].T += 3400 * ms
	}
	in.ResLog[2].AtUs, in.ResLog[3].AtUs = 4065_000, 4085_000
	return in
}

// A waiter inside a slow backend call that began while a fault touched it
// is not waiting in the store: w1 releases at 2 s; w2's call from 300 ms
// began under its own partition (200–400 ms) and ran on until 4 s, long
// past the partition plus a TTL (1.4 s). Its wait from 2 s to its grant at
// 4.05 s is excused; the same slow call begun without a fault of its own
// is not.
func TestCheckLivenessWaiterInItsOwnSlowCall(t *testing.T) {
	in := lateGrant()
	in.Workers[1].Events = append(in.Workers[1].Events, Event{T0: 300 * ms, T: 4000 * ms, Ev: "slow", Op: "acquire", K: "k"})
	wantViolation(t, in, vLiveness) // a slow call alone excuses nothing
	in.Faults = []FaultRecord{{Kind: FaultPartition, Worker: "w2", Start: 200 * ms, End: 400 * ms}}
	if r := check(in); r.ViolationCount != 0 {
		t.Errorf("a waiter stuck in a call begun under its own fault: %v", r.ViolationList)
	}
	in.Faults[0].Worker = "w3" // someone else's fault: not an excuse
	wantViolation(t, in, vLiveness)
}

// An acquisition that its caller's deadline cut off may have been granted
// in the store without a record and held the key until its clean-up: w1
// releases at 2 s and w2, waiting since 300 ms, is granted the key at
// 4.04 s; w3's acquisition of the key, cut off by its deadline at 2.6 s,
// may have held it until then, so the wait counts from 2.6 s. A try that
// found the key held took nothing and excuses nothing.
func TestCheckLivenessCutOffAcquisition(t *testing.T) {
	in := lateGrant()
	wantViolation(t, in, vLiveness)
	cut := Event{T0: 2500 * ms, T: 2600 * ms, Ev: "acqerr", K: "k", Cf: ClientAcqDeadline,
		Err: "dlock: not acquired: context deadline exceeded"}
	in.Workers = append(in.Workers, &workerLog{ID: "w3", Events: []Event{cut}})
	if r := check(in); r.ViolationCount != 0 {
		t.Errorf("a wait after an acquisition cut off by its deadline: %v", r.ViolationList)
	}
	in.Workers[2].Events[0].Err = `dlock: not acquired: "k" is held`
	wantViolation(t, in, vLiveness)
}

// A session strategy's server may grant a released key to a waiter whose
// process is stopped: it holds the key, with no record, until it resumes or
// the server ends its idle session. w1 releases at 2 s; w3, waiting for the
// key too, is stopped from 1.8 s to 2.5 s; w2 gets the key at 4.04 s. For a
// session strategy the wait counts from 3.5 s (the stop's end plus a TTL);
// for a lease strategy, whose grants are all recorded, it does not.
func TestCheckLivenessStoppedSessionWaiter(t *testing.T) {
	in := lateGrant()
	in.Workers = append(in.Workers, &workerLog{ID: "w3", Events: []Event{
		{T0: 1500 * ms, T: 6000 * ms, Ev: "acqerr", K: "k", Err: "dlock: acquire: gave up"},
	}})
	in.Faults = []FaultRecord{{Kind: FaultStop, Worker: "w3", Start: 1800 * ms, End: 2500 * ms}}
	wantViolation(t, in, vLiveness)
	in.SessionHeld = true
	if r := check(in); r.ViolationCount != 0 {
		t.Errorf("a session strategy's stopped waiter: %v", r.ViolationList)
	}
	in.Faults[0].Worker = "w1" // the releaser's own fault: not a waiter's
	wantViolation(t, in, vLiveness)
}

// A short hold whose release the store records early (a lower bound, as
// mysql-lease's) must not count as its own waiter: w2 takes the key at
// 650 ms, releases it at 660 ms (recorded at 600 ms), and nobody waits until
// w1 comes back at 5 s.
func TestCheckLivenessHolderIsNotItsOwnWaiter(t *testing.T) {
	in := base()
	in.History[3].AtUs, in.History[3].ExpUs = 600_000, 600_000 // before w2's acquisition returned
	in.Workers[1].Events[3].T, in.Workers[1].Events[4].T0, in.Workers[1].Events[4].T = 700*ms, 700*ms, 701*ms
	in.Workers[0].Events = append(in.Workers[0].Events,
		Event{T0: 4900 * ms, T: 5000 * ms, Ev: "acq", K: "k", F: 3},
		Event{T0: 5100 * ms, T: 5101 * ms, Ev: "rel", K: "k", F: 3})
	in.History = append(in.History,
		LeaseEvent{Seq: 5, Key: "k", Fence: 3, Token: [16]byte{3}, AtUs: 4990_000, ExpUs: 5990_000},
		LeaseEvent{Seq: 6, Key: "k", Fence: 3, Token: [16]byte{3}, AtUs: 5100_000, ExpUs: 5100_000, Release: true})
	if r := check(in); r.ViolationCount != 0 {
		t.Errorf("a hold counted as its own waiter: %v", r.ViolationList)
	}
}

func TestCheckClockStepIsInconclusive(t *testing.T) {
	in := base()
	in.OffsetSkew = int64(50 * time.Millisecond)
	if r := check(in); r.Verdict != "INCONCLUSIVE" {
		t.Errorf("%s", r.Verdict)
	}
}

func TestMarkReleases(t *testing.T) {
	tok := [16]byte{1}
	evs := []LeaseEvent{
		{Key: "k", Fence: 1, Token: tok, AtUs: 10, ExpUs: 1010},
		{Key: "k", Fence: 1, Token: tok, AtUs: 300, ExpUs: 1300},
		{Key: "k", Fence: 1, Token: tok, AtUs: 0, ExpUs: 400}, // expiry set to now: release at 400
		{Key: "k", Fence: 2, Token: tok, AtUs: 500, ExpUs: 1500},
		{Key: "k", Fence: 2, AtUs: 700, ExpUs: 0}, // the epoch
		{Key: "k", Fence: 3, Token: tok, AtUs: 800, ExpUs: 1800},
		{Key: "k", Fence: 3, AtUs: 900, ExpUs: 900}, // token cleared: a release
	}
	markReleases(evs)
	for i, want := range []bool{false, false, true, false, true, false, true} {
		if evs[i].Release != want {
			t.Errorf("event %d: release %v", i, evs[i].Release)
		}
	}
	if evs[2].AtUs != 400 || evs[6].AtUs != 900 {
		t.Errorf("release instants %d, %d", evs[2].AtUs, evs[6].AtUs)
	}
}

// A lease the store forgot when its server was killed (Redis without
// persistence) ends at the kill: the next grant is no violation, the holder
// (told later, it cannot be earlier) is no late notice but a loss-notice
// figure, and a fence that does not go up across the restart is flagged.
func TestCheckLeaseLostWithTheServer(t *testing.T) {
	in := base()
	// w1's lease (live until 1090 ms) is forgotten at a kill at 300 ms; w2
	// is granted at 640 ms; w1 is told at 600 ms.
	in.History[1] = LeaseEvent{Seq: 2, Key: "k", Fence: 1, Token: in.History[0].Token, AtUs: 300_000, ExpUs: 1_090_000, Release: true, Lost: true}
	ev := in.Workers[0].Events
	ev[3] = Event{T: 600 * ms, Ev: "done", K: "k", F: 1, OK: true, Err: "dlock: lock lost"}
	ev[4] = Event{T0: 600 * ms, T: 601 * ms, Ev: "rel", K: "k", F: 1, Err: "dlock: not held"}
	in.Faults = []FaultRecord{{Kind: FaultDBRestart, Slot: -1, Start: 300 * ms, End: 350 * ms}}
	r := check(in)
	if r.Verdict != "PASS" {
		t.Fatalf("%s %v %v", r.Verdict, r.ViolationList, r.Problems)
	}
	var fs *FaultStats
	for _, f := range r.Faults {
		if f.Kind == FaultDBRestart {
			fs = f
		}
	}
	if fs == nil || fs.LossNotice.N != 1 || fs.LossNotice.Min != 300 || fs.HitHolder != 1 {
		t.Fatalf("dbrestart figures: %+v", fs)
	}
	// Without the Lost mark the same history is a late notice.
	in.History[1].Lost = false
	in.History[1].Release = false
	in.History[1].AtUs, in.History[1].ExpUs = 300_000, 300_000
	wantViolation(t, in, vLateNotice)
	// A fence that went down across the restart is caught.
	in = base()
	in.History[1].Lost = true
	in.History[2].Fence, in.History[3].Fence = 0, 0
	in.Workers[1].Events[0].F = 0
	for i := range in.Workers[1].Events {
		in.Workers[1].Events[i].F = 0
	}
	wantViolation(t, in, vFenceNotUp)
}

// A positive control's resource violations are what it must find; any
// other kind fails it, and is listed however many resource ones come first.
func TestControlVerdict(t *testing.T) {
	c := &checker{rep: &RunReport{Control: true, PausesTakenOver: 1}}
	for range 2 * maxListedViolate {
		c.violate(vLostUpdate, "synthetic")
	}
	c.rep.verdict()
	if c.rep.Verdict != "DETECTED" || c.rep.Failed {
		t.Fatalf("resource violations only: %s", c.rep.Verdict)
	}
	c.violate(vErrNilAfterEnd, "synthetic")
	c.rep.verdict()
	if c.rep.Verdict != "DETECTED, but FAIL" || !c.rep.Failed {
		t.Errorf("with a client violation: %s", c.rep.Verdict)
	}
	if !strings.Contains(strings.Join(c.rep.ViolationList, "\n"), vErrNilAfterEnd) {
		t.Errorf("the client violation is not listed: %d entries", len(c.rep.ViolationList))
	}
}

// A grant that no worker was told of, made to a worker that a fault cut off
// while it waited (its reply lost in a partition, or the process stopped),
// took the key: the server holds such a session grant until it ends the
// session (its idle timeout, about a TTL). The wait of the others from the
// release to the next grant a worker got is not the key staying free. w1
// releases at 600 ms; w3, partitioned from 500 ms (or from just after the
// grant), is granted fence 2 at 610 ms inside its wait; w2, waiting since
// 200 ms, gets fence 3 at 2.7 s.
func TestCheckLivenessKeyTakenByACutOffWaiter(t *testing.T) {
	in := base()
	for i := range in.History {
		in.History[i].Open = true
	}
	tok3 := [16]byte{3, 3}
	in.History = []LeaseEvent{in.History[0],
		{Seq: 2, Key: "k", Fence: 2, Token: tok3, AtUs: 610_000, Open: true},
		{Seq: 3, Key: "k", Fence: 3, Token: [16]byte{2}, AtUs: 2690_000, Open: true}}
	w2 := in.Workers[1].Events
	for i := range w2 {
		w2[i].F = 3
		if i > 0 {
			w2[i].T0 += 2100 * ms
			w2[i].T += 2100 * ms
		}
	}
	w2[0].T = 2700 * ms
	for i := range in.ResLog[2:] {
		in.ResLog[2+i].Fence = 3
		in.ResLog[2+i].AtUs += 2100_000
	}
	in.ResLog[3].Seen = 3
	in.Workers = append(in.Workers, &workerLog{ID: "w3", Events: []Event{
		{T0: 300 * ms, T: 2600 * ms, Ev: "slow", Op: "wait", K: "k", Err: "connection reset", Tok: dlock.Token(tok3).String()},
	}})
	in.Faults = []FaultRecord{{Kind: FaultPartition, Worker: "w3", Start: 500 * ms, End: 2500 * ms}}
	if r := check(in); r.ViolationCount != 0 {
		t.Errorf("a key granted to a cut-off waiter counted as free: %v", r.ViolationList)
	}
	// Cut off just after the grant, before its reply arrived (the call
	// ended without it): the key was taken all the same.
	in.Faults[0].Start = 615 * ms
	if r := check(in); r.ViolationCount != 0 {
		t.Errorf("a key granted to a waiter cut off before the reply counted as free: %v", r.ViolationList)
	}
	// So with a short acquisition call that failed, cut off after the grant.
	w3 := in.Workers[2].Events
	w3[0] = Event{T0: 605 * ms, T: 640 * ms, Ev: "acqfail", Op: "wait", K: "k", Err: "invalid connection", Tok: w3[0].Tok}
	in.Faults[0].Start, in.Faults[0].End = 620*ms, 2500*ms
	if r := check(in); r.ViolationCount != 0 {
		t.Errorf("a key granted to a failed call cut off before the reply counted as free: %v", r.ViolationList)
	}
	// A fault after that call ended does not explain the lost grant.
	in.Faults[0].Start, in.Faults[0].End = 2650*ms, 2660*ms
	wantViolation(t, in, vLiveness)
	in.Faults[0].Start, in.Faults[0].End = 500*ms, 2500*ms
	// Granted to a worker no fault touched, the key was free as far as
	// anyone could tell: the wait is judged.
	in.Faults[0].Worker = "w4"
	wantViolation(t, in, vLiveness)
	// So is a grant whose token no worker's record names.
	in.Faults[0].Worker = "w3"
	in.Workers[2].Events[0].Tok = ""
	wantViolation(t, in, vLiveness)
}

// A failover run reads no store record (a failover loses part of it): the
// workers' and the resource's records judge it, and still catch a fence
// handed out twice.
func TestCheckFailoverWithoutStoreRecord(t *testing.T) {
	in := base()
	in.HasHistory, in.History, in.NoHistory = false, nil, "a failover loses part of the store's history"
	in.Faults = []FaultRecord{{Kind: FaultFailover, Slot: -1, Start: 620 * ms, End: 640 * ms}}
	if r := check(in); r.Verdict != "PASS" || r.ViolationCount != 0 {
		t.Fatalf("clean failover run: %s %v %v %v", r.Verdict, r.ViolationList, r.Inconclusive, r.Problems)
	}
	for i := range in.Workers[1].Events { // the promoted replica missed fence 1
		in.Workers[1].Events[i].F = 1
	}
	wantViolation(t, in, vFenceTwice)
}

func TestCheckLateReturn(t *testing.T) {
	in := base()
	// w2's acquisition of another key with a 2 ms caller deadline returns
	// 30 s after it.
	late := Event{T0: 1000 * ms, T: 31_002 * ms, Ev: "acqerr", K: "k2", Cf: ClientAcqDeadline, Dl: 1002 * ms, Err: "context deadline exceeded"}
	in.Ended = 40_000 * ms
	in.Workers[1].Events = append(in.Workers[1].Events, late)
	wantViolation(t, in, vLateReturn)
	// The same while the worker was stopped for most of it is the pause's
	// doing, not the call's.
	in.Faults = []FaultRecord{{Kind: FaultStop, Worker: "w2", Start: 1000 * ms, End: 30_000 * ms}}
	if r := check(in); r.Violations[vLateReturn] != 0 {
		t.Errorf("late return under a stop: %v", r.ViolationList)
	}
	// Within the bound: no violation.
	in.Faults = nil
	in.Workers[1].Events[len(in.Workers[1].Events)-1].T = 2_000 * ms
	if r := check(in); r.Violations[vLateReturn] != 0 {
		t.Errorf("return 1 s after the deadline: %v", r.ViolationList)
	}
}

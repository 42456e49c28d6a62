package torture

import (
	"slices"
	"strings"
	"testing"
)

// expiredLease turns base() into: w1's lease (fence 1) is not released and
// expires at the store at 1090 ms; w1 is told at 1000 ms and stops; w2 is
// granted at 1100 ms.
func expiredLease() checkInput {
	in := base()
	in.History = append(in.History[:1:1], in.History[2:]...)
	in.History[1].AtUs, in.History[1].ExpUs = 1100_000, 2100_000
	in.History[2].AtUs, in.History[2].ExpUs = 1300_000, 1300_000
	ev := in.Workers[0].Events
	ev[3] = Event{T: 1000 * ms, Ev: "done", K: "k", F: 1, OK: true, Err: "dlock: lock lost"}
	ev[4] = Event{T0: 1000 * ms, T: 1001 * ms, Ev: "rel", K: "k", F: 1, Err: "dlock: not held"}
	w2 := in.Workers[1].Events
	w2[0].T = 1110 * ms
	for i := 1; i < len(w2); i++ {
		w2[i].T0 += 500 * ms
		w2[i].T += 500 * ms
	}
	in.ResLog[2].AtUs, in.ResLog[3].AtUs = 1165_000, 1185_000
	return in
}

func TestCheckErrBeforeAccessClean(t *testing.T) {
	in := expiredLease()
	in.Workers[0].Events[1].Chk = 105 * ms
	in.Workers[0].Events[2].Chk = 125 * ms
	r := check(in)
	if r.Verdict != "PASS" || r.CheckedAccesses != 2 {
		t.Fatalf("%s %v checked %d", r.Verdict, r.ViolationList, r.CheckedAccesses)
	}
}

// An access made after Err said "held" at an instant past the store's
// expiry is a violation, whatever fault hit the holder: after a pause, Err
// must answer from the clock.
func TestCheckErrNilAfterExpiry(t *testing.T) {
	in := expiredLease()
	// w1 asked Err at 1095 ms (after the expiry at 1090 ms), then read and
	// was refused (w2 had not read yet, but the check is what is judged).
	in.Workers[0].Events = append(in.Workers[0].Events[:3:3],
		Event{T0: 1096 * ms, T: 1098 * ms, Ev: "op", Op: "r", K: "k", F: 1, Chk: 1095 * ms},
		Event{T: 1099 * ms, Ev: "done", K: "k", F: 1, OK: true, Err: "dlock: lock lost"},
		Event{T0: 1099 * ms, T: 1100 * ms, Ev: "rel", K: "k", F: 1, Err: "dlock: not held"})
	r := wantViolation(t, in, vErrNilAfterEnd)
	if !strings.Contains(listed(r, vErrNilAfterEnd), "fault none") {
		t.Error(r.ViolationList)
	}
	in.Faults = []FaultRecord{{Kind: FaultStop, Worker: "w1", Slot: 0, Start: 300 * ms, End: 1094 * ms}}
	r = wantViolation(t, in, vErrNilAfterEnd)
	if !strings.Contains(listed(r, vErrNilAfterEnd), "fault stop") {
		t.Error(r.ViolationList)
	}
	// The client fault of the hold is named.
	in.Workers[0].Events[0].Cf = ClientAcqDeadline
	r = wantViolation(t, in, vErrNilAfterEnd)
	if !strings.Contains(listed(r, vErrNilAfterEnd), "client acqdeadline") {
		t.Error(r.ViolationList)
	}
}

// A release the store records up to 100 ms before its statement's instant
// (mysql-lease) is the holder's own: its checks came before it.
func TestCheckErrBeforeOwnEarlyRelease(t *testing.T) {
	in := base()
	in.History[1].AtUs, in.History[1].ExpUs = 520_000, 520_000 // recorded 80 ms early
	in.Workers[0].Events[2].Chk = 590 * ms
	in.Workers[0].Events[2].T0, in.Workers[0].Events[2].T = 591*ms, 595*ms
	if r := check(in); r.ViolationCount != 0 {
		t.Errorf("own release: %v", r.ViolationList)
	}
	// Killed during that release, the holder recorded no "rel": its Lock's
	// Done, closed by Release ("not held"), says when it let go.
	in.Workers[0].Events = in.Workers[0].Events[:4]
	in.Faults = []FaultRecord{{Kind: FaultKill, Worker: "w1", Start: 602 * ms, End: 610 * ms}}
	if r := check(in); r.ViolationCount != 0 {
		t.Errorf("own release, the holder killed during it: %v", r.ViolationList)
	}
	// Told of a loss at 600 ms, the holder's Locker released the lease in
	// the background, recorded 80 ms early: still its own.
	in.Workers[0].Events[3].OK, in.Workers[0].Events[3].Err = true, "dlock: lock lost"
	if r := check(in); r.ViolationCount != 0 {
		t.Errorf("the Locker's release after a loss: %v", r.ViolationList)
	}
	// A release recorded well before the holder let go or was told is not.
	in.History[1].AtUs, in.History[1].ExpUs = 400_000, 400_000
	wantViolation(t, in, vErrNilAfterEnd)
}

// For a session lock the end is the next grant; the session strategies'
// gap under a cut (the holder learns at its next renewal) is known, and
// only under a cut or a server restart.
func TestCheckErrNilAfterNextSessionGrant(t *testing.T) {
	in := base()
	for i := range in.History {
		in.History[i].Open = true
	}
	in.History = []LeaseEvent{in.History[0], in.History[2]} // grants: 90 ms, 640 ms
	in.Workers[0].Events = append(in.Workers[0].Events[:3:3],
		Event{T0: 646 * ms, T: 648 * ms, Ev: "op", Op: "r", K: "k", F: 1, Chk: 645 * ms},
		Event{T: 650 * ms, Ev: "done", K: "k", F: 1, OK: true, Err: "dlock: lock lost"},
		Event{T0: 650 * ms, T: 651 * ms, Ev: "rel", K: "k", F: 1, Err: "dlock: not held"})
	in.Known = sessionEnds
	r := wantViolation(t, in, vErrNilAfterEnd)
	if !strings.Contains(listed(r, vErrNilAfterEnd), "next grant") {
		t.Error(r.ViolationList)
	}
	in.Faults = []FaultRecord{{Kind: FaultCut, Worker: "w1", Start: 500 * ms, End: 900 * ms}}
	if r := check(in); r.Violations[vErrNilAfterEnd] != 0 || r.Known[vErrNilAfterEnd+" (under cut)"] != 1 {
		t.Errorf("under a cut: %v known %v", r.ViolationList, r.Known)
	}
	in.Faults[0].Kind = FaultLatency
	wantViolation(t, in, vErrNilAfterEnd)
}

// A lease a killed server forgot cannot be told before: no verdict.
func TestCheckErrNilAfterForgottenLease(t *testing.T) {
	in := expiredLease()
	in.History[0].ExpUs = 1090_000
	in.History = append(in.History[:1:1], append([]LeaseEvent{{Seq: 2, Key: "k", Fence: 1, Token: in.History[0].Token, AtUs: 300_000, ExpUs: 1090_000, Release: true, Lost: true}}, in.History[1:]...)...)
	in.Workers[0].Events[1].Chk = 400 * ms
	in.Faults = []FaultRecord{{Kind: FaultDBRestart, Slot: -1, Start: 300 * ms, End: 350 * ms}}
	if r := check(in); r.Violations[vErrNilAfterEnd] != 0 {
		t.Errorf("forgotten lease: %v", r.ViolationList)
	}
}

// A skipped write ends the cycle as a read: no pending write for porcupine.
func TestCyclesSkippedWrite(t *testing.T) {
	ws := []*workerLog{{ID: "w1", Events: []Event{
		{T0: 1, T: 2, Ev: "op", Op: "r", K: "a", F: 1, OK: true, V: 3},
		{T0: 2, T: 3, Ev: "op", Op: "r", K: "b", F: 1, OK: true, V: 5}, // another lane
		{T: 4, Ev: "skip", Op: "w", K: "a", F: 1},
		{T0: 5, T: 6, Ev: "op", Op: "w", K: "b", F: 1, OK: true},
	}}}
	ops := cycles(ws, 100, true)
	if len(ops) != 2 {
		t.Fatalf("%d operations: %+v", len(ops), ops)
	}
	for _, op := range ops {
		in := op.Input.(cycleInput)
		if (in.key == "a" && in.write != readOnly) || (in.key == "b" && in.write != wrote) {
			t.Errorf("%+v", in)
		}
	}
}

// A panicking Do whose Locker kept the lock is a violation; one whose
// Locker let it go is a figure.
func TestCheckPanicInDo(t *testing.T) {
	in := base()
	in.Workers[0].Events = append(in.Workers[0].Events,
		Event{T0: 700 * ms, T: 720 * ms, Ev: "dofree", K: "k", F: 1, OK: true})
	r := check(in)
	if r.ViolationCount != 0 || len(r.ClientFaults) != 1 || r.ClientFaults[0].Freed.N != 1 {
		t.Fatalf("%v %+v", r.ViolationList, r.ClientFaults)
	}
	in.Workers[0].Events[5] = Event{T0: 700 * ms, T: 7800 * ms, Ev: "dofree", K: "k", F: 1, Err: "still held by this Locker"}
	wantViolation(t, in, vPanicKept)
}

// A waiter that gave up while the key was free for longer than the bound is
// a liveness violation even though no later grant came.
func TestCheckLivenessWaiterGaveUp(t *testing.T) {
	in := base()
	// Drop w2's hold: w2 waited from 200 ms and gave up at 5 s; the key,
	// released at 600 ms, was never granted again.
	in.History = in.History[:2]
	in.Workers[1].Events = []Event{{T0: 200 * ms, T: 5000 * ms, Ev: "acqerr", K: "k", Err: "dlock: not acquired"}}
	in.ResLog = in.ResLog[:2]
	r := wantViolation(t, in, vLiveness)
	if !strings.Contains(r.ViolationList[0], "gave up") {
		t.Error(r.ViolationList)
	}
	// A caller deadline's failure is not a wait.
	in.Workers[1].Events[0].Cf = ClientAcqDeadline
	if r := check(in); r.ViolationCount != 0 {
		t.Errorf("%v", r.ViolationList)
	}
	// Nor is a wait that ended within the bound of the release.
	in.Workers[1].Events[0] = Event{T0: 200 * ms, T: 1500 * ms, Ev: "acqerr", K: "k", Err: "dlock: not acquired"}
	if r := check(in); r.ViolationCount != 0 {
		t.Errorf("%v", r.ViolationList)
	}
}

func TestParseClientFaults(t *testing.T) {
	if fs, err := ParseClientFaults("all"); err != nil || len(fs) != len(clientFaults) || !slices.Contains(fs, ClientObsPanic) {
		t.Errorf("all: %v %v", fs, err)
	}
	if fs, err := ParseClientFaults("none"); err != nil || fs != nil {
		t.Errorf("none: %v %v", fs, err)
	}
	if _, err := ParseClientFaults("dopanic,bogus"); err == nil {
		t.Error("bogus accepted")
	}
}

// listed returns the first listed violation of kind.
func listed(r *RunReport, kind string) string {
	for _, v := range r.ViolationList {
		if strings.HasPrefix(v, kind+": ") {
			return v
		}
	}
	return ""
}

// A session lock whose release failed by its caller's deadline must still
// end by its TTL: a waiter that gave up long after is a violation; without
// the deadline fault the end is unknown and nothing is judged.
func TestCheckLivenessSessionReleaseMissedItsDeadline(t *testing.T) {
	in := base()
	in.History = []LeaseEvent{in.History[0]}
	in.History[0].Open = true
	in.Workers[0].Events[4] = Event{T0: 600 * ms, T: 601 * ms, Ev: "rel", K: "k", F: 1, Cf: ClientRelDeadline, Err: "context deadline exceeded"}
	in.Workers[1].Events = []Event{{T0: 200 * ms, T: 5000 * ms, Ev: "acqerr", K: "k", Err: "dlock: not acquired"}}
	in.ResLog = in.ResLog[:2]
	wantViolation(t, in, vLiveness)
	in.Workers[0].Events[4].Cf = ""
	if r := check(in); r.ViolationCount != 0 {
		t.Errorf("%v", r.ViolationList)
	}
}

// A session strategy's fence written by an acquisition that then failed
// (mysql-rowlock: the row was not held across the fence's write, so no
// worker got that fence) is not a grant: the lease before it lasts until
// the next grant a worker was told of. That grant still bounds the end.
func TestCheckSessionFenceNoWorkerGot(t *testing.T) {
	in := base()
	for i := range in.History {
		in.History[i].Open = true
	}
	// Grants: fence 1 at 90 ms, fence 2 at 300 ms (no worker got it), fence
	// 3 at 640 ms (w2's acquisition, renumbered).
	in.History = []LeaseEvent{in.History[0],
		{Seq: 2, Key: "k", Fence: 2, Token: [16]byte{9}, AtUs: 300_000, Open: true},
		{Seq: 3, Key: "k", Fence: 3, Token: [16]byte{2}, AtUs: 640_000, Open: true}}
	for i := range in.Workers[1].Events {
		in.Workers[1].Events[i].F = 3
	}
	for i := range in.ResLog[2:] {
		in.ResLog[2+i].Fence = 3
	}
	in.ResLog[3].Seen = 3
	in.Workers[0].Events = append(in.Workers[0].Events[:3:3],
		Event{T0: 400 * ms, T: 402 * ms, Ev: "op", Op: "r", K: "k", F: 1, Chk: 399 * ms},
		Event{T: 600 * ms, Ev: "done", K: "k", F: 1, Err: "dlock: not held"},
		Event{T0: 600 * ms, T: 601 * ms, Ev: "rel", K: "k", F: 1})
	if r := check(in); r.ViolationCount != 0 {
		t.Fatalf("fence 2 taken for a grant: %v", r.ViolationList)
	}
	// A check after the next grant a worker got is still flagged.
	in.Workers[0].Events[3].Chk, in.Workers[0].Events[3].T0, in.Workers[0].Events[3].T = 645*ms, 646*ms, 648*ms
	in.Workers[0].Events[4].T, in.Workers[0].Events[5].T0, in.Workers[0].Events[5].T = 650*ms, 650*ms, 651*ms
	wantViolation(t, in, vErrNilAfterEnd)
}

// A panicking Observer whose Locker kept the lock is a violation of its own;
// one whose Locker let it go is a figure of the obspanic fault.
func TestCheckPanicInObserver(t *testing.T) {
	in := base()
	in.Workers[0].Events = append(in.Workers[0].Events,
		Event{T0: 700 * ms, T: 720 * ms, Ev: "dofree", K: "k", F: 1, OK: true, Cf: ClientObsPanic})
	r := check(in)
	if r.ViolationCount != 0 || len(r.ClientFaults) != 1 || r.ClientFaults[0].Kind != ClientObsPanic || r.ClientFaults[0].Freed.N != 1 || r.ClientFaults[0].Injected != 1 {
		t.Fatalf("%v %+v", r.ViolationList, r.ClientFaults)
	}
	in.Workers[0].Events[5] = Event{T0: 700 * ms, T: 7800 * ms, Ev: "dofree", K: "k", F: 1, Cf: ClientObsPanic, Err: "still held by this Locker"}
	wantViolation(t, in, vObsPanicKept)
}

package torture

import (
	"testing"
	"time"
)

// modeInput returns an input with the mode keys its workers use, rw
// (reader-writer) and sem (limit 2), no store history for them (the exclusive checks see nothing),
// and the given workers and resource rows.
func modeInput(workers []*workerLog, rows []logRow) checkInput {
	keys := map[string]int{}
	for _, w := range workers {
		for _, e := range w.Events {
			keys[e.K] = map[string]int{semKey: semLimit}[e.K]
		}
	}
	return checkInput{
		Name: "synthetic", Strategy: "synthetic", TTL: time.Second,
		Started: 0, Ended: 10_000 * ms, HasHistory: true,
		ModeKeys: keys, Workers: workers, ResLog: rows,
	}
}

// holdEvents is a hold of key in mode m (n: limit) from acq to rel ms, with
// lock checks before accesses at the given instants (ms).
func holdEvents(key, m string, n int, fence uint64, acq, rel int64, checks ...int64) []Event {
	evs := []Event{{T0: acq*ms - 10*ms, T: acq * ms, Ev: "acq", K: key, F: fence, M: m, N: n}}
	for _, c := range checks {
		evs = append(evs, Event{T0: c*ms + ms, T: c*ms + 2*ms, Ev: "op", Op: "r", K: key, F: fence, OK: true, Chk: c * ms, M: m})
	}
	return append(evs, Event{T: rel * ms, Ev: "done", K: key, F: fence}, Event{T0: rel * ms, T: rel*ms + ms, Ev: "rel", K: key, F: fence})
}

func TestCheckModesReadersOverlap(t *testing.T) {
	in := modeInput([]*workerLog{
		{ID: "w1", Events: holdEvents(rwKey, accessShared, 0, 1, 100, 500, 110, 300)},
		{ID: "w2", Events: holdEvents(rwKey, accessShared, 0, 2, 150, 400, 160, 350)},
		{ID: "w3", Events: holdEvents(rwKey, "", 0, 3, 600, 800, 610)},
		{ID: "w4", Events: holdEvents(semKey, accessLimited, semLimit, 1, 100, 500, 110, 300)},
		{ID: "w5", Events: holdEvents(semKey, accessLimited, semLimit, 2, 150, 400, 160, 350)},
	}, []logRow{
		{ID: 1, Key: rwKey, Op: "r", Mode: accessShared, Fence: 1, Worker: "w1", Accepted: true, Chk: 110 * ms},
		{ID: 2, Key: rwKey, Op: "r", Mode: accessShared, Fence: 2, Worker: "w2", Accepted: true, Seen: 1, Chk: 160 * ms},
		{ID: 3, Key: rwKey, Op: "r", Mode: accessShared, Fence: 1, Worker: "w1", Accepted: true, Seen: 2, Chk: 300 * ms},
		{ID: 4, Key: rwKey, Op: "r", Mode: accessShared, Fence: 2, Worker: "w2", Accepted: true, Seen: 2, Chk: 350 * ms},
		{ID: 5, Key: rwKey, Op: "r", Mode: accessExclusive, Fence: 3, Worker: "w3", Accepted: true, Seen: 2, Chk: 610 * ms},
		{ID: 6, Key: rwKey, Op: "w", Mode: accessExclusive, Fence: 3, Worker: "w3", Accepted: true, Seen: 3, XSeen: 3, NewVal: 1, Chk: 620 * ms},
		{ID: 7, Key: semKey, Op: "r", Mode: accessLimited, Fence: 1, Worker: "w4", Accepted: true, Chk: 110 * ms},
		{ID: 8, Key: semKey, Op: "r", Mode: accessLimited, Fence: 2, Worker: "w5", Accepted: true, Seen: 1, Chk: 160 * ms},
		{ID: 9, Key: semKey, Op: "r", Mode: accessLimited, Fence: 1, Worker: "w4", Accepted: true, Seen: 2, Chk: 300 * ms},
	})
	r := check(in)
	if r.Verdict != "PASS" {
		t.Fatalf("%s %v %v", r.Verdict, r.ViolationList, r.Inconclusive)
	}
	if len(r.Modes) != 2 || r.Modes[0].Key != rwKey || r.Modes[0].MaxHolders != 2 || r.Modes[0].Shared != 2 || r.Modes[0].Exclusive != 1 ||
		r.Modes[1].MaxHolders != 2 || r.Modes[1].Limited != 2 {
		t.Errorf("figures: %+v %+v", r.Modes[0], r.Modes[1])
	}
}

func TestCheckModesWriterAmongReaders(t *testing.T) {
	// w3 (exclusive) was told "held" while w1 (shared) still was, and the
	// resource (a positive control's, accepting everything) took w1's read
	// inside w3's read-write cycle.
	in := modeInput([]*workerLog{
		{ID: "w1", Events: holdEvents(rwKey, accessShared, 0, 1, 100, 900, 110, 700)},
		{ID: "w3", Events: holdEvents(rwKey, "", 0, 2, 600, 800, 610)},
	}, []logRow{
		{ID: 1, Key: rwKey, Op: "r", Mode: accessShared, Fence: 1, Worker: "w1", Accepted: true, Chk: 110 * ms},
		{ID: 2, Key: rwKey, Op: "r", Mode: accessExclusive, Fence: 2, Worker: "w3", Accepted: true, Seen: 1, Chk: 610 * ms},
		{ID: 3, Key: rwKey, Op: "r", Mode: accessShared, Fence: 1, Worker: "w1", Accepted: true, Seen: 2, XSeen: 2, Chk: 700 * ms},
		{ID: 4, Key: rwKey, Op: "w", Mode: accessExclusive, Fence: 2, Worker: "w3", Accepted: true, Seen: 2, XSeen: 2, NewVal: 1},
	})
	r := check(in)
	for _, k := range []string{vOverClaimed, vStaleAccepted, vInterleaved} {
		if r.Violations[k] == 0 {
			t.Errorf("want %q: %v", k, r.ViolationList)
		}
	}
	// With fencing the resource refuses w1's read: what is left is the
	// Locker's claim, a bug whatever the resource does.
	in.ResLog[2].Accepted = false
	in.ResLog[3].XSeen = 2
	r = check(in)
	if r.Violations[vOverClaimed] != 1 || r.Violations[vInterleaved] != 0 || r.Violations[vStaleAccepted] != 0 || r.Violations[vFreshRejected] != 0 {
		t.Errorf("fenced: %v", r.ViolationList)
	}
}

func TestCheckModesFreshReaderRefused(t *testing.T) {
	// A reader granted after the writer is refused: a resource bug.
	in := modeInput([]*workerLog{
		{ID: "w1", Events: holdEvents(rwKey, "", 0, 1, 100, 200, 110)},
		{ID: "w2", Events: holdEvents(rwKey, accessShared, 0, 2, 300, 400, 310)},
	}, []logRow{
		{ID: 1, Key: rwKey, Op: "r", Mode: accessExclusive, Fence: 1, Worker: "w1", Accepted: true, Chk: 110 * ms},
		{ID: 2, Key: rwKey, Op: "r", Mode: accessShared, Fence: 2, Worker: "w2", Accepted: false, Seen: 1, XSeen: 1, Chk: 310 * ms},
	})
	wantViolation(t, in, vFreshRejected)
}

func TestCheckModesSemaphoreOverLimit(t *testing.T) {
	// Three holders of a semaphore of two told "held" at once.
	in := modeInput([]*workerLog{
		{ID: "w1", Events: holdEvents(semKey, accessLimited, semLimit, 1, 100, 900, 110, 700)},
		{ID: "w2", Events: holdEvents(semKey, accessLimited, semLimit, 2, 200, 900, 210, 700)},
		{ID: "w3", Events: holdEvents(semKey, accessLimited, semLimit, 3, 600, 900, 610)},
	}, nil)
	wantViolation(t, in, vOverClaimed)
}

func TestCheckModesSemaphorePause(t *testing.T) {
	// w1 checked at 300 ms, was paused, and read at 2.5 s, after w3 got
	// its slot: over the limit at the resource, but every lock check was
	// right when made (fencing cannot order a semaphore). Without the
	// check (a positive control's unchecked access), it is a violation.
	in := modeInput([]*workerLog{
		{ID: "w1", Events: holdEvents(semKey, accessLimited, semLimit, 1, 100, 2600, 110, 300)},
		{ID: "w2", Events: holdEvents(semKey, accessLimited, semLimit, 2, 200, 3000, 210, 2000)},
		{ID: "w3", Events: holdEvents(semKey, accessLimited, semLimit, 3, 1500, 3000, 1510, 2000)},
	}, []logRow{
		{ID: 1, Key: semKey, Op: "r", Mode: accessLimited, Fence: 1, Worker: "w1", Accepted: true, Chk: 110 * ms},
		{ID: 2, Key: semKey, Op: "r", Mode: accessLimited, Fence: 2, Worker: "w2", Accepted: true, Seen: 1, Chk: 210 * ms},
		{ID: 3, Key: semKey, Op: "r", Mode: accessLimited, Fence: 3, Worker: "w3", Accepted: true, Seen: 2, Chk: 1510 * ms},
		{ID: 4, Key: semKey, Op: "r", Mode: accessLimited, Fence: 1, Worker: "w1", Accepted: true, Seen: 3, Chk: 300 * ms},
		{ID: 5, Key: semKey, Op: "r", Mode: accessLimited, Fence: 2, Worker: "w2", Accepted: true, Seen: 3, Chk: 2000 * ms},
	})
	r := check(in)
	if r.Verdict != "PASS" || r.Modes[0].AfterPause != 1 {
		t.Fatalf("%s %v %v %+v", r.Verdict, r.ViolationList, r.Inconclusive, r.Modes[0])
	}
	in.ResLog[3].Chk = 0
	// A store that forgets its leases when killed lets a third holder in:
	// known under the restart.
	in.Known = map[string][]string{FaultDBRestart: {vOverLimit}}
	in.Faults = []FaultRecord{{Kind: FaultDBRestart, Start: 400 * ms, End: 500 * ms}}
	if r := check(in); r.Violations[vOverLimit] != 0 || r.Known[vOverLimit+" (under dbrestart)"] == 0 {
		t.Errorf("under a restart: %v known %v", r.ViolationList, r.Known)
	}
	in.Known = nil
	in.Control, in.NoFencing = true, true
	in.Faults = []FaultRecord{{Kind: FaultStop, Worker: "w1", Start: 400 * ms, End: 2400 * ms}}
	r = check(in)
	if r.Violations[vOverLimit] == 0 || r.Verdict != "DETECTED" {
		t.Errorf("unchecked: %s %v", r.Verdict, r.ViolationList)
	}
}

func TestCheckModesKnownUnderRestart(t *testing.T) {
	// A store that forgets its leases when killed (Redis without
	// persistence) lets a writer in while a reader it forgot is still told
	// "held": known under the restart, a violation otherwise.
	in := modeInput([]*workerLog{
		{ID: "w1", Events: holdEvents(rwKey, accessShared, 0, 1, 100, 900, 110, 700)},
		{ID: "w2", Events: holdEvents(rwKey, "", 0, 2, 600, 800, 610)},
	}, nil)
	in.Known = map[string][]string{FaultDBRestart: {vOverClaimed}}
	in.Faults = []FaultRecord{{Kind: FaultDBRestart, Start: 400 * ms, End: 500 * ms}}
	if r := check(in); r.Violations[vOverClaimed] != 0 || r.Known[vOverClaimed+" (under dbrestart)"] != 1 {
		t.Errorf("under a restart: %v known %v", r.ViolationList, r.Known)
	}
	in.Faults = nil
	wantViolation(t, in, vOverClaimed)
}

func TestCheckObservers(t *testing.T) {
	in := base() // w1 holds k fence 1, then w2 fence 2
	in.Leader = "k"
	in.Workers[0].Events = append(in.Workers[0].Events,
		Event{T: 105 * ms, Ev: "obs", K: "k", F: 1, Val: "w1"},
		Event{T: 610 * ms, Ev: "obs", K: "k"},
		Event{T: 655 * ms, Ev: "obs", K: "k", F: 2, Val: "w2"})
	r := check(in)
	if r.Verdict != "PASS" || r.Observers == nil || r.Observers.Seen != 2 || r.Observers.Terms != 2 || r.Observers.Reports != 3 {
		t.Fatalf("%s %v %+v", r.Verdict, r.ViolationList, r.Observers)
	}
	// Back to an older term, and a term reported with another's value.
	in.Workers[1].Events = append(in.Workers[1].Events,
		Event{T: 700 * ms, Ev: "obs", K: "k", F: 2, Val: "w2"},
		Event{T: 710 * ms, Ev: "obs", K: "k", F: 1, Val: "w1"})
	if r := wantViolation(t, in, vObserved); r.Violations[vObserved] != 1 {
		t.Errorf("out of order: %v", r.ViolationList)
	}
	in.Workers[1].Events = in.Workers[1].Events[:len(in.Workers[1].Events)-2]
	in.Workers[1].Events = append(in.Workers[1].Events, Event{T: 700 * ms, Ev: "obs", K: "k", F: 2, Val: "w1"})
	wantViolation(t, in, vObserved)
}

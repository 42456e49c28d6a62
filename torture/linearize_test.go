package torture

import "testing"

// linearizable runs only the porcupine check over workers' records.
func linearizable(workers ...*workerLog) *RunReport {
	c := &checker{in: checkInput{Workers: workers}, rep: &RunReport{}}
	c.checkLinearizable()
	return c.rep
}

func rd(t0, t int64, v int64) Event {
	return Event{T0: t0 * ms, T: t * ms, Ev: "op", Op: "r", K: "k", OK: true, V: v}
}

func wr(t0, t int64, ok bool, err string) Event {
	return Event{T0: t0 * ms, T: t * ms, Ev: "op", Op: "w", K: "k", OK: ok, Err: err}
}

func TestLinearizable(t *testing.T) {
	for _, tc := range []struct {
		name    string
		w1, w2  []Event
		illegal bool
	}{
		{name: "one cycle after another", w1: []Event{rd(10, 20, 0), wr(30, 40, true, "")}, w2: []Event{rd(50, 60, 1), wr(70, 80, true, "")}},
		{name: "overlapping calls, one order fits", w1: []Event{rd(10, 20, 0), wr(30, 60, true, "")}, w2: []Event{rd(25, 70, 1), wr(75, 80, true, "")}},
		{name: "lost update: both read 0 and wrote 1", w1: []Event{rd(10, 20, 0), wr(700, 710, true, "")}, w2: []Event{rd(50, 60, 0), wr(70, 80, true, "")}, illegal: true},
		{name: "stale read of an old value", w1: []Event{rd(10, 20, 0), wr(30, 40, true, "")}, w2: []Event{rd(50, 60, 0)}, illegal: true},
		{name: "fenced: the paused holder's write refused", w1: []Event{rd(10, 20, 0), wr(700, 710, false, "")}, w2: []Event{rd(50, 60, 0), wr(70, 80, true, "")}},
		{name: "refused read shows nothing", w1: []Event{rd(10, 20, 0), wr(30, 40, true, "")}, w2: []Event{{T0: 50 * ms, T: 60 * ms, Ev: "op", Op: "r", K: "k", OK: false, V: 0}}},
		{name: "worker died after its read, write took effect", w1: []Event{rd(10, 20, 0)}, w2: []Event{rd(50, 60, 1), wr(70, 80, true, "")}},
		{name: "worker died after its read, write never happened", w1: []Event{rd(10, 20, 0)}, w2: []Event{rd(50, 60, 0), wr(70, 80, true, "")}},
		{name: "failed write that took effect", w1: []Event{rd(10, 20, 0), wr(30, 40, false, "driver: bad connection")}, w2: []Event{rd(50, 60, 1), wr(70, 80, true, "")}},
		{name: "an unknown write cannot explain a value it never wrote", w1: []Event{rd(10, 20, 0)}, w2: []Event{rd(50, 60, 5)}, illegal: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := linearizable(&workerLog{ID: "w1", Events: tc.w1}, &workerLog{ID: "w2", Events: tc.w2})
			if got := r.Violations[vNotLinearizable] > 0; got != tc.illegal {
				t.Errorf("not linearizable = %v, want %v (%v)", got, tc.illegal, r.ViolationList)
			}
			if len(r.Inconclusive) > 0 {
				t.Errorf("inconclusive: %v", r.Inconclusive)
			}
			if !tc.illegal && r.LinearizableKeys != 1 {
				t.Errorf("keys found linearizable: %d, want 1", r.LinearizableKeys)
			}
		})
	}
}

// The check must not trust the resource's log: a lost update that the log
// hides (here: a log showing the two holders in turn) is still found from
// the workers' records, and a positive control counts it as a detection.
func TestCheckLinearizabilityIndependentOfTheLog(t *testing.T) {
	in := base()
	// w1 read 0 and wrote 0+1 after w2 had read 0 and written 1.
	in.Workers[0].Events[2] = wr(700, 710, true, "")
	in.Workers[1].Events[1].V = 0
	r := check(in)
	if r.Violations[vNotLinearizable] == 0 {
		t.Fatalf("lost update not found: %s %v", r.Verdict, r.ViolationList)
	}
	if r.ViolationCount != r.Violations[vNotLinearizable] {
		t.Errorf("the log-based checks should see nothing in this log: %v", r.ViolationList)
	}
	in.Control, in.NoFencing = true, true
	in.Faults = []FaultRecord{{Kind: FaultStop, Worker: "w1", Start: 200 * ms, End: 690 * ms}}
	if r := check(in); r.Verdict != "DETECTED" {
		t.Errorf("control: %s %v", r.Verdict, r.ViolationList)
	}
}

// With fencing, a write whose outcome is unknown cannot take effect after a
// newer holder's read was accepted: the resource then refuses its token. A
// history that needs it to (the value changes between two newer reads with
// no write between them) is not linearizable; without fencing (the control)
// it is.
func TestLinearizablePendingWriteClosedByANewerRead(t *testing.T) {
	fenced := func(e Event, f uint64) Event { e.F = f; return e }
	workers := func() []*workerLog {
		return []*workerLog{
			{ID: "w1", Events: []Event{fenced(rd(10, 20, 0), 1)}},                                   // died after its read
			{ID: "w2", Events: []Event{fenced(rd(50, 60, 0), 2), fenced(wr(65, 70, false, ""), 2)}}, // refused
			{ID: "w3", Events: []Event{fenced(rd(80, 90, 0), 3), fenced(wr(92, 94, false, ""), 3)}},
			{ID: "w4", Events: []Event{fenced(rd(100, 110, 1), 4)}},
		}
	}
	c := &checker{in: checkInput{Workers: workers()}, rep: &RunReport{}}
	c.checkLinearizable()
	if c.rep.Violations[vNotLinearizable] == 0 {
		t.Errorf("a stale write taking effect after newer reads was not flagged")
	}
	c = &checker{in: checkInput{Workers: workers(), NoFencing: true}, rep: &RunReport{}}
	c.checkLinearizable()
	if c.rep.Violations[vNotLinearizable] != 0 {
		t.Errorf("without fencing the late write is possible, yet flagged: %v", c.rep.ViolationList)
	}
}

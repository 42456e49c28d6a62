package torture

import (
	"strings"
	"testing"
)

func TestClockMap(t *testing.T) {
	// A store clock 3,600 s ahead running at 1.1× real time, sampled every
	// 100 ms from Mono() 1 s.
	sc := &storeClock{}
	store := func(mono int64) int64 { return 3_600_000_000 + 1_000_000_000 + mono*11/10/1000 }
	for i := range int64(20) {
		mono := (1000 + 100*i) * ms
		sc.samples = append(sc.samples, storeSample{us: store(mono), mono: mono, rtt: 1000})
	}
	m, err := sc.mapping()
	if err != nil {
		t.Fatal(err)
	}
	for _, mono := range []int64{500 * ms, 1000 * ms, 1234 * ms, 2900 * ms, 4000 * ms} { // inside and beyond the samples
		if got := m.mono(store(mono)); got < mono-1000 || got > mono+1000 {
			t.Errorf("mono(store(%d)) = %d", mono, got)
		}
	}
	if s := m.String(); !strings.Contains(s, "rate 1.1000") {
		t.Errorf("String: %s", s)
	}
	// A clock that went backwards, and too few samples, cannot be mapped.
	sc.samples[5].us = sc.samples[4].us
	if _, err := sc.mapping(); err == nil {
		t.Error("a clock going backwards was mapped")
	}
	if _, err := (&storeClock{samples: sc.samples[:1]}).mapping(); err == nil {
		t.Error("one sample was enough")
	}
}

// A store on a clock of its own (an hour behind, 10 % fast): with the
// mapping, a holder told of its loss before the store's expiry passes; read
// by this host's clock, the expiry is an hour earlier and the notice late.
func TestCheckSkewedStoreClock(t *testing.T) {
	in := base()
	// w1 loses its lease (told at 600 ms; the store lets it expire at
	// 1090 ms), w2 is granted at 1100 ms and releases at 1300 ms.
	in.History = []LeaseEvent{
		in.History[0],
		{Seq: 2, Key: "k", Fence: 2, Token: in.History[2].Token, AtUs: 1_100_000, ExpUs: 2_100_000},
		{Seq: 3, Key: "k", Fence: 2, Token: in.History[2].Token, AtUs: 1_300_000, ExpUs: 1_300_000, Release: true},
	}
	ev := in.Workers[0].Events
	ev[3] = Event{T: 600 * ms, Ev: "done", K: "k", F: 1, OK: true, Err: "dlock: lock lost"}
	ev[4] = Event{T0: 600 * ms, T: 601 * ms, Ev: "rel", K: "k", F: 1, Err: "dlock: not held"}
	w2 := in.Workers[1].Events
	w2[0].T, w2[1].T0, w2[1].T, w2[2].T0, w2[2].T = 1110*ms, 1120*ms, 1130*ms, 1140*ms, 1150*ms
	w2[3].T, w2[4].T0, w2[4].T = 1300*ms, 1300*ms, 1301*ms
	in.ResLog = in.ResLog[:2]
	if r := check(in); r.Verdict != "PASS" {
		t.Fatalf("on this host's clock: %s %v", r.Verdict, r.ViolationList)
	}
	skew := func(us int64) int64 { return -3_600_000_000 + us*11/10 }
	for i := range in.History {
		in.History[i].AtUs = skew(in.History[i].AtUs)
		in.History[i].ExpUs = skew(in.History[i].ExpUs)
	}
	sc := &storeClock{}
	for i := range int64(30) {
		mono := 100 * i * ms
		sc.samples = append(sc.samples, storeSample{us: skew(mono / 1000), mono: mono})
	}
	m, err := sc.mapping()
	if err != nil {
		t.Fatal(err)
	}
	in.StoreClock = m
	r := check(in)
	if r.Verdict != "PASS" || r.StoreClock == "" || r.Lead.N != 1 || r.Lead.Min < 489 || r.Lead.Min > 491 {
		t.Fatalf("mapped: %s %v lead %+v %q", r.Verdict, r.ViolationList, r.Lead, r.StoreClock)
	}
	in.StoreClock = nil
	wantViolation(t, in, vLateNotice)
	// A negative lead within the mapping's error (samples 4 ms round trips:
	// ±2 ms) is not judged; one beyond it is a violation.
	for i := range sc.samples {
		sc.samples[i].rtt = 4 * ms
	}
	m, _ = sc.mapping()
	in.StoreClock = m
	in.Workers[0].Events[3].T = 1091 * ms // 1 ms after the expiry
	if r := check(in); r.Verdict != "PASS" || r.LeadInClockError != 1 {
		t.Errorf("1 ms late with ±2 ms of clock error: %s %v in error %d", r.Verdict, r.ViolationList, r.LeadInClockError)
	}
	in.Workers[0].Events[3].T = 1093 * ms
	wantViolation(t, in, vLateNotice)
}

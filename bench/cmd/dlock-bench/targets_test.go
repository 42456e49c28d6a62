package main

import (
	"bytes"
	"strings"
	"testing"
)

func ptr[T any](v T) *T { return &v }

// testRows is a run with PostgreSQL measured, ZooKeeper left out and etcd
// absent, and figures chosen to land on each side of each limit.
func testRows() []Row {
	return []Row{
		{Section: secFloor, Name: "ZooKeeper", Note: "left out: -zk off"},
		{Section: secFloor, Name: "raw GET_LOCK + fence upsert + RELEASE_LOCK", P50us: 100, OpsPerS: 1},
		{Section: secFloor, Name: "raw GET_LOCK + RELEASE_LOCK (no fencing)", P50us: 50, OpsPerS: 1},
		{Section: secFloor, Name: redisScriptsFloor, P50us: 40, OpsPerS: 1},
		{Section: secFloor, Name: etcdFloor, P50us: 1000, OpsPerS: 1},
		{Section: secFloor, Name: "raw BEGIN + FOR UPDATE NOWAIT + fence upsert + COMMIT", Note: "error: boom"},
		{Section: secUncontended, Name: mysqlGetLock, Floor: "raw GET_LOCK + fence upsert + RELEASE_LOCK", P50us: 109, OpsPerS: 1},
		{Section: secUncontended, Name: redisStrategy, Floor: redisScriptsFloor, P50us: 60, OpsPerS: 1},
		{Section: secUncontended, Name: mysqlRowLock, Floor: "raw BEGIN + FOR UPDATE NOWAIT + fence upsert + COMMIT", P50us: 60, OpsPerS: 1},
		{Section: secUncontended, Name: sqliteLease, P50us: 60, OpsPerS: 1},
		{Section: secUncontended, Name: pgLease, P50us: 60, OpsPerS: 1},
		{Section: secUncontended, Name: etcdStrategy, Floor: etcdFloor, P50us: 2000, OpsPerS: 1},
		{Section: secContended, Name: mysqlGetLock, Floor: rawGetLock, Handoffs: 950, OpsPerS: 1, MinShare: ptr(0.9)},
		{Section: secContended, Name: mysqlRowLock, Floor: rawForUpdate, Handoffs: 800, OpsPerS: 1, MinShare: ptr(0.3)},
		{Section: secContended, Name: pgAdvisory, Floor: rawPGAdvisory, Handoffs: 500, OpsPerS: 1},
		{Section: secContended, Name: rawPGAdvisory, Handoffs: 1000, OpsPerS: 1},
		{Section: secContended, Name: pgLease, Floor: naivePG, Handoffs: 600, OpsPerS: 1},
		{Section: secContended, Name: naivePG, Handoffs: 10, OpsPerS: 1},
		{Section: secContended, Name: mysqlLease, Floor: naive, Handoffs: 900, OpsPerS: 1},
		{Section: secContended, Name: redisStrategy, Floor: bsmRetry, Handoffs: 1000, OpsPerS: 1},
		{Section: secContended, Name: naive, OpsPerS: 1},
		{Section: secContended, Name: bsmRetry, Handoffs: 100, OpsPerS: 1},
		{Section: secContended, Name: redsyncDefaults, Floor: bsmRetry, Handoffs: 5, OpsPerS: 1},
		{Section: secContended, Name: rawGetLock, Handoffs: 1000, OpsPerS: 1},
		{Section: secContended, Name: rawGetLockFenced, Handoffs: 500, OpsPerS: 1},
		{Section: secContended, Name: rawForUpdate, Handoffs: 1000, OpsPerS: 1},
		{Section: secMany, Name: mysqlGetLock, Many: &Many{Locks: 10000, Goroutines: 12, Conns: ptr(3), PerPeriod: ptr(10.0), Unit: "statements"}},
		{Section: secMany, Name: mysqlLease, Many: &Many{Locks: 200, Goroutines: 200, Conns: ptr(5), PerPeriod: ptr(101.0), Unit: "statements", Lost: 2}},
		{Section: secMany, Name: redisStrategy, Many: &Many{Locks: 10000, Goroutines: 3, Conns: ptr(1), PerPeriod: ptr(10000.0),
			Unit: "commands", TripsPerPeriod: ptr(10.0), ServerEvalsPerPeriod: ptr(10000.0)}},
		{Section: secMany, Name: mysqlRowLock, Note: manySkipped[mysqlRowLock]},
		{Section: secMany, Name: pgLease, Note: "error after 7 locks: boom"},
	}
}

func TestEvaluateTargets(t *testing.T) {
	got := map[[2]string]Target{}
	for _, tg := range evaluateTargets(testRows()) {
		k := [2]string{tg.Target, tg.Subject}
		if _, dup := got[k]; dup {
			t.Errorf("target %q for %s twice", tg.Target, tg.Subject)
		}
		got[k] = tg
	}
	if want := len(allStrategies)*4 + 10 + len(fairStrategies); len(got) != want {
		t.Errorf("%d targets, want %d (every strategy for every target)", len(got), want)
	}
	for _, c := range []struct {
		target, subject, verdict string
		value                    float64 // checked when the verdict is met or missed
		reason                   string  // a substring of the reason
	}{
		{tOverhead, mysqlGetLock, met, 1.09, ""},
		{tOverhead, redisStrategy, missed, 1.5, ""},
		{tOverhead, mysqlRowLock, notMeasured, 0, "error: boom"},
		{tOverhead, sqliteLease, notMeasured, 0, "no row of this strategy's own raw SQL"},
		{tOverhead, pgLease, notMeasured, 0, "no row of this strategy's own raw SQL"},
		{tOverhead, etcdStrategy, notMeasured, 0, "not etcdlock's own"},
		{tOverhead, zkStrategy, notMeasured, 0, "ZooKeeper left out: -zk off"},
		{tOverhead, pgAdvisory, notMeasured, 0, "no row"},
		{tSession, mysqlGetLock, met, 0.95, ""},
		{tRowSession, mysqlRowLock, missed, 0.8, ""},
		{tSessionPG, pgAdvisory, missed, 0.5, ""},
		{tWakeUps, mysqlLease, notMeasured, 0, "measured no true handoffs"},
		{tWakeUpsPG, pgLease, met, 60, ""},
		{tRedis, redisStrategy, missed, 10, ""},
		{tRedsync, redisStrategy, met, 200, ""},
		{tFair, mysqlGetLock, met, 0.9, ""},
		{tFair, mysqlRowLock, missed, 0.3, ""},
		{tFair, pgLease, notMeasured, 0, "no shares"},
		{tFair, etcdStrategy, notMeasured, 0, "no row"},
		{tContended, zkStrategy, notMeasured, 0, "ZooKeeper left out"},
		{tConns, mysqlGetLock, met, 3, ""},
		{tConns, mysqlLease, missed, 5, "200 locks held, not 10,000; 2 locks lost"},
		{tConns, mysqlRowLock, notMeasured, 0, "one connection per held lock"},
		{tConns, pgLease, notMeasured, 0, "error after 7 locks"},
		{tStatements, mysqlGetLock, met, 10, ""},
		{tStatements, mysqlLease, missed, 101, ""},
		{tStatements, redisStrategy, missed, 10000, "judged on commands, not round trips"},
		{tGoroutines, mysqlGetLock, met, 0.0012, ""},
		{tGoroutines, mysqlLease, missed, 1, ""},
		{tGoroutines, etcdStrategy, notMeasured, 0, "no row"},
	} {
		tg, ok := got[[2]string{c.target, c.subject}]
		if !ok {
			t.Errorf("no target %q for %s", c.target, c.subject)
			continue
		}
		if tg.Verdict != c.verdict {
			t.Errorf("%q for %s: verdict %q (%s; %s), want %q", c.target, c.subject, tg.Verdict, tg.Measured, tg.Reason, c.verdict)
		}
		if c.verdict != notMeasured && (tg.Value == nil || *tg.Value < c.value*0.999 || *tg.Value > c.value*1.001) {
			t.Errorf("%q for %s: value %v, want %v", c.target, c.subject, tg.Value, c.value)
		}
		if c.verdict == notMeasured && tg.Value != nil {
			t.Errorf("%q for %s: not measured but has value %v", c.target, c.subject, *tg.Value)
		}
		if !strings.Contains(tg.Reason, c.reason) {
			t.Errorf("%q for %s: reason %q, want it to contain %q", c.target, c.subject, tg.Reason, c.reason)
		}
	}
	if m := got[[2]string{tStatements, redisStrategy}].Measured; !strings.Contains(m, "10 round trips") || !strings.Contains(m, "server: 10000") {
		t.Errorf("Redis renewal measured %q, want commands, round trips and the server's count", m)
	}
	if m := got[[2]string{tSession, mysqlGetLock}].Measured; !strings.Contains(m, "1.90× "+rawGetLockFenced) {
		t.Errorf("getlock handoffs measured %q, want the ratio to the fenced floor too", m)
	}
}

func TestReportTargets(t *testing.T) {
	var b bytes.Buffer
	reportTargets(&b, []Target{{Target: tConns, Subject: mysqlLease, Verdict: notMeasured, Reason: "a | b"}})
	if !strings.Contains(b.String(), `| not measured: a \| b |`) {
		t.Errorf("report:\n%s\nwant the reason in the verdict cell, its pipe escaped", b.String())
	}
}

package torture

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/internal/testproc"
	"github.com/dlock-dev/dlock/zklock"
)

// zkScript builds a transaction log by hand for the replay's tests: one key ("k", directory
// /r/kk) under the root /r.
type zkScript struct {
	txns []zkTxn
	zxid int64
}

const zkTestRoot = "/r"

// txn appends a transaction of session at timeMs (a multi if there are several ops) and returns
// its zxid.
func (s *zkScript) txn(session, timeMs int64, ops ...zkOp) int64 {
	s.zxid++
	typ := ops[0].Type
	if len(ops) > 1 {
		typ = zkOpMulti
	}
	s.txns = append(s.txns, zkTxn{Session: session, Zxid: s.zxid, TimeMs: timeMs, Type: typ, Ops: ops})
	return s.zxid
}

func zkNodePath(seq int) string { return fmt.Sprintf("%s/kk/n-%010d", zkTestRoot, seq) }

// zkCreate is zklock's enqueue: a queue node with a request token and a 1 s lease (and the
// directory, the first time).
func zkCreate(seq int, token string) zkOp {
	return zkOp{Type: zkOpCreate, Path: zkNodePath(seq), Ephemeral: true, Data: zkData(token)}
}

func zkData(token string) []byte { return []byte(`{"token":"` + token + `","ttl_ms":1000}`) }

func zkSet(seq int, token string) zkOp {
	return zkOp{Type: zkOpSetData, Path: zkNodePath(seq), Data: zkData(token)}
}

func zkDel(seq int) zkOp { return zkOp{Type: zkOpDelete, Path: zkNodePath(seq)} }

var zkDir = zkOp{Type: zkOpCreateContainer, Path: zkTestRoot + "/kk"}

// Sessions of the replay's tests.
const (
	sessA = int64(0xa)
	sessB = int64(0xb)
	sessC = int64(0xc)
)

func zkTok(owner, writer int64) [16]byte {
	var t [16]byte
	binary.BigEndian.PutUint64(t[:8], uint64(owner))
	binary.BigEndian.PutUint64(t[8:], uint64(writer))
	return t
}

func replay(t *testing.T, s *zkScript) ([]LeaseEvent, *zkReplayStats) {
	t.Helper()
	evs, stats, err := zkLeaseEvents(s.txns, zkTestRoot)
	if err != nil {
		t.Fatal(err)
	}
	return evs, stats
}

func wantEvents(t *testing.T, got, want []LeaseEvent) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("got %d events, want %d:\n got %+v\nwant %+v", len(got), len(want), got, want)
	}
	for i := range got {
		if got[i] != want[i] {
			t.Errorf("event %d:\n got %+v\nwant %+v", i, got[i], want[i])
		}
	}
}

// storeCheck runs the checker's store checks on a history alone.
func storeCheck(evs []LeaseEvent) *RunReport {
	return check(checkInput{Name: "zk", Strategy: "zk-lease", TTL: time.Second, HasHistory: true, History: evs})
}

func TestZKReplayGrantExtendReleaseHandoff(t *testing.T) {
	var s zkScript
	s.txn(sessA, 1000, zkDir)
	a := s.txn(sessA, 1000, zkCreate(0, "a1"), zkOp{Type: zkOpSetData, Path: zkTestRoot + "/kk"}) // enqueue: free, granted
	s.txn(sessA, 1300, zkSet(0, "a1"))                                                            // extension
	b := s.txn(sessB, 1400, zkCreate(1, "b1"))                                                    // queued
	s.txn(sessA, 1500, zkSet(0, "a1"), zkDel(0))                                                  // release (zklock's multi)
	s.txn(sessB, 1600, zkSet(1, "b1"))                                                            // extension at the grant
	s.txn(sessB, 1700, zkDel(1))                                                                  // release
	s.txn(0, 1800, zkOp{Type: zkOpDeleteContainer, Path: zkTestRoot + "/kk"})
	evs, stats := replay(t, &s)
	ta, tb := zkTok(sessA, sessA), zkTok(sessB, sessB)
	wantEvents(t, evs, []LeaseEvent{
		{Seq: a, Key: "k", Fence: uint64(a), Token: ta, AtUs: 1000e3, ExpUs: 2000e3},
		{Seq: a + 1, Key: "k", Fence: uint64(a), Token: ta, AtUs: 1300e3, ExpUs: 2300e3},
		{Seq: a + 3, Key: "k", Fence: uint64(a), Token: ta, AtUs: 1500e3, ExpUs: 1500e3, Release: true},
		{Seq: a + 3, Key: "k", Fence: uint64(b), Token: tb, AtUs: 1500e3, ExpUs: 2400e3}, // the queued node's lease: its create + 1 s
		{Seq: a + 4, Key: "k", Fence: uint64(b), Token: tb, AtUs: 1600e3, ExpUs: 2600e3},
		{Seq: a + 5, Key: "k", Fence: uint64(b), Token: tb, AtUs: 1700e3, ExpUs: 1700e3, Release: true},
	})
	if r := storeCheck(evs); r.ViolationCount != 0 || r.Grants != 2 || r.Handoffs != 1 {
		t.Errorf("checker: %d violations %v, %d grants, %d handoffs", r.ViolationCount, r.ViolationList, r.Grants, r.Handoffs)
	}
	if stats.Grants != 2 || stats.Extensions != 2 || stats.Releases != 2 {
		t.Errorf("stats: %s", stats)
	}
}

// The key's change journal (zklock.JournalNode under the key's directory), written in the same
// transaction as a release, holds no lease: the replay leaves it out, and the key's directory is
// deleted once the journal is gone.
func TestZKReplayIgnoresTheJournal(t *testing.T) {
	var s zkScript
	jdir := zkTestRoot + "/kk/" + zklock.JournalNode
	entry := func(seq int) zkOp {
		return zkOp{Type: zkOpCreate, Path: fmt.Sprintf("%s/e-%010d", jdir, seq), Ephemeral: true, Data: []byte(`{"kind":"released"}`)}
	}
	s.txn(sessA, 1000, zkDir)
	a := s.txn(sessA, 1000, zkCreate(0, "a1"), zkOp{Type: zkOpSetData, Path: zkTestRoot + "/kk"})
	s.txn(sessA, 1100, zkOp{Type: zkOpCreateContainer, Path: jdir})
	s.txn(sessA, 1500, zkSet(0, "a1"), zkDel(0), entry(0), zkOp{Type: zkOpSetData, Path: jdir})
	s.txn(0, 1700, zkOp{Type: zkOpCloseSession})
	s.txn(0, 1800, zkOp{Type: zkOpDeleteContainer, Path: jdir})
	s.txn(0, 1900, zkOp{Type: zkOpDeleteContainer, Path: zkTestRoot + "/kk"})
	evs, _ := replay(t, &s)
	ta := zkTok(sessA, sessA)
	wantEvents(t, evs, []LeaseEvent{
		{Seq: a, Key: "k", Fence: uint64(a), Token: ta, AtUs: 1000e3, ExpUs: 2000e3},
		{Seq: a + 2, Key: "k", Fence: uint64(a), Token: ta, AtUs: 1500e3, ExpUs: 1500e3, Release: true},
	})
}

// A holder whose lease runs out ends at its expiry; the contender's deletion is cleanup, and the
// contender's node is granted at the deletion with its own lease.
func TestZKReplayExpiryAndTakeover(t *testing.T) {
	var s zkScript
	s.txn(sessA, 1000, zkDir)
	a := s.txn(sessA, 1000, zkCreate(0, "a1"))
	b := s.txn(sessB, 1500, zkCreate(1, "b1"))
	s.txn(sessB, 2000, zkDel(0)) // at the expiry: expired for zklock (end <= now)
	s.txn(sessB, 2001, zkSet(1, "b1"))
	evs, stats := replay(t, &s)
	wantEvents(t, evs, []LeaseEvent{
		{Seq: a, Key: "k", Fence: uint64(a), Token: zkTok(sessA, sessA), AtUs: 1000e3, ExpUs: 2000e3},
		{Seq: b + 1, Key: "k", Fence: uint64(b), Token: zkTok(sessB, sessB), AtUs: 2000e3, ExpUs: 2500e3},
		{Seq: b + 2, Key: "k", Fence: uint64(b), Token: zkTok(sessB, sessB), AtUs: 2001e3, ExpUs: 3001e3},
	})
	if r := storeCheck(evs); r.ViolationCount != 0 {
		t.Errorf("checker: %v", r.ViolationList)
	}
	if stats.Expired != 1 || stats.Releases != 0 {
		t.Errorf("stats: %s", stats)
	}
}

// A queued node that reaches the head with its lease run out (its owner died) holds nothing; a
// waiter refreshes its own node and deletes it, and is granted then.
func TestZKReplayDeadHead(t *testing.T) {
	var s zkScript
	s.txn(sessA, 1000, zkDir)
	a := s.txn(sessA, 1000, zkCreate(0, "a1"))
	s.txn(sessC, 1100, zkCreate(1, "c1")) // C dies queued
	b := s.txn(sessB, 1200, zkCreate(2, "b1"))
	s.txn(sessA, 1900, zkDel(0)) // A releases in time; C's node (until 2100) is granted, nobody takes it up
	s.txn(sessB, 2590, zkSet(2, "b1"))
	s.txn(sessB, 2600, zkDel(1)) // C's lease ran out at 2100: cleanup
	evs, stats := replay(t, &s)
	wantEvents(t, evs, []LeaseEvent{
		{Seq: a, Key: "k", Fence: uint64(a), Token: zkTok(sessA, sessA), AtUs: 1000e3, ExpUs: 2000e3},
		{Seq: b + 1, Key: "k", Fence: uint64(a), Token: zkTok(sessA, sessA), AtUs: 1900e3, ExpUs: 1900e3, Release: true},
		{Seq: b + 1, Key: "k", Fence: uint64(a + 1), Token: zkTok(sessC, sessC), AtUs: 1900e3, ExpUs: 2100e3},
		{Seq: b + 3, Key: "k", Fence: uint64(b), Token: zkTok(sessB, sessB), AtUs: 2600e3, ExpUs: 3590e3},
	})
	if stats.DeadHeads != 0 {
		t.Errorf("stats: %s", stats)
	}

	// The same, with A releasing after C's lease ran out: C's node is never granted.
	s = zkScript{}
	s.txn(sessA, 1000, zkDir)
	a = s.txn(sessA, 1000, zkCreate(0, "a1"))
	s.txn(sessA, 1300, zkSet(0, "a1"))
	s.txn(sessC, 1350, zkCreate(1, "c1"))
	b = s.txn(sessB, 1400, zkCreate(2, "b1"))
	s.txn(sessA, 1900, zkSet(0, "a1"))
	s.txn(sessA, 2500, zkDel(0))
	s.txn(sessB, 2590, zkSet(2, "b1"))
	s.txn(sessB, 2600, zkDel(1))
	evs, stats = replay(t, &s)
	tokA := zkTok(sessA, sessA)
	wantEvents(t, evs, []LeaseEvent{
		{Seq: a, Key: "k", Fence: uint64(a), Token: tokA, AtUs: 1000e3, ExpUs: 2000e3},
		{Seq: a + 1, Key: "k", Fence: uint64(a), Token: tokA, AtUs: 1300e3, ExpUs: 2300e3},
		{Seq: b + 1, Key: "k", Fence: uint64(a), Token: tokA, AtUs: 1900e3, ExpUs: 2900e3},
		{Seq: b + 2, Key: "k", Fence: uint64(a), Token: tokA, AtUs: 2500e3, ExpUs: 2500e3, Release: true},
		{Seq: b + 4, Key: "k", Fence: uint64(b), Token: zkTok(sessB, sessB), AtUs: 2600e3, ExpUs: 3590e3},
	})
	if stats.DeadHeads != 1 {
		t.Errorf("stats: %s", stats)
	}
	if r := storeCheck(evs); r.ViolationCount != 0 {
		t.Errorf("checker: %v", r.ViolationList)
	}
}

// A renewal that lands after the expiry does not extend the lease (zklock deletes the node and
// reports the loss); the node blocks the key until then.
func TestZKReplayLateRenewalIsNoExtension(t *testing.T) {
	var s zkScript
	s.txn(sessA, 1000, zkDir)
	a := s.txn(sessA, 1000, zkCreate(0, "a1"))
	b := s.txn(sessB, 1500, zkCreate(1, "b1"))
	s.txn(sessA, 2000, zkSet(0, "a1")) // exactly at the expiry: too late for a contender's rule
	s.txn(sessA, 2003, zkDel(0))
	evs, stats := replay(t, &s)
	wantEvents(t, evs, []LeaseEvent{
		{Seq: a, Key: "k", Fence: uint64(a), Token: zkTok(sessA, sessA), AtUs: 1000e3, ExpUs: 2000e3},
		{Seq: b + 2, Key: "k", Fence: uint64(b), Token: zkTok(sessB, sessB), AtUs: 2003e3, ExpUs: 2500e3},
	})
	if stats.Zombies != 1 || stats.ZombieMs != 3 || stats.Extensions != 0 {
		t.Errorf("stats: %s", stats)
	}
	if r := storeCheck(evs); r.ViolationCount != 0 {
		t.Errorf("checker: %v", r.ViolationList)
	}
}

// A node whose lease ran out, rewritten for a new request (a parked node taken up late), is a
// zombie like a late renewal: zklock deletes it and queues a new node, which is granted with a
// new fence. A zklock that kept the node would hand its fence out again after the lease's end,
// and the checker reports that holder as keeping the lock past the store's expiry.
func TestZKReplayLateTakeUpIsNoGrant(t *testing.T) {
	var s zkScript
	s.txn(sessA, 1000, zkDir)
	a := s.txn(sessA, 1000, zkCreate(0, "a1"))
	s.txn(sessA, 2500, zkSet(0, "a2"))
	s.txn(sessA, 2502, zkDel(0))
	c := s.txn(sessA, 2503, zkCreate(1, "a2"))
	evs, stats := replay(t, &s)
	tok := zkTok(sessA, sessA)
	wantEvents(t, evs, []LeaseEvent{
		{Seq: a, Key: "k", Fence: uint64(a), Token: tok, AtUs: 1000e3, ExpUs: 2000e3},
		{Seq: c, Key: "k", Fence: uint64(c), Token: tok, AtUs: 2503e3, ExpUs: 3503e3},
	})
	if stats.Zombies != 1 || stats.LateTakeUps != 1 || stats.ZombieMs != 2 || stats.Grants != 2 {
		t.Errorf("stats: %s", stats)
	}
	if r := storeCheck(evs); r.ViolationCount != 0 {
		t.Errorf("checker: %v", r.ViolationList)
	}

	// The same node kept and renewed: its holder acquired it after the store's expiry.
	s = zkScript{}
	s.txn(sessA, 1000, zkDir)
	a = s.txn(sessA, 1000, zkCreate(0, "a1"))
	s.txn(sessA, 2500, zkSet(0, "a2"))
	s.txn(sessA, 2800, zkSet(0, "a2"))
	s.txn(sessA, 3100, zkDel(0))
	evs, _ = replay(t, &s)
	in := checkInput{
		Name: "zk", Strategy: "zk-lease", TTL: time.Second, HasHistory: true, History: evs,
		Started: 0, Ended: 10_000 * ms,
		Workers: []*workerLog{{ID: "w1", Events: []Event{
			{T0: 2400 * ms, T: 2510 * ms, Ev: "acq", K: "k", F: uint64(a)},
			{T: 3100 * ms, Ev: "done", K: "k", F: uint64(a), Err: "dlock: not held"},
			{T0: 3100 * ms, T: 3101 * ms, Ev: "rel", K: "k", F: uint64(a)},
		}}},
	}
	if r := check(in); r.Violations[vNoNotice] != 1 {
		t.Errorf("a fence held after its lease's end: %v", r.ViolationList)
	}
}

// zklock reuses a queued node for the Locker's next request; if it holds already, its request
// token changes under the same fence and session: not an owner change.
func TestZKReplayRequestTokenRewrite(t *testing.T) {
	var s zkScript
	s.txn(sessA, 1000, zkDir)
	a := s.txn(sessA, 1000, zkCreate(0, "a1"))
	s.txn(sessA, 1100, zkSet(0, "a2"))
	evs, stats := replay(t, &s)
	wantEvents(t, evs, []LeaseEvent{
		{Seq: a, Key: "k", Fence: uint64(a), Token: zkTok(sessA, sessA), AtUs: 1000e3, ExpUs: 2000e3},
		{Seq: a + 1, Key: "k", Fence: uint64(a), Token: zkTok(sessA, sessA), AtUs: 1100e3, ExpUs: 2100e3},
	})
	if stats.RequestSwaps != 1 {
		t.Errorf("stats: %s", stats)
	}
	if r := storeCheck(evs); r.ViolationCount != 0 {
		t.Errorf("checker: %v", r.ViolationList)
	}
}

// Another session's write to the holder's node is an owner change without a new fence.
func TestZKReplayForeignWriteIsTokenSwap(t *testing.T) {
	var s zkScript
	s.txn(sessA, 1000, zkDir)
	s.txn(sessA, 1000, zkCreate(0, "a1"))
	s.txn(sessB, 1100, zkSet(0, "b1"))
	evs, _ := replay(t, &s)
	if r := storeCheck(evs); r.Violations[vTokenSwap] != 1 {
		t.Errorf("checker: %v", r.ViolationList)
	}
}

// Another session deleting a live holder (which zklock never does) shows as a grant while the
// lease was live.
func TestZKReplayForeignDeleteIsGrantWhileHeld(t *testing.T) {
	var s zkScript
	s.txn(sessA, 1000, zkDir)
	s.txn(sessA, 1000, zkCreate(0, "a1"))
	s.txn(sessB, 1500, zkCreate(1, "b1"))
	s.txn(sessB, 1600, zkDel(0))
	evs, stats := replay(t, &s)
	if stats.ForeignEnds != 1 {
		t.Errorf("stats: %s", stats)
	}
	if r := storeCheck(evs); r.Violations[vGrantWhileHeld] != 1 {
		t.Errorf("checker: %v", r.ViolationList)
	}
}

// The end of the holder's session ends its lease at once (not a release); closeSession's list
// must agree with the replay's, leaving out the mode keys' nodes, which the replay does not follow.
func TestZKReplaySessionEnd(t *testing.T) {
	var s zkScript
	s.txn(sessA, 1000, zkDir)
	a := s.txn(sessA, 1000, zkCreate(0, "a1"))
	b := s.txn(sessB, 1100, zkCreate(1, "b1"))
	s.txn(sessA, 1200, zkOp{Type: zkOpCloseSession, HasPaths: true, Paths2Delete: []string{zkNodePath(0), "/other/x", zkTestRoot + "/k" + rwKey + "/n-0000000007"}})
	s.txn(sessB, 1300, zkOp{Type: zkOpCloseSession}) // no list (ZooKeeper < 3.6): the replay's own
	evs, stats := replay(t, &s)
	wantEvents(t, evs, []LeaseEvent{
		{Seq: a, Key: "k", Fence: uint64(a), Token: zkTok(sessA, sessA), AtUs: 1000e3, ExpUs: 2000e3},
		{Seq: b + 1, Key: "k", Fence: uint64(a), Token: zkTok(sessA, sessA), AtUs: 1200e3, ExpUs: 1200e3},
		{Seq: b + 1, Key: "k", Fence: uint64(b), Token: zkTok(sessB, sessB), AtUs: 1200e3, ExpUs: 2100e3},
		{Seq: b + 2, Key: "k", Fence: uint64(b), Token: zkTok(sessB, sessB), AtUs: 1300e3, ExpUs: 1300e3},
	})
	if stats.SessionEnded != 2 {
		t.Errorf("stats: %s", stats)
	}
	if r := storeCheck(evs); r.ViolationCount != 0 {
		t.Errorf("checker: %v", r.ViolationList)
	}

	s = zkScript{}
	s.txn(sessA, 1000, zkDir)
	s.txn(sessA, 1000, zkCreate(0, "a1"))
	s.txn(sessA, 1200, zkOp{Type: zkOpCloseSession, HasPaths: true})
	if _, _, err := zkLeaseEvents(s.txns, zkTestRoot); err == nil || !strings.Contains(err.Error(), "closeSession") {
		t.Errorf("closeSession listing fewer nodes than the replay: %v", err)
	}
}

// Failed requests change nothing; other roots are ignored.
func TestZKReplayIgnoresFailuresAndOtherRoots(t *testing.T) {
	var s zkScript
	s.txn(sessA, 1000, zkDir)
	s.txn(sessA, 1000, zkOp{Type: zkOpError, Err: -101}, zkOp{Type: zkOpError, Err: -2})
	s.txn(sessA, 1000, zkOp{Type: zkOpCreate, Path: "/r2/kk/n-0000000000", Data: zkData("x")})
	a := s.txn(sessA, 1001, zkCreate(0, "a1"))
	evs, stats := replay(t, &s)
	wantEvents(t, evs, []LeaseEvent{{Seq: a, Key: "k", Fence: uint64(a), Token: zkTok(sessA, sessA), AtUs: 1001e3, ExpUs: 2001e3}})
	if stats.Failed != 1 {
		t.Errorf("stats: %s", stats)
	}
}

// TestZKHistory runs zk-lease's Prepare, Open and History against a real ZooKeeper (started here;
// see testproc.StartZooKeeper): a handoff from a releasing holder to a waiter, and a takeover
// from a holder that stopped renewing, must come out of the transaction log with the fences the
// Lockers were given and the store's instants.
func TestZKHistory(t *testing.T) {
	addr, dataDir := testproc.StartZooKeeper(t)
	env := &Env{Tag: "zkhist", Dir: t.TempDir(), ZKAddr: addr, ZKDataDir: dataDir, TTL: time.Second}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	store, err := zkLease.Prepare(ctx, env)
	if err != nil {
		t.Fatal(err)
	}
	open := func() (*dlock.Locker, *zklock.Backend) {
		b, closeB, err := zkLease.Open(ctx, OpenArgs{Store: store, Addr: addr})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { closeB() })
		return dlock.New(b, &dlock.Options{TTL: time.Second}), b.(*zklock.Backend)
	}
	la, _ := open()
	lb, bb := open()
	defer la.Close(ctx)
	defer lb.Close(ctx)

	// Handoff: A holds across renewals, B waits in the store, A releases.
	t0 := time.Now()
	ka, err := la.Acquire(ctx, "k/1")
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan *dlock.Lock, 1)
	go func() {
		kb, err := lb.Acquire(ctx, "k/1")
		if err != nil {
			t.Error(err)
		}
		got <- kb
	}()
	time.Sleep(1500 * time.Millisecond)
	released := time.Now()
	if err := ka.Release(ctx); err != nil {
		t.Fatal(err)
	}
	kb := <-got
	if kb == nil {
		t.FailNow()
	}
	if err := kb.Release(ctx); err != nil {
		t.Fatal(err)
	}

	// Takeover: B's backend takes a lease that nobody renews; A's Locker takes the key after it
	// ran out.
	res, err := bb.Acquire(ctx, dlock.Request{Key: "k/2", Token: dlock.NewToken(), TTL: time.Second})
	if err != nil || !res.Acquired {
		t.Fatal(res, err)
	}
	kc, err := la.Acquire(ctx, "k/2")
	if err != nil {
		t.Fatal(err)
	}
	if err := kc.Release(ctx); err != nil {
		t.Fatal(err)
	}

	evs, err := zkLease.History(ctx, env, store)
	if err != nil {
		t.Fatal(err)
	}
	byKey := map[string][]LeaseEvent{}
	for _, e := range evs {
		byKey[e.Key] = append(byKey[e.Key], e)
	}
	for _, e := range evs {
		t.Logf("%+v", e)
	}
	ms := func(us int64) time.Time { return time.UnixMicro(us) }
	// k/1: A's grant, its renewals, its release, B's grant (at A's release), B's release.
	k1 := byKey["k/1"]
	if len(k1) < 5 || k1[0].Fence != ka.Fence() || k1[len(k1)-1].Fence != kb.Fence() || !k1[len(k1)-1].Release {
		t.Fatalf("k/1 history: %+v (fences %d, %d)", k1, ka.Fence(), kb.Fence())
	}
	var aRel, bGrant *LeaseEvent
	ext := 0
	for i := range k1 {
		e := &k1[i]
		switch {
		case e.Fence == ka.Fence() && e.Release:
			aRel = e
		case e.Fence == ka.Fence() && i > 0:
			ext++
		case e.Fence == kb.Fence() && bGrant == nil:
			bGrant = e
		}
	}
	if aRel == nil || bGrant == nil || bGrant.AtUs != aRel.AtUs || ext < 3 {
		t.Fatalf("k/1: release %+v, B's grant %+v, %d extensions of A", aRel, bGrant, ext)
	}
	if d := ms(aRel.AtUs).Sub(released); d < -5*time.Millisecond || d > time.Second {
		t.Errorf("A's release at the store %s after Release was called", d)
	}
	if d := ms(k1[0].AtUs).Sub(t0); d < -5*time.Millisecond || d > time.Second {
		t.Errorf("A's grant at the store %s after Acquire was called", d)
	}
	// k/2: B's grant (never renewed, no release), A's grant at or after B's expiry.
	k2 := byKey["k/2"]
	if len(k2) < 3 || k2[0].Fence != res.Fence || k2[0].Release || k2[1].Fence != kc.Fence() || !k2[len(k2)-1].Release {
		t.Fatalf("k/2 history: %+v (fences %d, %d)", k2, res.Fence, kc.Fence())
	}
	if k2[1].AtUs < k2[0].ExpUs || k2[0].ExpUs-k2[0].AtUs != 1e6 {
		t.Errorf("k/2: A granted at %d µs, B's lease %d..%d µs", k2[1].AtUs, k2[0].AtUs, k2[0].ExpUs)
	}
	if r := storeCheck(evs); r.ViolationCount != 0 {
		t.Errorf("checker: %v", r.ViolationList)
	}
	note, err := os.ReadFile(filepath.Join(env.Dir, "zk-history.txt"))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%s", note)

	// Prepare again with the same tag: leftovers go, and the new history starts empty.
	store2, err := zkLease.Prepare(ctx, env)
	if err != nil {
		t.Fatal(err)
	}
	if evs, err := zkLease.History(ctx, env, store2); err != nil || len(evs) != 0 {
		t.Errorf("a fresh root's history: %v, %v", evs, err)
	}
	if _, err := zkLease.History(ctx, &Env{ZKAddr: addr}, store2); !errors.Is(err, errNoZKLog) {
		t.Errorf("History without a dataDir: %v", err)
	}
}

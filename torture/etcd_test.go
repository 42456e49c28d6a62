package torture

import (
	"context"
	"fmt"
	"reflect"
	"strings"
	"testing"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/etcdlock"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// The derivation of etcd-lease's history from watch changes, on synthetic
// changes (no server).

const etcdPrefix = "/torture/t0/"

// etcdName is the entry of key (already escaped) for lease id.
func etcdName(esc string, id uint64) string { return fmt.Sprintf("%s%s/%016x", etcdPrefix, esc, id) }

func etcdValue(tok byte) string {
	return `{"token":"` + dlock.Token{tok}.String() + `","owner":"w","acquired_us":1}`
}

// put is an entry written at rev (created then if create == rev), received at
// recv µs; its token is {tok}.
func put(rev int64, name string, create int64, tok byte, recv int64) etcdChange {
	return etcdChange{Rev: rev, Name: name, Create: create, Value: etcdValue(tok), RecvUs: recv}
}

func del(rev int64, name string, create int64, recv int64) etcdChange {
	return etcdChange{Rev: rev, Delete: true, Name: name, Create: create, RecvUs: recv}
}

func grant(key string, fence uint64, tok byte, at int64) LeaseEvent {
	return LeaseEvent{Key: key, Fence: fence, Token: [16]byte{tok}, AtUs: at, ExpUs: liveUntilDeleted}
}

func ended(key string, fence uint64, tok byte, at int64) LeaseEvent {
	return LeaseEvent{Key: key, Fence: fence, Token: [16]byte{tok}, AtUs: at, ExpUs: at}
}

func TestEtcdHistory(t *testing.T) {
	a, b, c := etcdName("k0", 0xa), etcdName("k0", 0xb), etcdName("k0", 0xc)
	for _, tc := range []struct {
		name    string
		changes []etcdChange
		want    []LeaseEvent
		live    int
	}{{
		name:    "grant on an empty directory, then its release",
		changes: []etcdChange{put(10, a, 10, 1, 1000), del(12, a, 10, 3000)},
		want:    []LeaseEvent{grant("k0", 10, 1, 1000), ended("k0", 10, 1, 3000)},
	}, {
		name: "a queued waiter is granted when the holder's entry goes",
		changes: []etcdChange{put(10, a, 10, 1, 1000), put(11, b, 11, 2, 1100),
			del(12, a, 10, 2000), del(13, b, 11, 2500)},
		want: []LeaseEvent{grant("k0", 10, 1, 1000), ended("k0", 10, 1, 2000), grant("k0", 11, 2, 2000),
			ended("k0", 11, 2, 2500)},
	}, {
		name: "a waiter deleted before its turn is never granted",
		changes: []etcdChange{put(10, a, 10, 1, 1000), put(11, b, 11, 2, 1100), put(12, c, 12, 3, 1200),
			del(13, b, 11, 1300), del(14, a, 10, 2000), del(15, c, 12, 2100)},
		want: []LeaseEvent{grant("k0", 10, 1, 1000), ended("k0", 10, 1, 2000), grant("k0", 12, 3, 2000),
			ended("k0", 12, 3, 2100)},
	}, {
		name: "an acquisition that cannot wait takes an emptied directory",
		changes: []etcdChange{put(10, a, 10, 1, 1000), del(11, a, 10, 2000), put(12, b, 12, 2, 2100),
			del(13, b, 12, 2200)},
		want: []LeaseEvent{grant("k0", 10, 1, 1000), ended("k0", 10, 1, 2000), grant("k0", 12, 2, 2100),
			ended("k0", 12, 2, 2200)},
	}, {
		name: "a parked place that reached the head is taken over with a new token",
		changes: []etcdChange{put(10, a, 10, 1, 1000), put(11, b, 11, 2, 1100), del(12, a, 10, 2000),
			put(13, b, 11, 3, 2010), del(14, b, 11, 2500)},
		want: []LeaseEvent{grant("k0", 10, 1, 1000), ended("k0", 10, 1, 2000), grant("k0", 11, 3, 2000),
			ended("k0", 11, 3, 2500)},
	}, {
		name: "a waiter's place taken over before its turn changes nothing",
		changes: []etcdChange{put(10, a, 10, 1, 1000), put(11, b, 11, 2, 1100), put(12, b, 11, 3, 1400),
			del(13, a, 10, 2000)},
		want: []LeaseEvent{grant("k0", 10, 1, 1000), ended("k0", 10, 1, 2000), grant("k0", 11, 3, 2000)},
		live: 1,
	}, {
		name: "one revision that deletes the holder and the next entry",
		changes: []etcdChange{put(10, a, 10, 1, 1000), put(11, b, 11, 2, 1100), put(12, c, 12, 3, 1200),
			del(13, a, 10, 2000), del(13, b, 11, 2000)},
		want: []LeaseEvent{grant("k0", 10, 1, 1000), ended("k0", 10, 1, 2000), grant("k0", 12, 3, 2000)},
		live: 1,
	}, {
		name: "several keys, escaped ones among them, in any order of arrival",
		changes: []etcdChange{
			put(10, etcdName("a%2Fb", 1), 10, 1, 1000),
			put(11, etcdName("100%25", 2), 11, 2, 1100),
			put(12, etcdName("a%2Fb", 3), 12, 3, 1200),
			del(14, etcdName("100%25", 2), 11, 1400), // received out of order: sorted by revision
			del(13, etcdName("a%2Fb", 1), 10, 1300),
			put(15, etcdName("100%25", 4), 15, 4, 1500),
		},
		want: []LeaseEvent{grant("a/b", 10, 1, 1000), grant("100%", 11, 2, 1100),
			ended("a/b", 10, 1, 1300), grant("a/b", 12, 3, 1300), ended("100%", 11, 2, 1400), grant("100%", 15, 4, 1500)},
		live: 2,
	}} {
		t.Run(tc.name, func(t *testing.T) {
			got, live, err := etcdHistory(etcdPrefix, tc.changes)
			if err != nil {
				t.Fatal(err)
			}
			for i := range tc.want {
				tc.want[i].Seq = int64(i + 1)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("history:\n got %v\nwant %v", got, tc.want)
			}
			if live != tc.live {
				t.Errorf("live entries: got %d, want %d", live, tc.live)
			}
		})
	}
}

// TestEtcdHistoryIncomplete checks that changes the record cannot explain
// are errors, not a silently different history.
func TestEtcdHistoryIncomplete(t *testing.T) {
	a := etcdName("k0", 0xa)
	for name, changes := range map[string][]etcdChange{
		"not an entry":                {put(10, etcdPrefix+"k0", 10, 1, 1)},
		"deletion of an unseen entry": {del(10, a, 9, 1)},
		"entry older than the record": {put(10, a, 9, 1, 1)},
		"entry recreated in place":    {put(10, a, 10, 1, 1), put(11, a, 11, 1, 2)},
		"value without a token":       {{Rev: 10, Name: a, Create: 10, Value: `{"owner":"x"}`}},
	} {
		if _, _, err := etcdHistory(etcdPrefix, changes); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

// listClient answers etcdlock's List from kvs and records the key it was
// asked for; nothing else of etcdlock.Client is used.
type listClient struct {
	etcdlock.Client
	kvs  []*mvccpb.KeyValue
	from string
}

func (c *listClient) Get(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.GetResponse, error) {
	c.from = key
	return &clientv3.GetResponse{Kvs: c.kvs}, nil
}

// TestEtcdEntryKeyAsEtcdlock checks etcdEntryKey and etcdToken against
// etcdlock itself: its escaping (the start of List's range), how it reads an
// entry's key and token back (List's result), and which keys it takes for
// entries.
func TestEtcdEntryKeyAsEtcdlock(t *testing.T) {
	c := &listClient{}
	b, err := etcdlock.New(c, &etcdlock.Options{Prefix: etcdPrefix})
	if err != nil {
		t.Fatal(err)
	}
	for i, key := range []string{"k0", "a/b", "100%", "%2F", "%252F/", "x%25/y//", "ünï/%/"} {
		if _, err := b.List(context.Background(), key); err != nil {
			t.Fatal(err)
		}
		esc, ok := strings.CutPrefix(c.from, etcdPrefix)
		if !ok || strings.Contains(esc, "/") {
			t.Fatalf("%q: etcdlock listed from %q", key, c.from)
		}
		name := etcdName(esc, uint64(0xfeed0000+i))
		if got, ok := etcdlock.EntryKey(etcdPrefix, name); !ok || got != key {
			t.Errorf("etcdlock.EntryKey(%q) = %q, %v; want %q", name, got, ok, key)
		}
		c.kvs = []*mvccpb.KeyValue{{Key: []byte(name), CreateRevision: 42, Value: []byte(etcdValue(byte(i + 1)))}}
		infos, err := b.List(context.Background(), "")
		c.kvs = nil
		if err != nil {
			t.Fatal(err)
		}
		tok, _, err := etcdToken(etcdValue(byte(i + 1)))
		if err != nil {
			t.Fatal(err)
		}
		if len(infos) != 1 || infos[0].Key != key || infos[0].Fence != 42 || infos[0].Token != dlock.Token(tok) {
			t.Errorf("%q: etcdlock lists %+v, want the key with fence 42 and token %x", key, infos, tok)
		}
	}
	for _, name := range []string{
		etcdEndMark(etcdPrefix), etcdPrefix + "k0", etcdPrefix + "k0/", etcdPrefix + "/00000000000000aa",
		etcdPrefix + "k0/00000000000000ag", etcdPrefix + "k0/0000000000000aa", "/other/k0/00000000000000aa",
	} {
		c.kvs = []*mvccpb.KeyValue{{Key: []byte(name), CreateRevision: 42, Value: []byte(etcdValue(1))}}
		infos, err := b.List(context.Background(), "")
		c.kvs = nil
		if err != nil {
			t.Fatal(err)
		}
		_, ok := etcdlock.EntryKey(etcdPrefix, name)
		if ok || len(infos) != 0 {
			t.Errorf("%q: etcdEntryKey says entry: %v; etcdlock lists %+v", name, ok, infos)
		}
	}
}

// TestEtcdHistoryInChecker runs the checker on a derived history: a lead is
// measured against the deletion of the holder's entry, and a holder that
// kept the lock past it untold is flagged (which ends modelled as releases
// would let pass).
func TestEtcdHistoryInChecker(t *testing.T) {
	a, b := etcdName("k", 0xa), etcdName("k", 0xb)
	// w1 holds fence 10 from 100 ms; w2 queues (fence 11) at 300 ms; etcd
	// deletes w1's entry at 1200 ms (w2 is granted then), w2 releases at
	// 1500 ms. Store times equal worker times (offset 0).
	hist, live, err := etcdHistory(etcdPrefix, []etcdChange{
		put(10, a, 10, 1, 90_000), put(11, b, 11, 2, 300_000), del(12, a, 10, 1_200_000), del(13, b, 11, 1_505_000),
	})
	if err != nil || live != 0 {
		t.Fatal(live, err)
	}
	in := func(w1 []Event) checkInput {
		return checkInput{
			Name: "etcd", Strategy: "etcd-lease", TTL: 1e9, Started: 0, Ended: 10_000 * ms, HasHistory: true,
			History: hist,
			Workers: []*workerLog{
				{ID: "w1", Events: append([]Event{{T0: 50 * ms, T: 100 * ms, Ev: "acq", K: "k", F: 10}}, w1...)},
				{ID: "w2", Events: []Event{
					{T0: 250 * ms, T: 1210 * ms, Ev: "acq", K: "k", F: 11},
					{T0: 1500 * ms, T: 1501 * ms, Ev: "rel", K: "k", F: 11},
				}},
			},
		}
	}
	r := check(in([]Event{
		{T: 800 * ms, Ev: "done", K: "k", F: 10, OK: true, Err: "dlock: lock lost"},
		{T0: 800 * ms, T: 801 * ms, Ev: "rel", K: "k", F: 10},
	}))
	if r.Verdict != "PASS" || r.Lead.N != 1 || r.Lead.Min != 400 || r.Grants != 2 || r.UnconfirmedGrants != 0 {
		t.Errorf("told 400 ms before the deletion: %s, lead %+v, %d grants (%d unconfirmed) %v %v",
			r.Verdict, r.Lead, r.Grants, r.UnconfirmedGrants, r.ViolationList, r.Inconclusive)
	}
	if r.FreeWait.N != 1 || r.FreeWait.Max != 0 {
		t.Errorf("w2 was granted at the deletion: free wait %+v", r.FreeWait)
	}
	r = check(in([]Event{{T0: 1300 * ms, T: 1301 * ms, Ev: "rel", K: "k", F: 10}}))
	if r.Violations[vNoNotice] != 1 {
		t.Errorf("released after the deletion untold: want %q, got %s %v", vNoNotice, r.Verdict, r.ViolationList)
	}
	r = check(in([]Event{{T: 1250 * ms, Ev: "done", K: "k", F: 10, OK: true, Err: "dlock: lock lost"}}))
	if r.Violations[vLateNotice] != 1 {
		t.Errorf("told 50 ms after the deletion: want %q, got %s %v", vLateNotice, r.Verdict, r.ViolationList)
	}
}

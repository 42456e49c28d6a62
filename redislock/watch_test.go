package redislock_test

import (
	"errors"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/redislock"
	"github.com/redis/go-redis/v9"
)

// watchBound is how long a watch may take to report a change or its own
// end: far above any notification here, short enough to fail in time.
const watchBound = 15 * time.Second

// mustWatch starts a watch of key that lasts the test.
func mustWatch(t *testing.T, b dlock.Watcher, key string) <-chan struct{} {
	t.Helper()
	ch, err := b.Watch(ctxT(t, 2*time.Minute), key)
	if err != nil {
		t.Fatalf("Watch(%q): %v", key, err)
	}
	return ch
}

// seen waits for a receive on ch after what, then drops what else has
// arrived by then.
func seen(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case _, open := <-ch:
		if !open {
			t.Fatalf("the watch closed before %s was seen", what)
		}
	case <-time.After(watchBound):
		t.Fatalf("rule: a watch reports every change; %s not seen within %s", what, watchBound)
	}
	drain(ch)
}

// drain drops the receives ready on ch.
func drain(ch <-chan struct{}) {
	time.Sleep(100 * time.Millisecond)
	for {
		select {
		case _, open := <-ch:
			if open {
				continue
			}
		default:
		}
		return
	}
}

// closes waits for ch to be closed, dropping receives before.
func closes(t *testing.T, ch <-chan struct{}, why string) {
	t.Helper()
	deadline := time.After(watchBound)
	for {
		select {
		case _, open := <-ch:
			if !open {
				return
			}
		case <-deadline:
			t.Fatalf("rule: a watch that can no longer see every change is closed; still open %s after %s", watchBound, why)
		}
	}
}

// TestWatchSeesEveryModeChange: a watch sees the grant and the release of
// every holder in every mode, including a shared release that leaves other
// readers (which wakes no waiter) and a metadata change of a shared holder.
func TestWatchSeesEveryModeChange(t *testing.T) {
	_, b, ctx, k := fixture(t, "watchmodes")
	ch := mustWatch(t, b, k)
	r1, r2 := modeReq(k, dlock.ModeShared, 0, 30*time.Second), modeReq(k, dlock.ModeShared, 0, 30*time.Second)
	mustGrant(t, b, r1)
	seen(t, ch, "a shared grant")
	mustGrant(t, b, r2)
	seen(t, ch, "a second shared grant")
	if err := b.SetMetadata(ctx, k, r2.Token, "reader two"); err != nil {
		t.Fatal(err)
	}
	seen(t, ch, "a shared holder's metadata change")
	if err := b.Release(ctx, k, r1.Token); err != nil {
		t.Fatal(err)
	}
	seen(t, ch, "the release of a reader that leaves another")
	if err := b.Release(ctx, k, r2.Token); err != nil {
		t.Fatal(err)
	}
	seen(t, ch, "the release of the last reader")
	l := modeReq(k, dlock.ModeLimited, 2, 30*time.Second)
	mustGrant(t, b, l)
	seen(t, ch, "a limited grant")
	if err := b.ForceRelease(ctx, k); err != nil {
		t.Fatal(err)
	}
	seen(t, ch, "a forced release")
}

// TestSetMetadataOfSharedAndExpired: SetMetadata changes only its own
// holder's metadata among shared holders, and an expired lease's is
// ErrNotHeld in both kinds of holder.
func TestSetMetadataOfSharedAndExpired(t *testing.T) {
	_, b, ctx, k := fixture(t, "metashared")
	r1, r2 := modeReq(k, dlock.ModeShared, 0, 30*time.Second), modeReq(k, dlock.ModeShared, 0, 30*time.Second)
	r1.Metadata, r2.Metadata = "one", "two"
	f1, f2 := mustGrant(t, b, r1), mustGrant(t, b, r2)
	if err := b.SetMetadata(ctx, k, r2.Token, "TWO"); err != nil {
		t.Fatal(err)
	}
	infos, err := b.List(ctx, k)
	if err != nil || len(infos) != 2 {
		t.Fatalf("List: %+v %v", infos, err)
	}
	for _, h := range infos {
		want := map[dlock.Token]string{r1.Token: "one", r2.Token: "TWO"}[h.Token]
		if h.Metadata != want || h.Mode != dlock.ModeShared || (h.Fence != f1 && h.Fence != f2) {
			t.Errorf("holder %+v: want metadata %q, shared, its own fence", h, want)
		}
	}

	short := func(m dlock.Mode, limit int) dlock.Request {
		r := modeReq(locktest.UniqueKey("metaexpired"), m, limit, 100*time.Millisecond)
		mustGrant(t, b, r)
		return r
	}
	ex, sh := short(dlock.ModeExclusive, 0), short(dlock.ModeShared, 0)
	time.Sleep(300 * time.Millisecond)
	for _, r := range []dlock.Request{ex, sh} {
		if err := b.SetMetadata(ctx, r.Key, r.Token, "late"); !errors.Is(err, dlock.ErrNotHeld) {
			t.Errorf("rule: an expired %s lease's metadata cannot be set; got %v, want ErrNotHeld", r.Mode, err)
		}
	}
}

// TestWatchWakesNoWaiter: grants and metadata changes publish for watchers
// only; a waiter's release channel carries releases alone, so that waiters
// do not wake to race for a key that was just taken.
func TestWatchWakesNoWaiter(t *testing.T) {
	c, b, ctx, k := fixture(t, "watchnowake")
	_, _, released := b.Names(k)
	ps := c.SSubscribe(ctx, released)
	defer ps.Close()
	if _, err := ps.Receive(ctx); err != nil {
		t.Fatal(err)
	}
	req := modeReq(k, dlock.ModeExclusive, 0, 30*time.Second)
	mustGrant(t, b, req)
	if err := b.SetMetadata(ctx, k, req.Token, "v2"); err != nil {
		t.Fatal(err)
	}
	// Pub/sub delivers in the server's order: the marker comes first unless
	// the grant or the metadata change published on the release channel.
	if err := c.SPublish(ctx, released, "marker").Err(); err != nil {
		t.Fatal(err)
	}
	msg, err := ps.ReceiveMessage(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if msg.Payload != "marker" {
		t.Errorf("rule: grants and metadata changes do not wake waiters; the release channel carried %q first", msg.Payload)
	}
	if err := b.Release(ctx, k, req.Token); err != nil {
		t.Fatal(err)
	}
	if msg, err := ps.ReceiveMessage(ctx); err != nil || !strings.HasPrefix(msg.Payload, "released ") {
		t.Errorf("a release on the release channel: %v %v", msg, err)
	}
}

// TestWatchClosedByRestart: a server restart (which loses every lock
// without persistence) closes the watch, although go-redis would
// resubscribe by itself: changes made while the connection was down, the
// restart's own loss among them, were not seen.
func TestWatchClosedByRestart(t *testing.T) {
	s := startServer(t)
	b := newBackend(t, s.client(t), nil)
	k := locktest.UniqueKey("watchrestart")
	ch := mustWatch(t, b, k)
	mustGrant(t, b, modeReq(k, dlock.ModeExclusive, 0, 30*time.Second))
	seen(t, ch, "a grant")
	s.restart(t)
	closes(t, ch, "a server restart")
}

// TestWatchClosedByKilledConnection: the server closing the watch's
// connection (CLIENT KILL, an output buffer limit) closes the watch.
func TestWatchClosedByKilledConnection(t *testing.T) {
	c, b, ctx, k := fixture(t, "watchkill")
	ch := mustWatch(t, b, k)
	if err := c.ClientKillByFilter(ctx, "TYPE", "pubsub").Err(); err != nil {
		t.Fatal(err)
	}
	closes(t, ch, "CLIENT KILL of its connection")
}

// TestWatchClosedByStalledServer: a server that stops answering (a
// partition that drops packets, no reset) closes the watch: it pings on
// its idle connection and ends when no reply comes.
func TestWatchClosedByStalledServer(t *testing.T) {
	s := startServer(t)
	p := newStallProxy(t, s.addr())
	b := newBackend(t, newClient(t, p.addr), nil)
	k := locktest.UniqueKey("watchstall")
	ch := mustWatch(t, b, k)
	p.stall()
	closes(t, ch, "the server stopped answering")
}

// TestWatchWithPoolOfOne: a watch holds a pub/sub connection of its own,
// not one of the client's pool: a client with a pool of one still takes
// and frees locks while its Backend watches.
func TestWatchWithPoolOfOne(t *testing.T) {
	s := startServer(t)
	c := redis.NewClient(&redis.Options{Addr: s.addr(), PoolSize: 1, PoolTimeout: 5 * time.Second})
	t.Cleanup(func() { c.Close() })
	b := newBackend(t, c, nil)
	k := locktest.UniqueKey("watchpool")
	chs := []<-chan struct{}{mustWatch(t, b, k), mustWatch(t, b, k)}
	req := modeReq(k, dlock.ModeExclusive, 0, 30*time.Second)
	mustGrant(t, b, req)
	if err := b.Release(ctxT(t, 10*time.Second), k, req.Token); err != nil {
		t.Fatal(err)
	}
	for _, ch := range chs {
		seen(t, ch, "a grant and release on a pool of one")
	}
}

// TestWatchClassicPubSub: on a server without sharded pub/sub (before
// Redis 7) a watch subscribes to classic channels and sees every change.
func TestWatchClassicPubSub(t *testing.T) {
	s := startServer(t, "--rename-command", "SPUBLISH", "", "--rename-command", "SSUBSCRIBE", "")
	b := newBackend(t, s.client(t), nil)
	k := locktest.UniqueKey("watchclassic")
	ch := mustWatch(t, b, k)
	req := modeReq(k, dlock.ModeExclusive, 0, 30*time.Second)
	mustGrant(t, b, req)
	seen(t, ch, "a grant")
	if err := b.SetMetadata(ctxT(t, 10*time.Second), k, req.Token, "v2"); err != nil {
		t.Fatal(err)
	}
	seen(t, ch, "a metadata change")
	if err := b.Release(ctxT(t, 10*time.Second), k, req.Token); err != nil {
		t.Fatal(err)
	}
	seen(t, ch, "a release")
}

// TestWatchSentinel: a watch through a Sentinel-discovered client sees a
// grant and a release.
func TestWatchSentinel(t *testing.T) {
	_, sentinel := startSentinel(t)
	failover := func() *redislock.Backend {
		c := redis.NewFailoverClient(&redis.FailoverOptions{MasterName: "primary", SentinelAddrs: []string{sentinel.addr()}})
		t.Cleanup(func() { c.Close() })
		return newBackend(t, c, nil)
	}
	w, b := failover(), failover()
	k := locktest.UniqueKey("watchsentinel")
	ch := mustWatch(t, w, k)
	req := modeReq(k, dlock.ModeExclusive, 0, 30*time.Second)
	mustGrant(t, b, req)
	seen(t, ch, "a grant")
	if err := b.Release(ctxT(t, 10*time.Second), k, req.Token); err != nil {
		t.Fatal(err)
	}
	seen(t, ch, "a release")
}

// TestWatchWithoutChannelRights: an ACL that forbids pub/sub makes Watch
// an error, never a watch that sees nothing, and SetMetadata still works.
func TestWatchWithoutChannelRights(t *testing.T) {
	s := startServer(t)
	ctx := ctxT(t, 30*time.Second)
	if err := s.client(t).Do(ctx, "ACL", "SETUSER", "nochannels", "on", ">secret", "~*", "+@all", "resetchannels").Err(); err != nil {
		t.Fatal(err)
	}
	c := redis.NewClient(&redis.Options{Addr: s.addr(), Username: "nochannels", Password: "secret"})
	t.Cleanup(func() { c.Close() })
	b := newBackend(t, c, nil)
	k := locktest.UniqueKey("watchacl")
	if ch, err := b.Watch(ctx, k); err == nil {
		t.Errorf("Watch without channel rights: %v, nil error; want an error", ch)
	}
	req := modeReq(k, dlock.ModeExclusive, 0, 30*time.Second)
	mustGrant(t, b, req)
	if err := b.SetMetadata(ctx, k, req.Token, "v2"); err != nil {
		t.Errorf("SetMetadata without channel rights: %v", err)
	}
}

// stallProxy forwards TCP connections to a target until stall, after which
// it drops everything in both directions without closing anything: a
// partition that loses packets.
type stallProxy struct {
	addr    string
	stalled atomic.Bool
}

func newStallProxy(t *testing.T, target string) *stallProxy {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &stallProxy{addr: ln.Addr().String()}
	var mu sync.Mutex
	var conns []net.Conn
	var wg sync.WaitGroup
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	pipe := func(dst, src net.Conn) {
		buf := make([]byte, 32<<10)
		for {
			n, err := src.Read(buf)
			if err != nil {
				dst.Close()
				return
			}
			if !p.stalled.Load() {
				if _, err := dst.Write(buf[:n]); err != nil {
					src.Close()
					return
				}
			}
		}
	}
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			mu.Lock()
			conns = append(conns, c, s)
			mu.Unlock()
			wg.Go(func() { pipe(s, c) })
			wg.Go(func() { pipe(c, s) })
		}
	})
	return p
}

func (p *stallProxy) stall() { p.stalled.Store(true) }

// TestWatchClosedBySlotMove: when the key's slot moves to another shard of
// a cluster, the old shard ends the sharded subscription and the watch
// closes (it would otherwise hear nothing from the new shard).
func TestWatchClosedBySlotMove(t *testing.T) {
	nodes := startCluster(t)
	c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{nodes[0].addr()}})
	t.Cleanup(func() { c.Close() })
	b := newBackend(t, c, nil)
	ctx := ctxT(t, time.Minute)
	k := locktest.UniqueKey("watchslot")
	ch := mustWatch(t, b, k)
	slot, err := c.ClusterKeySlot(ctx, b.WatchChannel(k)).Result()
	if err != nil {
		t.Fatal(err)
	}
	// The slot holds no key (nothing was locked): it moves by SETSLOT alone,
	// first on the new owner, then on every other node.
	ids := map[*redis.Client]string{}
	var from, to *redis.Client
	for _, n := range nodes {
		nc := n.client(t)
		id, err := nc.ClusterMyID(ctx).Result()
		if err != nil {
			t.Fatal(err)
		}
		ids[nc] = id
		if keys, err := nc.ClusterCountKeysInSlot(ctx, int(slot)).Result(); err != nil || keys != 0 {
			t.Fatalf("slot %d holds %d keys: %v", slot, keys, err)
		}
	}
	shards, err := c.ClusterShards(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, sh := range shards {
		for _, r := range sh.Slots {
			if r.Start > slot || slot > r.End {
				continue
			}
			for _, n := range sh.Nodes {
				for nc, id := range ids {
					if n.Role == "master" && n.ID == id {
						from = nc
					}
				}
			}
		}
	}
	for nc := range ids {
		if nc != from {
			to = nc
		}
	}
	if from == nil || to == nil {
		t.Fatalf("no owner of slot %d found", slot)
	}
	setslot := func(nc *redis.Client) {
		if err := nc.Do(ctx, "CLUSTER", "SETSLOT", slot, "NODE", ids[to]).Err(); err != nil {
			t.Fatal(err)
		}
	}
	setslot(to)
	for nc := range ids {
		if nc != to {
			setslot(nc)
		}
	}
	closes(t, ch, "its slot moved to another shard")
}

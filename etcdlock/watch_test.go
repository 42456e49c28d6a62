package etcdlock_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/etcdlock"
	"github.com/dlock-dev/dlock/locktest"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// seenBound is how long a watch may take to report a change or to close:
// generous, since a restarted member needs the client to reconnect.
const seenBound = 30 * time.Second

// nextEvent waits for a receive on ch and reports whether the channel was
// still open; it fails the test if nothing comes within seenBound.
func nextEvent(t *testing.T, ch <-chan struct{}, what string) bool {
	t.Helper()
	select {
	case _, open := <-ch:
		return open
	case <-time.After(seenBound):
		t.Fatalf("watch neither reported %s nor closed within %s", what, seenBound)
		return false
	}
}

// drain drops the receives already queued on ch.
func drain(ch <-chan struct{}) {
	time.Sleep(200 * time.Millisecond)
	for {
		select {
		case <-ch:
			continue
		default:
		}
		return
	}
}

// TestWatchReportsExpiry: etcd revokes an expired lease itself, and the
// deletion of the holder's entry reaches the watch.
func TestWatchReportsExpiry(t *testing.T) {
	eps := endpoints(t)
	b := newBackend(t, eps)
	k := locktest.UniqueKey("expiry")
	ch, err := b.Watch(ctxT(t, time.Minute), k)
	if err != nil {
		t.Fatal(err)
	}
	mustTake(t, newBackend(t, eps), req(k, dlock.ModeExclusive, 0, time.Second))
	if !nextEvent(t, ch, "the grant") {
		t.Fatal("watch closed instead of reporting the grant")
	}
	drain(ch)
	if !nextEvent(t, ch, "the expiry") { // nobody renews: etcd revokes the lease
		t.Fatal("watch closed instead of reporting the expiry")
	}
	if hs, err := b.List(ctxT(t, 10*time.Second), k); err != nil || len(hs) != 0 {
		t.Errorf("after the reported expiry List gives %+v %v, want nothing", hs, err)
	}
}

// TestWatchAcrossRestart: a watch across a restart of the only member
// either goes on reporting (the client resumes it from the last revision
// it saw) or closes; it never goes silent.
func TestWatchAcrossRestart(t *testing.T) {
	c := startCluster(t, 1)
	eps := c.endpoints()
	b := newBackend(t, eps)
	k := locktest.UniqueKey("restart")
	ch, err := b.Watch(ctxT(t, 2*time.Minute), k)
	if err != nil {
		t.Fatal(err)
	}
	c.members[0].restart(t)
	other := newBackend(t, eps)
	var res dlock.Result
	for range 100 { // the client may still be reconnecting
		if res, err = other.Acquire(ctxT(t, 10*time.Second), req(k, dlock.ModeExclusive, 0, 30*time.Second)); err == nil {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil || !res.Acquired {
		t.Fatalf("Acquire after the restart: %+v %v", res, err)
	}
	if !nextEvent(t, ch, "the grant after the restart") {
		t.Log("watch closed by the restart (allowed)")
	}
}

// TestWatchOfCompactedRevisionCloses: a watch whose revision etcd has
// compacted away (as when the client resumes a watch after a long
// disconnection) cannot see every change: its channel is closed.
func TestWatchOfCompactedRevisionCloses(t *testing.T) {
	eps := endpoints(t)
	cli := newClient(t, eps...)
	b := newBackend(t, eps)
	k := locktest.UniqueKey("compacted")
	resp, err := cli.Get(ctxT(t, 10*time.Second), "x")
	if err != nil {
		t.Fatal(err)
	}
	old := resp.Header.Revision
	for range 3 {
		if resp, err := cli.Put(ctxT(t, 10*time.Second), locktest.UniqueKey("filler"), "x"); err != nil {
			t.Fatal(err)
		} else if _, err := cli.Compact(ctxT(t, 10*time.Second), resp.Header.Revision); err != nil {
			t.Fatal(err)
		}
	}
	ch, err := etcdlock.WatchFrom(b, ctxT(t, time.Minute), k, old)
	if err != nil {
		t.Fatal(err)
	}
	for nextEvent(t, ch, "the compaction") {
	}
}

// TestCloseEndsWatches: Backend.Close closes every watch's channel (no
// goroutine of the Backend outlives it), and a Watch after Close fails.
func TestCloseEndsWatches(t *testing.T) {
	eps := endpoints(t)
	b, err := etcdlock.New(newClient(t, eps...), nil)
	if err != nil {
		t.Fatal(err)
	}
	ch, err := b.Watch(context.Background(), locktest.UniqueKey("close"))
	if err != nil {
		t.Fatal(err)
	}
	closed := make(chan struct{})
	go func() { b.Close(); close(closed) }()
	for nextEvent(t, ch, "Close") {
	}
	select {
	case <-closed:
	case <-time.After(seenBound):
		t.Fatalf("Close did not return within %s", seenBound)
	}
	if _, err := b.Watch(context.Background(), "k"); err == nil {
		t.Error("Watch after Close succeeded")
	}
}

// TestSetMetadataOfAHolderBehindTheHead: a shared holder that is not the
// head of the queue sets its metadata, which List and a watch see; a
// waiting writer's token is not a holder's, and changes nothing.
func TestSetMetadataOfAHolderBehindTheHead(t *testing.T) {
	eps := endpoints(t)
	b := newBackend(t, eps)
	cli := newClient(t, eps...)
	k := locktest.UniqueKey("meta")
	mustTake(t, b, req(k, dlock.ModeShared, 0, 30*time.Second))
	second := req(k, dlock.ModeShared, 0, 30*time.Second)
	mustTake(t, b, second)
	ch, err := b.Watch(ctxT(t, time.Minute), k)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.SetMetadata(ctxT(t, 10*time.Second), k, second.Token, "second"); err != nil {
		t.Fatalf("SetMetadata by the second reader: %v", err)
	}
	if !nextEvent(t, ch, "the metadata change") {
		t.Fatal("watch closed")
	}
	hs, err := b.List(ctxT(t, 10*time.Second), k)
	if err != nil || len(hs) != 2 || hs[1].Token != second.Token || hs[1].Metadata != "second" || hs[0].Metadata != "" {
		t.Fatalf("List: %+v %v, want the second reader with metadata \"second\"", hs, err)
	}

	writer := req(k, dlock.ModeExclusive, 0, 30*time.Second)
	wctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { _, _ = b.AcquireWait(wctx, writer) })
	defer func() { cancel(); wg.Wait() }()
	for len(entries(t, cli, dirOf(k))) < 3 {
		time.Sleep(20 * time.Millisecond)
	}
	before := entries(t, cli, dirOf(k))
	rev := revision(t, cli, dirOf(k))
	if err := b.SetMetadata(ctxT(t, 10*time.Second), k, writer.Token, "writer"); !errors.Is(err, dlock.ErrNotHeld) {
		t.Errorf("SetMetadata by a waiting writer: %v, want ErrNotHeld", err)
	}
	if got := revision(t, cli, dirOf(k)); got != rev || len(entries(t, cli, dirOf(k))) != len(before) {
		t.Errorf("a refused SetMetadata changed the queue (revision %d → %d)", rev, got)
	}
}

// revision returns the largest mod revision under prefix.
func revision(t *testing.T, c *clientv3.Client, prefix string) int64 {
	t.Helper()
	resp, err := c.Get(ctxT(t, 5*time.Second), prefix, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	var rev int64
	for _, kv := range resp.Kvs {
		rev = max(rev, kv.ModRevision)
	}
	return rev
}

package redislock_test

import (
	"context"
	"errors"
	"slices"
	"strconv"
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

// fenceOf reads resource's fence record, 0 if there is none.
func fenceOf(t *testing.T, c redis.Cmdable, resource string) uint64 {
	t.Helper()
	v, err := c.Get(context.Background(), redislock.FenceKey(resource)).Uint64()
	if errors.Is(err, redis.Nil) {
		return 0
	}
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func TestFencedAcceptsEqualAndHigherRefusesLower(t *testing.T) {
	c := newClient(t, serversFromEnv(t, envAddr, 1, false)[0])
	ctx := ctxT(t, 30*time.Second)
	res := locktest.UniqueKey("fenced")
	data := "{" + res + "}:data"

	set := func(fence uint64, v string) error {
		return redislock.FencedSet(ctx, c, res, fence, data, v, 0)
	}
	for _, step := range []struct {
		fence uint64
		value string
		stale bool
	}{
		{5, "a", false},       // the first write creates the record
		{5, "b", false},       // the same holder writes again
		{7, "c", false},       // a newer holder
		{6, "d", true},        // the previous holder, too late
		{1, "e", true},        // far behind
		{7, "f", false},       // the newest holder still writes
		{1 << 63, "g", false}, // beyond a Lua number's exact range
		{1<<63 - 1, "h", true},
	} {
		err := set(step.fence, step.value)
		if step.stale != errors.Is(err, redislock.ErrStaleFence) || (!step.stale && err != nil) {
			t.Fatalf("fence %d: err = %v, want stale=%v", step.fence, err, step.stale)
		}
	}
	if v := c.Get(ctx, data).Val(); v != "g" {
		t.Fatalf("value = %q, want %q: a refused write changed it", v, "g")
	}
	if f := fenceOf(t, c, res); f != 1<<63 {
		t.Fatalf("fence record = %d, want %d", f, uint64(1<<63))
	}
}

func TestFencedRunsCommandsAfterTheCheck(t *testing.T) {
	c := newClient(t, serversFromEnv(t, envAddr, 1, false)[0])
	ctx := ctxT(t, 30*time.Second)
	res := locktest.UniqueKey("fenced")
	list, hash := "{"+res+"}:list", "{"+res+"}:hash"

	replies, err := redislock.Fenced(ctx, c, res, 10, []string{list, hash},
		redislock.Cmd{"RPUSH", list, "x", "y"},
		redislock.Cmd{"HSET", hash, "f", 1},
		redislock.Cmd{"GET", "{" + res + "}:missing"},
		redislock.Cmd{"SET", "{" + res + "}:s", "v"})
	if err != nil {
		t.Fatal(err)
	}
	if want := []any{int64(2), int64(1), nil, "OK"}; !slices.Equal(replies, want) {
		t.Fatalf("replies = %#v, want %#v", replies, want)
	}

	// Refused: nothing runs, and the error names the newest fence.
	_, err = redislock.Fenced(ctx, c, res, 9, []string{list}, redislock.Cmd{"RPUSH", list, "z"})
	if !errors.Is(err, redislock.ErrStaleFence) {
		t.Fatalf("stale: err = %v, want ErrStaleFence", err)
	}
	if n := c.LLen(ctx, list).Val(); n != 2 {
		t.Fatalf("list has %d elements after a refused write, want 2", n)
	}

	// No command: the record is raised, fencing out older holders.
	if _, err := redislock.Fenced(ctx, c, res, 11, nil); err != nil {
		t.Fatal(err)
	}
	if f := fenceOf(t, c, res); f != 11 {
		t.Fatalf("fence record = %d, want 11", f)
	}

	// The longest command runs.
	long := redislock.Cmd{"RPUSH", list}
	for len(long) < redislock.MaxCmdArgs {
		long = append(long, len(long))
	}
	if _, err := redislock.Fenced(ctx, c, res, 11, []string{list}, long); err != nil {
		t.Fatalf("a command of MaxCmdArgs elements: %v", err)
	}

	// A command that fails is reported.
	if _, err := redislock.Fenced(ctx, c, res, 11, []string{list}, redislock.Cmd{"INCR", list}); err == nil || errors.Is(err, redislock.ErrStaleFence) {
		t.Fatalf("INCR of a list: err = %v, want Redis's error", err)
	}
}

func TestFencedSetExpiry(t *testing.T) {
	c := newClient(t, serversFromEnv(t, envAddr, 1, false)[0])
	ctx := ctxT(t, 30*time.Second)
	res := locktest.UniqueKey("fenced")
	data := "{" + res + "}:data"

	if err := redislock.FencedSet(ctx, c, res, 3, data, "v", time.Hour+time.Microsecond); err != nil {
		t.Fatal(err)
	}
	ttl := c.PTTL(ctx, data).Val()
	if ttl <= 59*time.Minute || ttl > time.Hour+time.Millisecond {
		t.Fatalf("PTTL = %s, want about 1h", ttl)
	}
	if err := redislock.FencedSet(ctx, c, res, 3, data, "w", 0); err != nil {
		t.Fatal(err)
	}
	if ttl := c.PTTL(ctx, data).Val(); ttl != -1 {
		t.Fatalf("PTTL after a SET without expiry = %s, want none (-1)", ttl)
	}
	// The record itself never expires: an expired record would let an old
	// fence in again.
	if ttl := c.PTTL(ctx, redislock.FenceKey(res)).Val(); ttl != -1 {
		t.Fatalf("record PTTL = %s, want none (-1)", ttl)
	}
}

// TestFencedRejectsBadInputBeforeIO uses a client of a port where nothing
// listens: an error other than the validation's would be a dial error.
func TestFencedRejectsBadInputBeforeIO(t *testing.T) {
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1, DialTimeout: time.Second})
	t.Cleanup(func() { c.Close() })
	ctx := ctxT(t, 30*time.Second)
	for _, tc := range []struct {
		name     string
		resource string
		fence    uint64
		ttl      time.Duration
		cmds     []redislock.Cmd
		want     error
	}{
		{"fence 0", "r", 0, 0, nil, dlock.ErrInvalidOption},
		{"empty resource", "", 1, 0, nil, dlock.ErrInvalidKey},
		{"long resource", string(make([]byte, 256)), 1, 0, nil, dlock.ErrInvalidKey},
		{"NUL in resource", "a\x00b", 1, 0, nil, dlock.ErrInvalidKey},
		{"bad UTF-8", "a\xffb", 1, 0, nil, dlock.ErrInvalidKey},
		{"negative expiry", "r", 1, -time.Second, nil, dlock.ErrInvalidOption},
		{"empty command", "r", 1, 0, []redislock.Cmd{{}}, dlock.ErrInvalidOption},
		{"command name not a string", "r", 1, 0, []redislock.Cmd{{42, "k"}}, dlock.ErrInvalidOption},
		{"too many arguments", "r", 1, 0, []redislock.Cmd{append(redislock.Cmd{"RPUSH", "k"}, make([]any, 8000)...)}, dlock.ErrInvalidOption},
	} {
		var err error
		if tc.ttl != 0 || tc.cmds == nil {
			err = redislock.FencedSet(ctx, c, tc.resource, tc.fence, "k", "v", tc.ttl)
		} else {
			_, err = redislock.Fenced(ctx, c, tc.resource, tc.fence, []string{"k"}, tc.cmds...)
		}
		if !errors.Is(err, tc.want) {
			t.Errorf("%s: err = %v, want %v", tc.name, err, tc.want)
		}
	}
}

// fencedAppend appends fence to list if fence is the resource's newest,
// reporting whether it was accepted.
type fencedAppend func(ctx context.Context, c *redis.Client, res, list string, fence uint64) (bool, error)

func appendWithFenced(ctx context.Context, c *redis.Client, res, list string, fence uint64) (bool, error) {
	_, err := redislock.Fenced(ctx, c, res, fence, []string{list}, redislock.Cmd{"RPUSH", list, fence})
	if errors.Is(err, redislock.ErrStaleFence) {
		return false, nil
	}
	return err == nil, err
}

// TestFencedConcurrentAppendsNeverDecrease has 8 writers present fences
// drawn from one counter, so that a writer often presents its fence after
// another presented a newer one, each appending its fence to a list with a
// fenced RPUSH. The list must never decrease, and hold exactly the
// accepted writes. (A check made apart from the write, GET then SET and
// RPUSH, fails it within a few hundred writes.)
func TestFencedConcurrentAppendsNeverDecrease(t *testing.T) {
	testConcurrentAppends(t, appendWithFenced)
}

func testConcurrentAppends(t *testing.T, write fencedAppend) {
	c := newClient(t, serversFromEnv(t, envAddr, 1, false)[0])
	ctx := ctxT(t, 2*time.Minute)
	res := locktest.UniqueKey("fenced")
	list := "{" + res + "}:list"

	const writers, perWriter = 8, 300
	var next atomic.Uint64
	var accepted, refused atomic.Int64
	errs := make(chan error, writers)
	var wg sync.WaitGroup
	for range writers {
		wg.Go(func() {
			for range perWriter {
				fence := next.Add(1)
				// Each fence is presented twice: a holder writes many times.
				for range 2 {
					ok, err := write(ctx, c, res, list, fence)
					if err != nil {
						errs <- err
						return
					}
					if ok {
						accepted.Add(1)
					} else {
						refused.Add(1)
					}
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}

	got, err := c.LRange(ctx, list, 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	var prev uint64
	for i, s := range got {
		f, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		if f < prev {
			t.Fatalf("list[%d] = %d after %d: a stale write was applied (%d accepted, %d refused)", i, f, prev, accepted.Load(), refused.Load())
		}
		prev = f
	}
	if int64(len(got)) != accepted.Load() {
		t.Fatalf("list has %d elements, %d writes were accepted", len(got), accepted.Load())
	}
	if refused.Load() == 0 {
		t.Fatalf("no write was refused: the writers did not interleave, the test proves nothing")
	}
	if f := fenceOf(t, c, res); f != prev {
		t.Fatalf("fence record = %d, the last write's fence %d", f, prev)
	}
	t.Logf("%d writes accepted, %d refused", accepted.Load(), refused.Load())
}

// TestFencedCluster checks that a write whose keys share the resource's
// hash tag runs on Redis Cluster, and that one whose keys live in another
// slot is refused by Redis before it changes anything.
func TestFencedCluster(t *testing.T) {
	addrs := serversFromEnv(t, envCluster, 3, true)
	c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs})
	t.Cleanup(func() { c.Close() })
	ctx := ctxT(t, 30*time.Second)
	res := "{" + locktest.UniqueKey("fenced") + "}"
	data := res + ":data"

	if err := redislock.FencedSet(ctx, c, res, 2, data, "a", 0); err != nil {
		t.Fatal(err)
	}
	if err := redislock.FencedSet(ctx, c, res, 1, data, "b", 0); !errors.Is(err, redislock.ErrStaleFence) {
		t.Fatalf("stale on a cluster: err = %v, want ErrStaleFence", err)
	}
	other := "{" + locktest.UniqueKey("elsewhere") + "}"
	for c.ClusterKeySlot(ctx, other).Val() == c.ClusterKeySlot(ctx, res).Val() {
		other += "x"
	}
	_, err := redislock.Fenced(ctx, c, res, 3, []string{other}, redislock.Cmd{"SET", other, "c"})
	if err == nil || !strings.Contains(err.Error(), "CROSSSLOT") {
		t.Fatalf("a write to another slot: err = %v, want Redis's CROSSSLOT", err)
	}
	if v := c.Get(ctx, data).Val(); v != "a" {
		t.Fatalf("value = %q, want %q", v, "a")
	}
	if n := c.Exists(ctx, other).Val(); n != 0 {
		t.Fatalf("the key of another slot was written")
	}
	if v := c.Get(ctx, redislock.FenceKey(res)).Val(); v != "2" {
		t.Fatalf("fence record = %q after a refused cross-slot write, want 2", v)
	}
}

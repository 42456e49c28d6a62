package redislock

import (
	"context"
	_ "embed"
	"fmt"
	"strconv"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/redis/go-redis/v9"
)

// ErrStaleFence means a fenced write presented an older fence than the
// newest its resource has seen: the lock that gave it has passed to
// another holder. Nothing was changed.
// It is dlock.ErrStaleFence.
var ErrStaleFence = dlock.ErrStaleFence

// FencePrefix starts the name of every fence record: resource r's record
// is the Redis key FencePrefix + r (see FenceKey).
const FencePrefix = "dlock:fence:"

// MaxCmdArgs is the largest number of elements (name included) of one Cmd:
// the script passes them to redis.call through Lua's stack, which holds
// about 8,000.
const MaxCmdArgs = 7000

// Cmd is one Redis command for Fenced, as redis.call takes it: the
// command's name (a string), then its arguments, of any type go-redis
// writes (strings, []byte, numbers, bool, time.Time, encoding.BinaryMarshaler).
//
//	redislock.Cmd{"RPUSH", "{orders}:log", 42}
type Cmd []any

var (
	//go:embed fenced.lua
	fencedLua    string
	fencedScript = redis.NewScript(fencedLua)
)

// FenceKey returns the name of resource's fence record: FencePrefix +
// resource, verbatim. Redis Cluster places a name by its hash tag (the
// first "{…}" in it), so the record of resource "{orders}" shares a slot
// with every key tagged {orders}, and the record of a resource without a
// tag shares a slot with nothing predictable.
func FenceKey(resource string) string { return FencePrefix + resource }

// Fenced runs cmds on Redis, in one script, only if fence is at least the
// newest fence presented for resource; it returns each command's reply in
// order (nil for a nil reply). Use it to write to Redis under a lock whose
// fence (dlock.Lock.Fence) grows with each new holder, from any dlock
// backend: a holder that lost its lock without knowing it (a pause, a
// partition) cannot overwrite the writes of the holder after it.
//
// The check and the writes are atomic: the script reads resource's fence
// record (FenceKey), refuses with an error matching ErrStaleFence, changing
// nothing, if the record holds a larger fence, and otherwise raises the
// record to fence and runs cmds. A fence equal to the record's is accepted,
// so one holder writes many times; the first fence presented for a
// resource is always accepted. With no cmds, Fenced only raises the record:
// a new holder fences out the previous one before its first write. Every
// writer of a resource must present fences of one lock key, and every
// write to the resource's data must go through Fenced: a plain write is not
// checked. The record never expires, and is never deleted by this package.
//
// keys lists every key that cmds touch. Redis needs them declared on
// Redis Cluster, where the record and every key of one call must hash to
// one slot: give the resource a hash tag and use it in the keys (resource
// "{orders}", keys "{orders}:total", "{orders}:log"). Redis refuses a call
// whose declared keys span slots (CROSSSLOT) before the script runs.
//
// A command that Redis refuses (a wrong type, a bad argument) ends the
// script with Redis's error: the record is raised and the commands before
// it stay applied, since Redis does not undo a script. Commands run inside
// a script, so blocking commands do not block and scripting commands
// are refused.
//
// A call whose reply does not arrive (a timeout, a cut connection) has an
// unknown outcome: the script may have run. go-redis sends a script again
// after a read timeout (Options.MaxRetries, 3 by default), so one Fenced
// call can run its commands twice, and report ErrStaleFence when a newer
// holder wrote between the two runs although the first one applied. Give
// Fenced idempotent commands (SET, not INCRBY), or a client with
// MaxRetries -1 and treat a timeout as "may have applied".
//
// Before any I/O, the error matches dlock.ErrInvalidKey for a resource that
// is not 1..255 bytes of UTF-8 without NUL, and dlock.ErrInvalidOption for a
// fence of 0 or a Cmd that is empty, does not start with a string, or has
// more than MaxCmdArgs elements.
func Fenced(ctx context.Context, c redis.Scripter, resource string, fence uint64, keys []string, cmds ...Cmd) ([]any, error) {
	if err := checkFenced(resource, fence); err != nil {
		return nil, err
	}
	args := []any{strconv.FormatUint(fence, 10), len(cmds)}
	for i, cmd := range cmds {
		if len(cmd) == 0 || len(cmd) > MaxCmdArgs {
			return nil, fmt.Errorf("%w: redislock: fenced write of %q: command %d has %d elements, want 1..%d", dlock.ErrInvalidOption, resource, i, len(cmd), MaxCmdArgs)
		}
		if name, ok := cmd[0].(string); !ok || name == "" {
			return nil, fmt.Errorf("%w: redislock: fenced write of %q: command %d does not start with its name", dlock.ErrInvalidOption, resource, i)
		}
		args = append(args, len(cmd))
		args = append(args, cmd...)
	}
	v, err := fencedScript.Run(ctx, c, append([]string{FenceKey(resource)}, keys...), args...).Slice()
	if err != nil {
		return nil, fmt.Errorf("redislock: fenced write of %q: %w", resource, err)
	}
	if len(v) != 2 {
		return nil, fmt.Errorf("redislock: fenced write of %q: unexpected reply %v", resource, v)
	}
	if ok, _ := v[0].(int64); ok != 1 {
		return nil, fmt.Errorf("%w: %q: fence %d, the newest is %v", ErrStaleFence, resource, fence, v[1])
	}
	replies, _ := v[1].([]any)
	return replies, nil
}

// FencedSet sets key to value, as Fenced runs SET: only if fence is at
// least the newest fence presented for resource, with the errors of
// Fenced. An expiration of zero sets no expiry (and removes one the key
// had); a positive one is rounded up to whole milliseconds. A negative
// expiration matches dlock.ErrInvalidOption, before any I/O. On Redis
// Cluster, key must share resource's slot (see Fenced).
func FencedSet(ctx context.Context, c redis.Scripter, resource string, fence uint64, key string, value any, expiration time.Duration) error {
	if expiration < 0 {
		return fmt.Errorf("%w: redislock: fenced write of %q: negative expiration %s", dlock.ErrInvalidOption, resource, expiration)
	}
	cmd := Cmd{"SET", key, value}
	if expiration > 0 {
		cmd = append(cmd, "PX", int64((expiration+time.Millisecond-1)/time.Millisecond))
	}
	_, err := Fenced(ctx, c, resource, fence, []string{key}, cmd)
	return err
}

// checkFenced validates a fenced write's resource and fence.
func checkFenced(resource string, fence uint64) error {
	if err := dlock.ValidateKey(resource); err != nil {
		return fmt.Errorf("redislock: fenced write: resource: %w", err)
	}
	if fence == 0 {
		return fmt.Errorf("%w: redislock: fenced write of %q: fence 0 (fences start at 1)", dlock.ErrInvalidOption, resource)
	}
	return nil
}

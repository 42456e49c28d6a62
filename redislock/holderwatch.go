package redislock

import (
	"cmp"
	"context"
	_ "embed"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/redis/go-redis/v9"
)

var (
	//go:embed watchholders.lua
	watchHoldersLua string

	watchHoldersScript = redis.NewScript(holdersLua + watchHoldersLua)
)

// maxBehind is how many changes WatchHolders keeps for a reader that is
// behind before it ends the watch (closes its channel).
const maxBehind = 1024

// errUnnumbered is a message on a key's channels that carries no change
// number: one published by a client of a version that does not count
// changes, or by something else.
var errUnnumbered = errors.New("a change without a number")

// WatchHolders implements dlock.HolderWatcher. Every script that changes a
// key's holders (a grant, a release, a forced release, a metadata change)
// counts the change on the key's change counter, a string beside its
// fencing counter that never expires, and publishes, on the channel it
// already told waiters or watches on, the counter's new value with the
// key's holders after the change. WatchHolders subscribes to both channels
// on a pub/sub connection of its own, as Watch does, then reads the holders
// and the counter in one script: the messages numbered up to that counter
// tell of changes the read already shows and are dropped, and each later
// one must carry the next number.
//
// Expiries are not reported (Redis tells of them only through keyspace
// notifications): each holder carries its ExpiresAt, and a holder whose
// lease ended is missing from the holders reported after the next change.
// The channel is closed when ctx ends, whenever Watch's would be (a broken
// connection, an unanswered ping, the server ending the subscription), at
// a message whose number is not the next one (a change whose message was
// lost, a counter that went back), at a message without a number (a client
// of an older version changed the key), at a change that leaves more than
// 100 holders (its message does not carry them), and when the reader falls
// more than 1024 changes behind. It returns an error when it cannot
// subscribe or read, or when ctx ends first.
func (b *Backend) WatchHolders(ctx context.Context, key string) ([]dlock.LockInfo, <-chan []dlock.LockInfo, error) {
	fail := func(err error) ([]dlock.LockInfo, <-chan []dlock.LockInfo, error) {
		if ctx.Err() != nil {
			err = ctx.Err()
		}
		return nil, nil, fmt.Errorf("redislock: watch holders of %q: %w", key, err)
	}
	ps, err := b.subscribe(ctx, b.channel(key), b.watchChannel(key))
	if err != nil {
		return fail(err)
	}
	seq, now, err := b.holdersAt(ctx, key)
	if err != nil {
		ps.Close()
		return fail(err)
	}
	out := make(chan []dlock.LockInfo, maxBehind)
	snap, last := seq, seq
	listen(ctx, ps, func(m *redis.Message) bool {
		c, err := parseChange(key, m.Payload, time.Now())
		switch {
		case err == nil && c.seq <= snap && last == snap:
			return true // published before the read, which shows it
		case err != nil || c.seq != last+1 || c.holders == nil:
			return false
		}
		last = c.seq
		select {
		case out <- c.holders:
			return true
		default:
			return false // the reader is too far behind
		}
	}, func() { close(out) })
	return now, out, nil
}

// holdersAt reads key's holders and its change counter in one script. It
// returns when ctx ends even if the server does not answer (go-redis bounds
// a read by a context's deadline, not by its cancellation): the call then
// ends in the background, at the client's read timeout.
func (b *Backend) holdersAt(ctx context.Context, key string) (uint64, []dlock.LockInfo, error) {
	type read struct {
		v   []any
		err error
	}
	done := make(chan read, 1)
	go func() {
		v, err := watchHoldersScript.Run(ctx, b.c, b.changeKeys(key)).Slice()
		done <- read{v, err}
	}()
	var r read
	select {
	case r = <-done:
	case <-ctx.Done():
		return 0, nil, ctx.Err()
	}
	if r.err != nil {
		return 0, nil, r.err
	}
	now := time.Now()
	var seq uint64
	var hs []any
	ok := len(r.v) == 2
	if ok {
		s, _ := r.v[0].(string)
		var err error
		seq, err = strconv.ParseUint(s, 10, 64)
		hs, ok = r.v[1].([]any)
		ok = ok && err == nil
	}
	if !ok {
		return 0, nil, fmt.Errorf("unexpected reply %v", r.v)
	}
	infos := []dlock.LockInfo{}
	for _, h := range hs {
		v, ok := h.([]any)
		if !ok {
			return 0, nil, fmt.Errorf("unexpected reply %v", r.v)
		}
		info, _ := parseHolder(key, v, now)
		infos = append(infos, info)
	}
	return seq, sortHolders(infos), nil
}

// change is one change of a key's holders as its message tells it.
type change struct {
	seq uint64
	// holders after the change (not nil), or nil when there were too many
	// for the message to carry.
	holders []dlock.LockInfo
}

// holderFields is the number of fields of a holder in a change's message:
// pttl, token, owner, fence, metadata, acquired_us, mode, limit.
const holderFields = 8

// parseChange reads the message of a change of key's holders (see
// announcement in holders.lua), received at now.
func parseChange(key, payload string, now time.Time) (change, error) {
	head := strings.SplitN(payload, " ", 4)
	if len(head) != 4 {
		return change{}, errUnnumbered
	}
	seq, err := strconv.ParseUint(head[1], 10, 64)
	if err != nil {
		return change{}, errUnnumbered
	}
	n, err := strconv.Atoi(head[2])
	switch {
	case err != nil || n < -1:
		return change{}, fmt.Errorf("bad holder count in %q", payload)
	case n == -1:
		return change{seq: seq}, nil
	}
	rest := head[3]
	hs := make([]dlock.LockInfo, 0, n)
	for range n {
		v := make([]any, holderFields)
		for i := range v {
			colon := strings.IndexByte(rest, ':')
			l, err := strconv.Atoi(rest[:max(colon, 0)])
			if colon < 0 || err != nil || l < 0 || l > len(rest)-colon-1 {
				return change{}, fmt.Errorf("malformed change %q", payload)
			}
			f := rest[colon+1 : colon+1+l]
			rest = rest[colon+1+l:]
			v[i] = f
			if i == 0 || i == 6 || i == 7 { // pttl, mode, limit
				v[i], err = strconv.ParseInt(f, 10, 64)
				if err != nil {
					return change{}, fmt.Errorf("malformed change %q", payload)
				}
			}
		}
		h, _ := parseHolder(key, v, now)
		hs = append(hs, h)
	}
	if rest != "" {
		return change{}, fmt.Errorf("malformed change %q", payload)
	}
	return change{seq: seq, holders: sortHolders(hs)}, nil
}

// sortHolders orders one key's holders by fence, as List does.
func sortHolders(hs []dlock.LockInfo) []dlock.LockInfo {
	slices.SortFunc(hs, func(a, b dlock.LockInfo) int { return cmp.Compare(a.Fence, b.Fence) })
	return hs
}

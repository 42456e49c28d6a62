package torture

import (
	"bufio"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/redislock"
	"github.com/redis/go-redis/v9"
)

// redisLease is redislock on the Redis at Env.RedisAddr (a single server).
//
// Redis keeps no history, so the harness records one as the run goes:
// MONITOR streams every command the server executes, in execution order and
// stamped with the server's clock (µs), including the commands that
// redislock's Lua scripts run ("[0 lua]" lines). Those script commands are
// the lock's changes: the acquire script's HSET (a grant: fence, token, and
// the server time it read with TIME as acquired_us) followed by PEXPIRE (its
// expiry), the extend script's PEXPIRE (an extension), the release script's
// DEL (a release). A script runs atomically and its writes only happen when
// its checks passed, so the feed of writes is the store's own record; an
// expiry leaves no line, and is the last PEXPIRE's deadline. Redis keeps a
// deadline in milliseconds (the command's time, truncated, plus the lease)
// and frees the key once its clock is past that millisecond, so the recorded
// expiry is the end of that millisecond.
var redisLease = &Adapter{
	Name:  "redis-lease",
	Modes: bothModes,
	// A Redis without persistence forgets every lease when it is killed;
	// their holders cannot be told before (the exclusive checks leave such
	// leases out), so the next holder may be told "held" while they are,
	// and a semaphore, which no fence protects, may have one holder too
	// many at the resource.
	Known:     map[string][]string{FaultDBRestart: {vOverClaimed, vOverLimit}},
	Networked: true,
	Pooled:    true,
	Upstream:  addrUpstream("Redis", func(env *Env) string { return env.RedisAddr }),
	// The store string is the run's redislock.Options.Prefix.
	Prepare: func(ctx context.Context, env *Env) (string, error) {
		prefix := "torture:" + env.Tag + ":"
		rdb := redis.NewClient(&redis.Options{Addr: env.RedisAddr})
		defer rdb.Close()
		// Leftovers of an earlier run with the same tag: locks, counters.
		iter := rdb.Scan(ctx, 0, prefix+"*", 1000).Iterator()
		for iter.Next(ctx) {
			if err := rdb.Del(ctx, iter.Val()).Err(); err != nil {
				return "", err
			}
		}
		if err := iter.Err(); err != nil {
			return "", fmt.Errorf("redis at %s: %w", env.RedisAddr, err)
		}
		return prefix, nil
	},
	Open: func(ctx context.Context, a OpenArgs) (dlock.Backend, func() error, error) {
		// Short timeouts: a blackholed connection fails a call within the
		// Locker's renewal budget instead of go-redis's 3 s default.
		rdb := redis.NewClient(&redis.Options{Addr: a.Addr, DialTimeout: time.Second,
			ReadTimeout: 300 * time.Millisecond, WriteTimeout: 300 * time.Millisecond, MaxRetries: -1,
			PoolSize: a.PoolSize}) // 0: go-redis's default
		b, err := redislock.New(rdb, &redislock.Options{Prefix: a.Store, MinReplicas: a.RedisMinReplicas})
		if err != nil {
			rdb.Close()
			return nil, nil, err
		}
		return b, rdb.Close, nil
	},
	Record: recordRedis,
	Restart: func(ctx context.Context, env *Env) (int64, int64, error) {
		return restartListener(ctx, env, env.RedisAddr, redisReady(env.RedisAddr), redisArgv(env.RedisAddr))
	},
}

// recordRedis starts a MONITOR feed of the Redis at env.RedisAddr (a direct
// connection, no fault proxy) and returns the recording that turns the feed
// into the run's history.
//
// The feed is read from a plain connection: go-redis's MonitorCmd hands the
// connection back to its pool while a goroutine still reads from it (a data
// race under -race), and MONITOR's protocol is one status line per command.
//
// A restart of the server (the restart fault) ends the feed's connection:
// Sync, called with the workers cut off before the kill, makes sure the feed
// holds every command executed until then; Restarted adds a line
// "RESTART <µs>" (the kill's instant: a server without persistence forgets
// every lock then) and follows the new server with a new MONITOR.
func recordRedis(ctx context.Context, env *Env, prefix string) (*Recording, error) {
	ctl := redis.NewClient(&redis.Options{Addr: env.RedisAddr})
	var (
		mu       sync.Mutex
		feed     []string
		readErr  error
		conn     net.Conn
		readDone chan struct{}
	)
	// attach starts a MONITOR feed on a new connection.
	attach := func(ctx context.Context) error {
		d := net.Dialer{Timeout: 5 * time.Second}
		c, err := d.DialContext(ctx, "tcp", env.RedisAddr)
		if err != nil {
			return err
		}
		if _, err := c.Write([]byte("MONITOR\r\n")); err != nil {
			c.Close()
			return err
		}
		done := make(chan struct{})
		mu.Lock()
		conn, readDone, readErr = c, done, nil
		mu.Unlock()
		go func() {
			defer close(done)
			rd := bufio.NewReaderSize(c, 1<<16)
			for {
				line, err := rd.ReadString('\n')
				mu.Lock()
				if err != nil {
					readErr = err
					mu.Unlock()
					return
				}
				line = strings.TrimSuffix(line, "\r\n")
				if strings.HasPrefix(line, "-") {
					readErr = errors.New(line)
					mu.Unlock()
					return
				}
				feed = append(feed, strings.TrimPrefix(line, "+"))
				mu.Unlock()
			}
		}()
		return nil
	}
	detach := func() {
		mu.Lock()
		c, done := conn, readDone
		mu.Unlock()
		if c != nil {
			c.Close()
			<-done
		}
	}
	// mark sends a marker through another connection and waits until the
	// feed shows it: every command executed before it is then in the feed.
	mark := func(ctx context.Context, what string) error {
		marker := fmt.Sprintf("torture-%s-%d", what, time.Now().UnixNano())
		for range 50 {
			if err := ctl.Echo(ctx, marker).Err(); err != nil {
				return err
			}
			for range 20 {
				mu.Lock()
				n, rerr := len(feed), readErr
				found := false
				for i := n - 1; i >= 0 && i >= n-1000 && !found; i-- {
					found = strings.Contains(feed[i], marker)
				}
				mu.Unlock()
				if found {
					return nil
				}
				if rerr != nil {
					return fmt.Errorf("feed ended: %w", rerr)
				}
				time.Sleep(5 * time.Millisecond)
			}
		}
		return fmt.Errorf("the MONITOR feed did not show the %s marker within 5 s", what)
	}
	fail := func(err error) error {
		detach()
		ctl.Close()
		return fmt.Errorf("redis MONITOR at %s: %w", env.RedisAddr, err)
	}
	if err := attach(ctx); err != nil {
		return nil, fail(err)
	}
	if err := mark(ctx, "start"); err != nil {
		return nil, fail(err)
	}
	return &Recording{
		Stop: func(ctx context.Context) ([]LeaseEvent, error) {
			err := mark(ctx, "end")
			detach()
			ctl.Close()
			if err != nil {
				return nil, fmt.Errorf("redis MONITOR: %w", err)
			}
			return redisHistory(feed, prefix)
		},
		Sync: func(ctx context.Context) error { return mark(ctx, "sync") },
		Restarted: func(ctx context.Context, killedUs int64) error {
			detach()
			mu.Lock()
			feed = append(feed, fmt.Sprintf("RESTART %d", killedUs))
			mu.Unlock()
			if err := attach(ctx); err != nil {
				return fmt.Errorf("redis MONITOR after the restart: %w", err)
			}
			return mark(ctx, "restarted")
		},
	}, nil
}

// isScriptCall reports whether a command runs a script (whose commands show
// in MONITOR as "lua").
func isScriptCall(cmd string) bool {
	switch strings.ToLower(cmd) {
	case "eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro":
		return true
	}
	return false
}

// redisHistory derives the lock changes from MONITOR lines (see redisLease).
func redisHistory(lines []string, prefix string) ([]LeaseEvent, error) {
	type state struct {
		fence uint64
		token [16]byte
		expUs int64
		live  bool
		grant int // index in out of the grant whose PEXPIRE is still to come, or -1
	}
	cur := map[string]*state{}
	var out []LeaseEvent
	callUs := int64(-1) // the time of the script call whose commands follow, or -1
	for i, line := range lines {
		if us, ok := strings.CutPrefix(line, "RESTART "); ok {
			// The server was killed: it forgot every lock at that instant.
			at, err := strconv.ParseInt(us, 10, 64)
			if err != nil {
				return nil, fmt.Errorf("feed line %d: %q", i+1, line)
			}
			keys := make([]string, 0, len(cur))
			for k, s := range cur {
				if s.live && s.expUs <= at {
					s.live = false // expired before the kill: it ended then
				}
				if s.live {
					keys = append(keys, k)
				}
			}
			slices.Sort(keys)
			for _, k := range keys {
				s := cur[k]
				if s.grant >= 0 && out[s.grant].ExpUs == 0 {
					return nil, fmt.Errorf("grant of %s fence %d has no PEXPIRE before the restart", k, s.fence)
				}
				out = append(out, LeaseEvent{Seq: int64(i), Key: k, Fence: s.fence, Token: s.token, AtUs: at,
					ExpUs: s.expUs, Release: true, Lost: true})
				s.live, s.grant = false, -1
			}
			continue
		}
		if line == "" || line[0] < '0' || line[0] > '9' {
			continue // MONITOR's own "OK"
		}
		tsUs, source, args, err := parseMonitorLine(line)
		if err != nil {
			return nil, fmt.Errorf("MONITOR line %d: %w", i+1, err)
		}
		if source != "lua" {
			// A client's command. MONITOR shows a script's call before the
			// commands it runs, stamped before the script takes its time
			// snapshot (Redis 7.0 bases a script's PEXPIRE on it, not on
			// the instant its line shows): the call's time is a lower
			// bound of the script's instant, and the deadlines are taken
			// from it (at most ~1 ms early: a grant while the old lease
			// was live by less than that goes unseen, never a false one).
			callUs = -1
			if len(args) > 0 && isScriptCall(args[0]) {
				callUs = tsUs
			}
			continue
		}
		if len(args) < 2 {
			continue
		}
		at := tsUs // the script's instant, as best the feed knows it
		if callUs >= 0 {
			at = callUs
		}
		key, ok := redisLockKey(args[1], prefix)
		if !ok {
			continue
		}
		s := cur[key]
		if s == nil {
			s = &state{grant: -1}
			cur[key] = s
		}
		switch strings.ToLower(args[0]) {
		case "hset":
			f := map[string]string{}
			for j := 2; j+1 < len(args); j += 2 {
				f[args[j]] = args[j+1]
			}
			fence, err1 := strconv.ParseUint(f["fence"], 10, 64)
			at, err2 := strconv.ParseInt(f["acquired_us"], 10, 64)
			tok, err3 := hex.DecodeString(f["token"])
			if err := errors.Join(err1, err2, err3); err != nil || len(tok) != 16 {
				return nil, fmt.Errorf("MONITOR line %d: grant fields %q: %v", i+1, f, err)
			}
			out = append(out, LeaseEvent{Seq: int64(i), Key: key, Fence: fence, AtUs: at})
			copy(out[len(out)-1].Token[:], tok)
			*s = state{fence: fence, token: out[len(out)-1].Token, live: true, grant: len(out) - 1}
		case "pexpire":
			if len(args) < 3 || !s.live {
				continue // never on a lock this feed has not seen granted
			}
			ms, err := strconv.ParseInt(args[2], 10, 64)
			if err != nil {
				return nil, fmt.Errorf("MONITOR line %d: %w", i+1, err)
			}
			exp := (at/1000 + ms + 1) * 1000 // Redis: live through the deadline's millisecond
			if s.grant >= 0 {
				out[s.grant].ExpUs, s.grant = exp, -1
			} else {
				out = append(out, LeaseEvent{Seq: int64(i), Key: key, Fence: s.fence, Token: s.token, AtUs: at, ExpUs: exp})
			}
			s.expUs = exp
		case "del":
			if !s.live {
				continue // a forced release of a free key deletes nothing
			}
			out = append(out, LeaseEvent{Seq: int64(i), Key: key, Fence: s.fence, Token: s.token, AtUs: tsUs, ExpUs: s.expUs, Release: true})
			s.live, s.grant = false, -1
		}
	}
	for _, e := range out {
		if !e.Release && e.ExpUs == 0 {
			return nil, fmt.Errorf("grant of %s fence %d has no PEXPIRE in the feed", e.Key, e.Fence)
		}
	}
	return out, nil
}

// redisLockKey returns the dlock key of a lock hash's Redis name under
// prefix (not its counter or channel), as redislock names them.
func redisLockKey(name, prefix string) (string, bool) {
	inner, ok := strings.CutPrefix(name, prefix+"{")
	if !ok {
		return "", false
	}
	inner, ok = strings.CutSuffix(inner, "}")
	if !ok || strings.ContainsAny(inner, "{}") {
		return "", false
	}
	return strings.NewReplacer("%25", "%", "%7B", "{", "%7D", "}").Replace(inner), true
}

// parseMonitorLine splits a MONITOR line, `1700000000.123456 [0 lua] "SET"
// "k" "v"`, into the server time in µs, the source ("lua" for a script's
// commands, else the client's address) and the unquoted arguments.
func parseMonitorLine(line string) (tsUs int64, source string, args []string, err error) {
	ts, rest, ok := strings.Cut(line, " [")
	if !ok {
		return 0, "", nil, fmt.Errorf("no source in %q", line)
	}
	sec, frac, ok := strings.Cut(ts, ".")
	s, err1 := strconv.ParseInt(sec, 10, 64)
	us, err2 := strconv.ParseInt(frac, 10, 64)
	if !ok || len(frac) != 6 || err1 != nil || err2 != nil {
		return 0, "", nil, fmt.Errorf("bad time in %q", line)
	}
	src, rest, ok := strings.Cut(rest, "] ")
	if !ok {
		return 0, "", nil, fmt.Errorf("no command in %q", line)
	}
	if _, after, ok := strings.Cut(src, " "); ok {
		src = after
	}
	for rest = strings.TrimSpace(rest); rest != ""; rest = strings.TrimLeft(rest, " ") {
		arg, n, err := unquoteRepr(rest)
		if err != nil {
			return 0, "", nil, fmt.Errorf("%w in %q", err, line)
		}
		args, rest = append(args, arg), rest[n:]
	}
	return s*1e6 + us, src, args, nil
}

// unquoteRepr reads one argument as Redis's sdscatrepr quotes it ("…" with
// \\ \" \n \r \t \a \b and \xHH escapes) from the start of s, and returns it
// and the bytes it took.
func unquoteRepr(s string) (string, int, error) {
	if s == "" || s[0] != '"' {
		return "", 0, errors.New("argument not quoted")
	}
	var b strings.Builder
	for i := 1; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '"':
			return b.String(), i + 1, nil
		case c != '\\':
			b.WriteByte(c)
		case i+1 >= len(s):
			return "", 0, errors.New("truncated escape")
		default:
			i++
			switch s[i] {
			case 'n':
				b.WriteByte('\n')
			case 'r':
				b.WriteByte('\r')
			case 't':
				b.WriteByte('\t')
			case 'a':
				b.WriteByte('\a')
			case 'b':
				b.WriteByte('\b')
			case 'x':
				if i+2 >= len(s) {
					return "", 0, errors.New("truncated \\x escape")
				}
				v, err := strconv.ParseUint(s[i+1:i+3], 16, 8)
				if err != nil {
					return "", 0, err
				}
				b.WriteByte(byte(v))
				i += 2
			default: // \\ and \"
				b.WriteByte(s[i])
			}
		}
	}
	return "", 0, errors.New("unterminated argument")
}

package torture

import (
	"bufio"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/signal"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/go-sql-driver/mysql"
)

// workerEnv is the environment variable that turns the harness binary (or a
// test binary) into a worker: it holds the worker's JSON config.
const workerEnv = "DLOCK_TORTURE_WORKER"

// workerConfig is what the harness tells a worker process.
type workerConfig struct {
	ID       string   `json:"id"`       // w<slot>.<incarnation>
	Strategy string   `json:"strategy"` // adapter name
	Open     OpenArgs `json:"open"`     // for Adapter.Open
	Tag      string   `json:"tag"`      // resource table tag
	Keys     []string `json:"keys"`     // lock keys, also resource rows
	// ModeKeys are keys (also in Keys) taken in other modes: 0 for a
	// reader-writer key (shared holds, and a share of exclusive ones), n
	// for a semaphore of n holders.
	ModeKeys map[string]int `json:"mode_keys,omitempty"`
	// Leader is a key (also in Keys) taken through a dlock.Election, with
	// the worker's ID as value, and observed by every worker.
	Leader    string        `json:"leader,omitempty"`
	TTL       time.Duration `json:"ttl"`       // lease
	Seed      uint64        `json:"seed"`      // for the worker's choices
	LongFrac  float64       `json:"long_frac"` // share of holds up to 2×TTL; the rest up to 50 ms
	NoFencing bool          `json:"no_fencing"`
	ClockRate float64       `json:"clock_rate"` // the Locker's clock rate (1: real time)
	Events    string        `json:"events"`     // path of the JSON-lines record
	Resource  string        `json:"resource"`   // host:port of the resource's MariaDB, if not the DSN's
	// Lanes is how many goroutines run the worker's loop on its one Locker
	// (and so on its store sessions): a worker then holds up to Lanes
	// locks at once.
	Lanes        int      `json:"lanes"`
	ClientFaults []string `json:"client_faults"` // client fault kinds the worker injects
}

// RunWorkerIfRequested runs a worker and exits if this process was started
// as one (see workerEnv); otherwise it returns at once. Call it first thing
// in main, and in TestMain of a test that runs the harness.
func RunWorkerIfRequested() {
	js := os.Getenv(workerEnv)
	if js == "" {
		return
	}
	var cfg workerConfig
	if err := json.Unmarshal([]byte(js), &cfg); err != nil {
		fmt.Fprintln(os.Stderr, "torture worker: bad config:", err)
		os.Exit(2)
	}
	if err := runWorker(cfg); err != nil {
		fmt.Fprintln(os.Stderr, "torture worker:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

func runWorker(cfg workerConfig) error {
	a := adapterByName(cfg.Strategy)
	if a == nil {
		return fmt.Errorf("unknown strategy %q", cfg.Strategy)
	}
	// Stop on SIGTERM, or when the harness goes away (stdin closes). Catch
	// SIGTERM before recording "start" (see notStarted).
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer cancel()
	rec, err := newRecorder(cfg.Events)
	if err != nil {
		return err
	}
	defer rec.close()
	rec.rec(Event{Ev: "start", Pid: os.Getpid(), W: cfg.ID, Pool: cfg.Open.PoolSize})

	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		cancel()
	}()

	b, closeB, err := a.Open(ctx, cfg.Open)
	if err != nil {
		return err
	}
	if closeB != nil {
		defer closeB()
	}
	if err := supportsModes(b, cfg.ModeKeys); err != nil {
		return err
	}
	var clock dlock.Clock // nil: the system clock
	if cfg.ClockRate != 0 && cfg.ClockRate != 1 {
		clock = newRateClock(cfg.ClockRate)
	}
	rdsn := cfg.Open.DSN
	if cfg.Resource != "" {
		mc, err := mysql.ParseDSN(rdsn)
		if err != nil {
			return err
		}
		mc.Net, mc.Addr = "tcp", cfg.Resource
		rdsn = mc.FormatDSN()
	}
	rdb, err := sql.Open("mysql", rdsn)
	if err != nil {
		return err
	}
	defer rdb.Close()
	rdb.SetMaxOpenConns(4)
	w := &worker{
		cfg: cfg,
		rec: rec,
		res: newResource(rdb, cfg.Tag, cfg.NoFencing),
		out: bufio.NewWriter(os.Stdout),
	}
	var obs dlock.Observer
	if slices.Contains(cfg.ClientFaults, ClientObsPanic) {
		obs = panicObserver{}
	}
	w.locker = dlock.New(newTimedBackend(b, rec, cfg.TTL/5, &w.grants), &dlock.Options{
		TTL:      cfg.TTL,
		Clock:    clock,
		Logger:   slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
		Observer: obs,
	})
	// A lane may end the worker early (see doPanic): the slot restarts.
	ctx, w.restart = context.WithCancel(ctx)
	defer w.restart()
	var lanes sync.WaitGroup
	if cfg.Leader != "" {
		lanes.Go(func() { w.observe(ctx) })
	}
	for i := range max(cfg.Lanes, 1) {
		l := &lane{w: w, rng: rand.New(rand.NewPCG(cfg.Seed, 0x746f7274757265+uint64(i)))}
		lanes.Go(func() { l.loop(ctx) })
	}
	lanes.Wait()
	cctx, ccancel := context.WithTimeout(context.Background(), 5*time.Second)
	err = w.locker.Close(cctx)
	ccancel()
	rec.rec(Event{Ev: "exit", Err: errString(err)})
	return nil
}

type worker struct {
	cfg    workerConfig
	rec    *recorder
	res    *Resource
	locker *dlock.Locker
	grants lastGrants // the backend's grants, for Do's functions
	// restart ends the worker's lanes; the worker then closes its Locker
	// and exits, and the harness restarts the slot.
	restart context.CancelFunc

	mu  sync.Mutex
	out *bufio.Writer // state lines for the harness
}

// lane is one goroutine running the worker's loop.
type lane struct {
	w     *worker
	rng   *rand.Rand
	rwBag []bool // the rest of the lane's draws of rwDraws
}

// say tells the harness about a state change: "H key fence plan_ms" when a
// hold starts, "E key" when it ends.
func (w *worker) say(format string, args ...any) {
	w.mu.Lock()
	defer w.mu.Unlock()
	fmt.Fprintf(w.out, format+"\n", args...)
	_ = w.out.Flush()
}

func (l *lane) loop(ctx context.Context) {
	w, ttl := l.w, l.w.cfg.TTL
	for ctx.Err() == nil {
		key := w.cfg.Keys[l.rng.IntN(len(w.cfg.Keys))]
		if key != w.cfg.Leader && l.clientFault(ClientAcqDeadline) && l.rng.Float64() < pAcqDeadline {
			if lk, acq := l.shortAcquire(ctx, key); lk != nil {
				l.held(ctx, lk, acq, false)
				continue
			}
		}
		if w.plain(key) && l.clientFault(ClientDoPanic) && l.rng.Float64() < pDoPanic {
			l.doPanic(ctx, key)
			continue
		}
		if w.plain(key) && l.clientFault(ClientObsPanic) && l.rng.Float64() < pObsPanic {
			l.obsPanicGrant(ctx, key)
			continue
		}
		t0 := Mono()
		actx, cancel := context.WithTimeout(ctx, 10*ttl)
		var lk *dlock.Lock
		var err error
		if key == w.cfg.Leader {
			var term *dlock.Term
			// The value names the worker and, as the Locker's default
			// metadata does, its pid: the store records map an entry
			// no worker reported (a faulted waiter's) to its worker.
			value := fmt.Sprintf("%s pid=%d", w.cfg.ID, os.Getpid())
			if term, err = dlock.NewElection(w.locker, key).Campaign(actx, value, l.acquireOptions(key)...); err == nil {
				lk = term.Lock
			}
		} else {
			lk, err = w.locker.Acquire(actx, key, l.acquireOptions(key)...)
		}
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			w.rec.rec(Event{T0: t0, Ev: "acqerr", K: key, Err: err.Error()})
			sleep(ctx, time.Duration(50+l.rng.IntN(100))*time.Millisecond)
			continue
		}
		l.held(ctx, lk, Event{T0: t0, K: key}, false)
	}
}

// plan draws how long a hold lasts.
func (l *lane) plan() time.Duration {
	if l.rng.Float64() < l.w.cfg.LongFrac {
		return time.Duration(l.rng.Int64N(int64(2 * l.w.cfg.TTL)))
	}
	return time.Duration(l.rng.Int64N(int64(50 * time.Millisecond)))
}

// held records the acquisition of lk (acq: when it was asked for, the key,
// and the client fault of the call if any), works under it and releases it.
// With the acqdeadline fault, a share of holds (not nested ones) take
// another key with a caller deadline half-way, and hold it too: an
// application's short-deadline call while it holds a lock on the same store
// session.
func (l *lane) held(ctx context.Context, lk *dlock.Lock, acq Event, nested bool) {
	w, key := l.w, acq.K
	plan := l.plan()
	fence := lk.Fence()
	mode := accessOf(lk.Mode())
	acq.Ev, acq.F, acq.Plan = "acq", fence, int64(plan)
	if mode != accessExclusive {
		acq.M, acq.N = mode, w.cfg.ModeKeys[key]
	}
	w.rec.rec(acq)
	w.say("H %s %d %d", key, fence, plan.Milliseconds())
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		<-lk.Done()
		t := Mono()
		err := lk.Err()
		w.rec.rec(Event{T: t, Ev: "done", K: key, F: fence, OK: errors.Is(err, dlock.ErrLockLost), Err: errString(err)})
	}()
	others := slices.DeleteFunc(slices.Clone(w.cfg.Keys), func(k string) bool { return k == key || k == w.cfg.Leader })
	if !nested && len(others) > 0 && l.clientFault(ClientAcqDeadline) && l.rng.Float64() < pNested {
		other := others[l.rng.IntN(len(others))]
		l.hold(ctx, mode, key, fence, plan/2, lk.Err)
		if lk.Err() == nil && ctx.Err() == nil {
			if lk2, acq2 := l.shortAcquire(ctx, other); lk2 != nil {
				l.held(ctx, lk2, acq2, true)
			}
			l.hold(ctx, mode, key, fence, plan-plan/2, lk.Err)
		}
	} else {
		l.hold(ctx, mode, key, fence, plan, lk.Err)
	}
	t1 := Mono()
	rctx, rcancel := context.WithTimeout(context.Background(), 5*time.Second)
	ev := Event{T0: t1, Ev: "rel", K: key, F: fence}
	if l.clientFault(ClientRelDeadline) && l.rng.Float64() < pRelDeadline {
		rcancel()
		var dl time.Time
		rctx, rcancel, dl = l.callerDeadline(context.Background(), 2)
		ev.Cf, ev.Dl = ClientRelDeadline, monoOf(dl)
	}
	obsPanicked := false
	if ev.Cf == "" && !nested && w.plain(key) && l.clientFault(ClientObsPanic) && l.rng.Float64() < pObsPanic {
		// The Observer panics as the release starts; the worker recovers.
		var err error
		_, obsPanicked = recoverObsPanic(func() { err = lk.Release(panicking(rctx)) })
		ev.Cf, ev.Err = ClientObsPanic, "observer panic"
		if !obsPanicked {
			ev.Err = fmt.Sprintf("Release returned %v without the Observer's panic", err)
		}
	} else {
		ev.Err = errString(lk.Release(rctx))
	}
	rcancel()
	w.rec.rec(ev)
	<-watched
	w.say("E %s", key)
	if obsPanicked {
		l.letGoCheck(ctx, key, fence, t1, ClientObsPanic)
	}
}

// hold works on the resource under the lock (of mode) for plan: cycles of
// read (which presents the fence), compute, write; a shared holder reads
// twice instead. Before each access it asks
// lost (the Lock's Err, or for Do the cause of its context) and stops if the
// lock is gone, as an application would; the instant of the check goes into
// the access's record. A pause after the check is what the fence is
// for. In a positive control (NoFencing) only reads are checked, so that a
// pause while computing leads to a write.
func (l *lane) hold(ctx context.Context, mode, key string, fence uint64, plan time.Duration, lost func() error) {
	end := Mono() + int64(plan)
	writeCheck := lost
	if l.w.cfg.NoFencing {
		writeCheck = nil
	}
	second := "w"
	if mode == accessShared {
		second = "r"
	}
	for first := true; ; first = false {
		if ctx.Err() != nil || (!first && Mono() >= end) {
			return
		}
		v, ok := l.op(ctx, "r", mode, key, fence, 0, lost)
		if !ok {
			return
		}
		compute := time.Duration(5+l.rng.IntN(45)) * time.Millisecond
		if left := time.Duration(end - Mono()); left < compute {
			compute = max(left, time.Millisecond)
		}
		time.Sleep(compute)
		if _, ok := l.op(ctx, second, mode, key, fence, v, writeCheck); !ok {
			return
		}
	}
}

// op runs one resource access and records it, after checking lost (if not
// nil): a lost lock ends the hold without the access (a skipped write is
// recorded as such). ok is false when the access was skipped, the resource
// refused the token or the access failed.
func (l *lane) op(ctx context.Context, op, mode, key string, fence uint64, readValue int64, lost func() error) (int64, bool) {
	w := l.w
	var chk int64
	if lost != nil {
		// Read the clock first: the check happened at or after chk.
		chk = Mono()
		if lost() != nil {
			if op == "w" {
				w.rec.rec(Event{Ev: "skip", Op: op, K: key, F: fence, M: modeField(mode)})
			}
			return 0, false
		}
	}
	t0 := Mono()
	octx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	var v int64
	var ok bool
	var err error
	a := access{mode: mode, key: key, fence: fence, worker: w.cfg.ID, chk: chk}
	if op == "r" {
		v, ok, err = w.res.Read(octx, a)
	} else {
		ok, err = w.res.Write(octx, a, readValue)
	}
	w.rec.rec(Event{T0: t0, Ev: "op", Op: op, K: key, F: fence, OK: ok, V: v, Err: errString(err), Chk: chk, M: modeField(mode)})
	return v, ok && err == nil
}

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

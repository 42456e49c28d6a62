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
	ID        string        `json:"id"`        // w<slot>.<incarnation>
	Strategy  string        `json:"strategy"`  // adapter name
	Open      OpenArgs      `json:"open"`      // for Adapter.Open
	Tag       string        `json:"tag"`       // resource table tag
	Keys      []string      `json:"keys"`      // lock keys, also resource rows
	TTL       time.Duration `json:"ttl"`       // lease
	Seed      uint64        `json:"seed"`      // for the worker's choices
	LongFrac  float64       `json:"long_frac"` // share of holds up to 2×TTL; the rest up to 50 ms
	NoFencing bool          `json:"no_fencing"`
	ClockRate float64       `json:"clock_rate"` // the Locker's clock rate (1: real time)
	Events    string        `json:"events"`     // path of the JSON-lines record
	Resource  string        `json:"resource"`   // host:port of the resource's MariaDB, if not the DSN's
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
	rec.rec(Event{Ev: "start", Pid: os.Getpid(), W: cfg.ID})

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
		rng: rand.New(rand.NewPCG(cfg.Seed, 0x746f7274757265)),
		out: bufio.NewWriter(os.Stdout),
		locker: dlock.New(newTimedBackend(b, rec, cfg.TTL/5), &dlock.Options{
			TTL:    cfg.TTL,
			Clock:  clock,
			Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
		}),
	}
	w.loop(ctx)
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
	rng    *rand.Rand
	out    *bufio.Writer // state lines for the harness
	locker *dlock.Locker
}

// say tells the harness about a state change: "H key fence plan_ms" when a
// hold starts, "E key" when it ends.
func (w *worker) say(format string, args ...any) {
	fmt.Fprintf(w.out, format+"\n", args...)
	_ = w.out.Flush()
}

func (w *worker) loop(ctx context.Context) {
	ttl := w.cfg.TTL
	for ctx.Err() == nil {
		key := w.cfg.Keys[w.rng.IntN(len(w.cfg.Keys))]
		t0 := Mono()
		actx, cancel := context.WithTimeout(ctx, 10*ttl)
		lk, err := w.locker.Acquire(actx, key, dlock.WithTTL(ttl))
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			w.rec.rec(Event{T0: t0, Ev: "acqerr", K: key, Err: err.Error()})
			sleep(ctx, time.Duration(50+w.rng.IntN(100))*time.Millisecond)
			continue
		}
		plan := time.Duration(w.rng.Int64N(int64(50 * time.Millisecond)))
		if w.rng.Float64() < w.cfg.LongFrac {
			plan = time.Duration(w.rng.Int64N(int64(2 * ttl)))
		}
		fence := lk.Token()
		w.rec.rec(Event{T0: t0, Ev: "acq", K: key, F: fence, Plan: int64(plan)})
		w.say("H %s %d %d", key, fence, plan.Milliseconds())
		watched := make(chan struct{})
		go func() {
			defer close(watched)
			<-lk.Done()
			t := Mono()
			err := lk.Err()
			w.rec.rec(Event{T: t, Ev: "done", K: key, F: fence, OK: errors.Is(err, dlock.ErrLockLost), Err: errString(err)})
		}()
		w.hold(ctx, lk, key, fence, plan)
		t1 := Mono()
		rctx, rcancel := context.WithTimeout(context.Background(), 5*time.Second)
		err = lk.Release(rctx)
		rcancel()
		w.rec.rec(Event{T0: t1, Ev: "rel", K: key, F: fence, Err: errString(err)})
		<-watched
		w.say("E %s", key)
	}
}

// hold works on the resource under the lock for plan: cycles of read (which
// presents the fencing token), compute, write. Loss is checked at the start
// of each cycle only, as an application would between units of work; a pause
// inside a cycle (GC, SIGSTOP) is what the fencing token is for.
func (w *worker) hold(ctx context.Context, lk *dlock.Lock, key string, fence uint64, plan time.Duration) {
	end := Mono() + int64(plan)
	for first := true; ; first = false {
		if lk.Err() != nil || ctx.Err() != nil || (!first && Mono() >= end) {
			return
		}
		v, ok := w.op(ctx, "r", key, fence, 0)
		if !ok {
			return
		}
		compute := time.Duration(5+w.rng.IntN(45)) * time.Millisecond
		if left := time.Duration(end - Mono()); left < compute {
			compute = max(left, time.Millisecond)
		}
		time.Sleep(compute)
		if _, ok := w.op(ctx, "w", key, fence, v); !ok {
			return
		}
	}
}

// op runs one resource access and records it. ok is false when the resource
// refused the token or the access failed.
func (w *worker) op(ctx context.Context, op, key string, fence uint64, readValue int64) (int64, bool) {
	t0 := Mono()
	octx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	var v int64
	var ok bool
	var err error
	if op == "r" {
		v, ok, err = w.res.Read(octx, key, fence, w.cfg.ID)
	} else {
		ok, err = w.res.Write(octx, key, fence, w.cfg.ID, readValue)
	}
	w.rec.rec(Event{T0: t0, Ev: "op", Op: op, K: key, F: fence, OK: ok, V: v, Err: errString(err)})
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

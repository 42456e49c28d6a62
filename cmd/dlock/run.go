package main

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"os/exec"
	"os/signal"
	"os/user"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
	"unicode/utf8"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/mysqllock"
	"github.com/dlock-dev/dlock/pglock"
	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"
)

type runCmd struct {
	a            *app
	ttl          time.Duration
	wait         waitFlag
	noWait       bool
	grace        time.Duration
	owner        string
	conflictCode int
	quiet        bool
	shell        string // -c: COMMAND is `sh -c shell`
	shared       bool   // --shared
	limit        int    // --limit N, when limitSet
	limitSet     bool
	atLeast      time.Duration // --at-least: the key's minimum hold
	lockDelay    time.Duration // --lock-delay
	maxTime      time.Duration // --max-time: COMMAND's longest run (0: none)
	textfile     string        // --metrics-textfile
	fig          runFigures    // what --metrics-textfile writes
}

// waitFlag is --wait/-w: a duration (1m30s) or, as with flock(1), a plain
// number of seconds (30, 0.5). Negative means "as long as it takes".
type waitFlag time.Duration

func (w *waitFlag) String() string {
	if *w < 0 {
		return "forever"
	}
	return time.Duration(*w).String()
}

func (w *waitFlag) Set(v string) error {
	d, err := time.ParseDuration(v)
	if err != nil {
		secs, ferr := strconv.ParseFloat(v, 64)
		if ferr != nil || math.IsNaN(secs) || math.IsInf(secs, 0) || secs > math.MaxInt64/float64(time.Second) {
			return fmt.Errorf("want seconds (30, 0.5) or a duration (1m30s)")
		}
		d = time.Duration(secs * float64(time.Second))
	}
	if d < 0 {
		return fmt.Errorf("negative")
	}
	*w = waitFlag(d)
	return nil
}

func (*waitFlag) Type() string { return "SECONDS|DURATION" }

const runUsage = "usage: dlock run [flags] KEY -- COMMAND [ARGS...], or dlock run [flags] KEY -c 'SHELL COMMAND'"

func (a *app) runCmd() *cobra.Command {
	r := &runCmd{a: a, wait: -1}
	cmd := &cobra.Command{
		Use:   "run [flags] KEY -- COMMAND [ARGS...]\n  dlock run [flags] KEY -c 'SHELL COMMAND'\n  dlock run [flags] -- -KEY -- COMMAND [ARGS...]",
		Short: "Run a command while holding a lock",
		Long: `run acquires KEY, runs COMMAND, and releases KEY when COMMAND exits.

KEY is the first argument that is not a flag; COMMAND follows the -- after
it, and nothing after that -- is read as dlock's. A KEY that starts with '-'
goes after a first --: dlock run [flags] -- -KEY -- COMMAND. With -c, COMMAND is sh -c 'SHELL
COMMAND' and there is nothing after KEY.

COMMAND gets DLOCK_KEY, DLOCK_FENCE (the fence: strictly larger for every new
holder of KEY; DLOCK_TOKEN is the same number, for older scripts) and
DLOCK_OWNER in its environment, and not DLOCK_DB
(it may hold a password). Its exit status is dlock's. SIGINT, SIGTERM and
SIGHUP are forwarded to its process group. At a terminal, COMMAND stays in
dlock's process group so that it can read the terminal: Ctrl-C reaches it
directly, and dlock signals COMMAND alone, not its children. If the lock is
lost while COMMAND runs, COMMAND gets SIGTERM, then SIGKILL after --grace, and
dlock exits with 76. Outside a terminal the lock covers COMMAND's whole
process group: once COMMAND exits, what it left running gets SIGTERM, then
SIGKILL after --grace, before the lock is released. If dlock itself dies,
COMMAND is killed (Linux parent-death signal).

Exit status: COMMAND's (128+N if signal N killed it); 75 (or -E,
--conflict-exit-code) when the store said KEY was held until --wait ran out;
127 when COMMAND is not found, 126 when it cannot be executed;
128+N when signal N ended dlock before COMMAND started; 76 when the lock was
lost while COMMAND ran, also when that is found only at the release; 124
when COMMAND ran past --max-time and was stopped; 64 on
bad usage (and for a key used with another strategy, held with another
--limit, or a store that cannot take --shared or --limit locks); 70 when the
store failed, did not answer within --timeout, or never answered during --wait.

With --shared, any number of --shared runs of KEY hold it at once, and a run
without --shared waits until none does; once such a run waits, new --shared
runs wait behind it, so that readers cannot starve a writer. With --limit N,
at most N runs hold KEY at once; every run of KEY gives the same N (another
N, or a run without --limit while KEY is held with one, exits 64).

With --at-least D, KEY stays held for D from its acquisition even when
COMMAND ends sooner: the release leaves the rest of D on the lease, by the
store's clock, so that a job started by several hosts' cron, whose clocks
disagree by less than D, runs once per period. With --lock-delay D, a lock
lost without a release (dlock killed, paused or cut off from the store) keeps
KEY from others for D past its lease (on getlock, rowlock and advisory: for D
after the store saw it end), so that COMMAND has D to stop; a release frees
it at once. With --max-time D, COMMAND
gets SIGTERM when it has run for D (SIGKILL after --grace), and dlock exits
124 once it has ended and KEY is released.`,
		Example: `  # crontab on every machine: the report runs on one of them at a time
  # (-q: a run skipped because another machine has the lock sends no mail)
  */5 * * * * dlock run -q -n nightly-report -- /usr/local/bin/report

  # wait up to a minute for the lock (-w 60 is the same)
  dlock run --wait 1m deploy -- ./deploy.sh

  # a shell command line; exit 1 if the lock is taken
  dlock run -n -E 1 backup -c 'pg_dump ops | gzip > /backup/ops.gz'

  # readers overlap; the migration waits for them, and holds new readers back
  dlock run --shared schema -- ./report.sh
  dlock run schema -- ./migrate.sh

  # at most 3 encoders at once on this store
  dlock run --limit 3 encoder -- ./encode.sh

  # every host's cron starts it; it runs once per 5 minutes, for at most 4
  */5 * * * * dlock run -q -n --at-least 4m --max-time 4m rollup -- ./rollup.sh`,
		Args: func(cmd *cobra.Command, args []string) error {
			_, _, err := r.splitArgs(cmd.ArgsLenAtDash(), args)
			return err
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			r.limitSet = cmd.Flags().Changed("limit")
			if r.noWait {
				if cmd.Flags().Changed("wait") {
					return usageError("-n (--nonblock) and --wait are exclusive")
				}
				r.wait = 0
			}
			key, argv, _ := r.splitArgs(cmd.ArgsLenAtDash(), args)
			err := r.run(key, argv)
			r.writeFigures(key, err)
			return err
		},
	}
	cmd.SetFlagErrorFunc(func(c *cobra.Command, err error) error {
		// `dlock run KEY ls -la`: the flags were COMMAND's.
		if c.Flags().ArgsLenAtDash() < 0 && len(c.Flags().Args()) >= 2 {
			return usageError("%v: to pass flags to COMMAND, put -- between KEY and COMMAND: dlock run [flags] %s -- %s …", err, c.Flags().Arg(0), c.Flags().Arg(1))
		}
		return usageError("%w", err)
	})
	f := cmd.Flags()
	f.DurationVar(&r.ttl, "ttl", dlock.DefaultTTL, "lease; renewed every ttl/3 while COMMAND runs")
	f.VarP(&r.wait, "wait", "w", "how long to wait for the lock: seconds (30, 0.5) or a duration (1m); 0 gives up at once (default: wait as long as it takes)")
	f.Lookup("wait").DefValue = "forever"
	f.BoolVarP(&r.noWait, "nonblock", "n", false, "give up at once if the lock is held (--wait 0)")
	f.DurationVar(&r.grace, "grace", 10*time.Second, "time between SIGTERM and SIGKILL when the lock is lost")
	f.StringVar(&r.owner, "owner", "", "owner identity shown by `dlock list` and exported as DLOCK_OWNER (default: none; the metadata names user, host, pid and command line)")
	f.IntVarP(&r.conflictCode, "conflict-exit-code", "E", exitConflict, "exit status when the lock was not obtained")
	f.StringVarP(&r.shell, "command", "c", "", "run `SHELL COMMAND` with sh -c instead of COMMAND [ARGS...]")
	f.BoolVarP(&r.quiet, "quiet", "q", false, "no status line while waiting, no message when the lock is not obtained")
	f.BoolVar(&r.shared, "shared", false, "hold KEY shared: any number of --shared runs at once, never with a run without it (which waits for them; new --shared runs wait behind it)")
	f.IntVar(&r.limit, "limit", 0, "at most `N` runs hold KEY at once (a semaphore); every run of KEY must give the same N")
	f.DurationVar(&r.atLeast, "at-least", 0, "keep KEY held at least this long from its acquisition, however soon COMMAND ends (a job run from several hosts' clocks runs once; MySQL and PostgreSQL lease, Redis, SQLite, etcd)")
	f.DurationVar(&r.lockDelay, "lock-delay", 0, "when the lock is lost without a release (dlock killed, paused, cut off), keep KEY from others this long past its lease (session strategies: past its end)")
	f.StringVar(&r.textfile, "metrics-textfile", "", "write the run's figures (acquired, wait, hold, fence, lost, exit status, end time) to `PATH` in the Prometheus text format, for node_exporter's textfile collector")
	f.DurationVar(&r.maxTime, "max-time", 0, "stop COMMAND (SIGTERM, then SIGKILL after --grace) when it has run this long, then release KEY, and exit 124 (default: no limit)")
	return cmd
}

// splitArgs splits run's arguments into KEY and COMMAND. dash is the number
// of arguments before the first -- (-1 without one): KEY -- COMMAND has 1,
// -- -KEY -- COMMAND has 0 (and its second -- among args).
func (r *runCmd) splitArgs(dash int, args []string) (key string, argv []string, err error) {
	switch {
	case dash == 0 && len(args) >= 1:
		key, args = args[0], args[1:]
		if len(args) > 0 {
			if args[0] != "--" {
				return "", nil, usageError("after -- %s, another -- must come before COMMAND: dlock run [flags] -- %s -- COMMAND [ARGS...]", key, key)
			}
			args = args[1:]
		}
	case dash == 1 || (dash < 0 && len(args) == 1 && r.shell != ""):
		key, args = args[0], args[1:]
	case dash < 0 && len(args) >= 2:
		return "", nil, usageError("missing -- between KEY and COMMAND: dlock run [flags] %s -- %s", args[0], strings.Join(args[1:], " "))
	default:
		return "", nil, usageError(runUsage)
	}
	if r.shell != "" {
		if len(args) > 0 {
			return "", nil, usageError("-c gives COMMAND: nothing may follow KEY (%s)", runUsage)
		}
		return key, []string{"sh", "-c", r.shell}, nil
	}
	if len(args) == 0 {
		return "", nil, usageError(runUsage)
	}
	return key, args, nil
}

// closeBound bounds the Locker's Close at the end of a run.
const closeBound = time.Second

func (r *runCmd) run(key string, argv []string) error {
	if r.conflictCode < 0 || r.conflictCode > 255 {
		return usageError("--conflict-exit-code %d is not in 0..255", r.conflictCode)
	}
	switch {
	case r.shared && r.limitSet:
		return usageError("--shared and --limit are exclusive")
	case r.limitSet && (r.limit < 1 || r.limit > dlock.MaxLimit):
		return usageError("--limit %d is not in 1..%d", r.limit, dlock.MaxLimit)
	case r.atLeast < 0:
		return usageError("--at-least %s is negative", r.atLeast)
	case r.maxTime < 0:
		return usageError("--max-time %s is negative", r.maxTime)
	case r.lockDelay < 0:
		return usageError("--lock-delay %s is negative", r.lockDelay)
	case r.grace < 0:
		return usageError("--grace %s is negative", r.grace)
	case r.ttl < dlock.MinTTL || r.ttl > dlock.MaxTTL:
		return usageError("--ttl %s is not in %s..%s", r.ttl, dlock.MinTTL, dlock.MaxTTL)
	}
	if err := dlock.ValidateKey(key); err != nil {
		return usageError("%w", err)
	}
	if _, err := exec.LookPath(argv[0]); err != nil {
		// As a shell says it: 127 not found, 126 found but not executable.
		code := 126
		if errors.Is(err, exec.ErrNotFound) || errors.Is(err, fs.ErrNotExist) {
			code = 127
		}
		return &exitError{code: code, err: err}
	}
	ctx := r.a.ctx // cancelled by a signal until COMMAND starts
	s, err := r.a.openStore(ctx, false)
	if err != nil {
		return err
	}
	defer s.close()
	switch {
	case r.lockDelay > 0 && !s.guard.keepsLockDelay():
		return usageError("%s: --lock-delay: this store's locks end with their session, and it cannot keep a lock-delay", s.name)
	case r.atLeast > 0 && !s.guard.keepsMinHold(!r.shared && !r.limitSet):
		return usageError("%s: --at-least needs a store whose leases outlive dlock at any length (the lease strategies of MySQL, PostgreSQL, Redis, SQLite, etcd) or, without --shared or --limit, a session strategy (getlock, rowlock, advisory)", s.name)
	}
	if s.embedded && !r.quiet && !stdinTerminal() {
		fmt.Fprintf(r.a.stderr, "dlock: no --db or $DLOCK_DB: using this host's embedded store %s, which excludes only processes of this host\n", s.name)
	}
	locker := dlock.New(s.backend, &dlock.Options{TTL: r.ttl, Logger: r.a.log, Metadata: runMetadata(argv)})
	defer func() {
		// The lock was released already: what Close waits for now is the
		// clean-up of a failed acquisition, which may not answer either.
		ctx, cancel := context.WithTimeout(context.Background(), min(r.a.timeout, closeBound))
		defer cancel()
		_ = locker.Close(ctx)
	}()

	start := time.Now()
	lk, err := r.acquire(ctx, locker, s, key)
	if err != nil {
		var ee *exitError
		if errors.As(err, &ee) {
			return err
		}
		if flag := r.modeFlag(); flag != "" && errors.Is(err, dlock.ErrUnsupported) {
			return usageError("%s cannot take %s locks (%w)", s.name, flag, err)
		}
		return r.a.storeErr(s, err)
	}
	r.fig.acquired, r.fig.waited, r.fig.fence = true, time.Since(start), lk.Fence()
	r.a.log.Info("acquired", "key", key, "fence", lk.Fence(), "waited", r.fig.waited)
	return r.supervise(lk, argv)
}

// modeOptions are the acquisition options of --shared and --limit.
func (r *runCmd) modeOptions() []dlock.AcquireOption {
	switch {
	case r.shared:
		return []dlock.AcquireOption{dlock.Shared()}
	case r.limitSet:
		return []dlock.AcquireOption{dlock.WithLimit(r.limit)}
	}
	return nil
}

// modeFlag is the flag that chose the acquisition's mode, or "".
func (r *runCmd) modeFlag() string {
	switch {
	case r.shared:
		return "--shared"
	case r.limitSet:
		return "--limit"
	}
	return ""
}

// storeErr is the exit error for a store call's err: usage for a key of
// another strategy or held in another mode, 128+N after signal N, else a
// failure.
func (a *app) storeErr(s *store, err error) error {
	if sig := a.interruptedBy(); sig != 0 {
		return &exitError{code: 128 + int(sig), err: fmt.Errorf("interrupted by %s", unix.SignalName(sig))}
	}
	if errors.Is(err, mysqllock.ErrOtherStrategy) || errors.Is(err, pglock.ErrOtherStrategy) {
		return usageError("%s: %w", s.name, err)
	}
	if errors.Is(err, dlock.ErrModeMismatch) {
		return usageError("%s: %w (every holder of a key gives the same --limit, or none)", s.name, err)
	}
	return failure(s.explain(err))
}

// acquire takes the lock, showing a status line on a terminal while waiting.
// When the lock is not obtained, or a signal interrupts the wait, it says so
// (unless -q) and returns an *exitError with the exit status. A wait that
// runs out while the store fails, or before the store ever answered, is a
// failure, not a conflict.
func (r *runCmd) acquire(ctx context.Context, locker *dlock.Locker, s *store, key string) (*dlock.Lock, error) {
	opts := append([]dlock.AcquireOption{dlock.WithOwner(r.owner), dlock.WithMinHold(r.atLeast), dlock.WithLockDelay(r.lockDelay)}, r.modeOptions()...)
	if r.wait == 0 {
		lk, err := locker.TryAcquire(ctx, key, opts...)
		var he *dlock.HeldError
		switch {
		case r.a.interruptedBy() != 0:
			return nil, r.interrupted(lk, key, "")
		case errors.As(err, &he):
			return nil, r.notObtained(r.conflictCode, "%q is held%s (not waiting)", key, holderDetails(he.Holder))
		case errors.Is(err, dlock.ErrNotAcquired):
			return nil, r.notObtained(r.conflictCode, "%q is held (not waiting)", key)
		}
		return lk, err
	}
	if r.wait > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, time.Duration(r.wait))
		defer cancel()
	}

	var mu sync.Mutex
	var holder *dlock.LockInfo // the last holder reported, if any
	lastHolder := func() *dlock.LockInfo {
		mu.Lock()
		defer mu.Unlock()
		return holder
	}
	start := time.Now()
	status := newStatusLine(r.a.stderr, r.quiet)
	opts = append(opts, dlock.WithWaitFunc(func(h dlock.LockInfo) {
		mu.Lock()
		// A report that says nothing of the holder (a store may not tell
		// after a wait in the server) keeps the last one that did.
		if holder == nil || holderDetails(h) != "" {
			holder = &h
		}
		mu.Unlock()
		status.show(func(width int) string { return waitMessage(key, lastHolder(), time.Since(start), width) })
	}))

	var wg sync.WaitGroup
	stop := make(chan struct{})
	if status.w != nil {
		// Stores that wait in the server report the holder once per wait
		// (up to 30 s with MySQL): count the wait up in between.
		wg.Go(func() {
			t := time.NewTicker(time.Second)
			defer t.Stop()
			for {
				select {
				case <-t.C:
					status.show(func(width int) string { return waitMessage(key, lastHolder(), time.Since(start), width) })
				case <-stop:
					return
				}
			}
		})
	}
	lk, err := locker.Acquire(ctx, key, opts...)
	close(stop)
	wg.Wait()
	status.clear()

	details := ""
	if h := lastHolder(); h != nil && holderDetails(*h) != "" {
		details = ", held" + holderDetails(*h)
	}
	switch {
	case r.a.interruptedBy() != 0:
		return nil, r.interrupted(lk, key, details)
	case errors.Is(err, dlock.ErrNotAcquired):
		if ferr := s.guard.failed(); ferr != nil {
			return nil, failure(s.explain(fmt.Errorf("gave up after %s waiting for %q: %w", time.Duration(r.wait), key, ferr)))
		}
		return nil, r.notObtained(r.conflictCode, "gave up after %s waiting for %q%s", time.Duration(r.wait), key, details)
	}
	return lk, err
}

// interrupted releases lk, if the lock was obtained as the signal came (the
// command does not start), and returns the exit for the signal.
func (r *runCmd) interrupted(lk *dlock.Lock, key, details string) error {
	if lk != nil {
		lk.Release(context.Background())
	}
	sig := r.a.interruptedBy()
	return r.notObtained(128+int(sig), "interrupted by %s while waiting for %q%s", unix.SignalName(sig), key, details)
}

// notObtained says (unless -q) why the lock was not obtained, and returns an
// *exitError with code: the conflict code, or 128+N after signal N.
func (r *runCmd) notObtained(code int, format string, args ...any) error {
	if !r.quiet {
		fmt.Fprintf(r.a.stderr, "dlock: "+format+"\n", args...)
	}
	return &exitError{code: code}
}

// supervise runs COMMAND and the single select over its exit, signals and
// lock loss, then releases the lock. A lock lost while COMMAND ran is exit
// 76 whenever dlock learns it: during the run, or at the release.
func (r *runCmd) supervise(lk *dlock.Lock, argv []string) error {
	heldFrom := time.Now()
	defer func() { r.fig.held = time.Since(heldFrom) }()
	defer lk.Release(context.Background())
	// From now on signals go to COMMAND.
	r.a.stopWatch()
	if r.a.interruptedBy() != 0 {
		return r.interrupted(nil, lk.Key(), "")
	}
	sigs := r.a.sigs
	child := exec.Command(argv[0], argv[1:]...)
	child.Stdin, child.Stdout, child.Stderr = os.Stdin, os.Stdout, os.Stderr
	child.Env = append(childEnviron(),
		"DLOCK_KEY="+lk.Key(),
		"DLOCK_FENCE="+strconv.FormatUint(lk.Fence(), 10),
		"DLOCK_TOKEN="+strconv.FormatUint(lk.Fence(), 10),
		"DLOCK_OWNER="+lk.Owner())
	// Run from cron, systemd or a script, COMMAND gets its own process group,
	// so that forwarded signals and the SIGTERM and SIGKILL of a lost lock
	// reach the whole job, grandchildren included.
	//
	// At a terminal (stdin is one, and dlock's group is its foreground group)
	// a new group would be a background group, and a COMMAND that reads the
	// terminal would stop with SIGTTIN. There COMMAND stays in dlock's group,
	// as with `timeout --foreground`: it reads the terminal, gets the
	// terminal's Ctrl-C itself, and Ctrl-Z and fg stop and resume dlock and
	// COMMAND together. The price: dlock signals COMMAND alone, not its
	// children. Making COMMAND's group the foreground one instead (Foreground
	// in SysProcAttr) would keep group signals, but Ctrl-Z would stop COMMAND
	// alone while the shell waits for dlock, and the other commands of dlock's
	// pipeline (`dlock run … | less`) could no longer read the terminal.
	//
	// Either way COMMAND is killed if dlock dies (Linux), so that it never
	// runs without the lock.
	interactive := foregroundTTY()
	child.SysProcAttr = childAttr(!interactive)
	// In its own group COMMAND would go on while a Ctrl-Z (or a SIGTSTP)
	// stops dlock and its renewals: the lease would run out under a
	// running COMMAND. dlock stops COMMAND's group first, then itself.
	// (As process 1, of a container, dlock cannot stop itself: the kernel
	// drops the signal, and a SIGTSTP does nothing.)
	var tstp, cont chan os.Signal
	if !interactive && !signal.Ignored(syscall.SIGTSTP) && os.Getpid() != 1 {
		tstp, cont = make(chan os.Signal, 1), make(chan os.Signal, 1)
		signal.Notify(tstp, syscall.SIGTSTP, syscall.SIGTTIN, syscall.SIGTTOU)
		signal.Notify(cont, syscall.SIGCONT)
		defer signal.Stop(tstp)
		defer signal.Stop(cont)
	}

	if err := lk.Err(); err != nil { // dlock was paused since the grant, say
		return &exitError{code: exitLockLost, err: fmt.Errorf("lock %q lost before the command started: %w", lk.Key(), err)}
	}
	if err := child.Start(); err != nil {
		return failure(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- child.Wait() }()
	signalJob := func(sig syscall.Signal) {
		send := func(sig syscall.Signal) {
			if interactive {
				_ = child.Process.Signal(sig)
			} else {
				_ = syscall.Kill(-child.Process.Pid, sig)
			}
		}
		send(sig)
		if sig != syscall.SIGKILL {
			// A stopped job (SIGTTIN in the background, say) would
			// keep the signal pending: continue it, as timeout(1) does.
			send(syscall.SIGCONT)
		}
	}

	var lost, termed, overran bool
	var termAt time.Time
	var kill, overrun <-chan time.Time
	var waitErr error
	done := lk.Done()
	if r.maxTime > 0 {
		t := time.NewTimer(r.maxTime)
		defer t.Stop()
		overrun = t.C
	}
loop:
	for {
		select {
		case waitErr = <-exited:
			break loop
		case sig := <-sigs:
			if interactive && sig == syscall.SIGINT {
				// The terminal's Ctrl-C reached COMMAND with dlock, as they
				// share a group; forwarding it would deliver it twice.
				continue
			}
			signalJob(sig.(syscall.Signal))
		case <-done:
			lost, done = true, nil
			fmt.Fprintf(r.a.stderr, "dlock: lock %q lost (%v): stopping the command\n", lk.Key(), lk.Err())
			signalJob(syscall.SIGTERM)
			if !termed {
				termed, termAt = true, time.Now()
			}
			if kill == nil {
				kill = time.After(r.grace)
			}
		case <-overrun:
			overran = true
			fmt.Fprintf(r.a.stderr, "dlock: the command has run for --max-time %s: stopping it\n", r.maxTime)
			signalJob(syscall.SIGTERM)
			if !termed {
				termed, termAt = true, time.Now()
			}
			if kill == nil {
				kill = time.After(r.grace)
			}
		case <-kill:
			signalJob(syscall.SIGKILL)
		case <-tstp:
			_ = syscall.Kill(-child.Process.Pid, syscall.SIGSTOP)
			select {
			case <-cont: // an earlier one (or, rarely, one sent right after the SIGTSTP)
			default:
			}
			_ = syscall.Kill(os.Getpid(), syscall.SIGSTOP)
			// The stop is asynchronous: wait to be continued (fg, bg,
			// SIGCONT). COMMAND goes on only if the lock is still held;
			// a loss is handled as always (SIGTERM, with a SIGCONT).
			<-cont
			if lk.Err() == nil {
				_ = syscall.Kill(-child.Process.Pid, syscall.SIGCONT)
			}
		}
	}
	if !interactive {
		// COMMAND has exited; what it started may not have. The lock must
		// cover the whole job: nothing of its process group outlives it.
		if !termed {
			termAt = time.Now()
		}
		endGroup(child.Process.Pid, !termed, termAt.Add(r.grace))
	}
	// Signals end dlock again; the release is bounded by --timeout.
	r.a.stopWatch = r.a.watchSignals()
	if lost {
		return &exitError{code: exitLockLost}
	}
	code := exitCode(waitErr)
	if time.Now().After(lk.Deadline()) {
		// The lease ran out before its loss was noticed.
		return &exitError{code: exitLockLost, err: fmt.Errorf("lock %q lost while the command ran (its lease ran out unrenewed); the command exited %d", lk.Key(), code)}
	}
	if overran {
		code = exitMaxTime
	}
	// A signal now (systemd stops COMMAND and dlock together) does not cut
	// the release short; a second one does (see watchSignals).
	rctx, cancel := context.WithTimeout(context.Background(), r.a.timeout)
	err := lk.Release(rctx)
	cancel()
	switch {
	case err == nil:
		r.a.log.Info("released", "key", lk.Key(), "fence", lk.Fence(), "held", time.Since(heldFrom), "exit", code)
	case errors.Is(err, dlock.ErrNotHeld):
		return &exitError{code: exitLockLost, err: fmt.Errorf("lock %q lost while the command ran (found at release: %w); the command exited %d", lk.Key(), err, code)}
	default:
		// The lease was held when COMMAND ended; it expires by itself.
		fmt.Fprintf(r.a.stderr, "dlock: could not release %q (%v): it is freed when its lease expires\n", lk.Key(), err)
	}
	return &exitError{code: code}
}

// childEnviron is dlock's environment for COMMAND, without DLOCK_DB: the
// store URL may carry a password.
func childEnviron() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "DLOCK_DB=") {
			env = append(env, kv)
		}
	}
	return env
}

// exitCode maps a child's end to dlock's exit status: its own status, or
// 128+N when signal N killed it.
func exitCode(err error) int {
	var ee *exec.ExitError
	if err == nil {
		return 0
	}
	if errors.As(err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			return 128 + int(ws.Signal())
		}
		return ee.ExitCode()
	}
	return exitFailure
}

// waitMessage is the status line while waiting: how long dlock has waited,
// and what is known of the holder h, if any. When width > 0, a key too
// long for the line is cut in its middle, so that the holder stays in view.
func waitMessage(key string, h *dlock.LockInfo, waited time.Duration, width int) string {
	head := fmt.Sprintf("waiting %s for ", waited.Truncate(time.Second))
	tail := ""
	if h != nil {
		if d := holderDetails(*h); d != "" {
			tail = ": held" + d
		}
	}
	q := []rune(strconv.Quote(key))
	if room := width - 1 - len([]rune(head)) - len([]rune(tail)); width > 0 && len(q) > room && room >= 9 {
		q = append(append(q[:(room-1)/2:(room-1)/2], '…'), q[len(q)-(room-1-(room-1)/2):]...)
	}
	return head + string(q) + tail
}

// holderDetails is "[ shared| limited to N][ by OWNER][ since TIME]": what
// is known of the holder h. The acquisition time stays put while the holder
// renews its lease, and tells a stuck holder from a new one.
func holderDetails(h dlock.LockInfo) string {
	s := ""
	if h.Mode != dlock.ModeExclusive {
		s = " " + modeName(h)
	}
	if h.Owner != "" {
		s += " by " + strconv.Quote(h.Owner)
	} else if h.Metadata != "" {
		s += " by " + strconv.Quote(h.Metadata)
	}
	if !h.AcquiredAt.IsZero() {
		at := h.AcquiredAt.Local()
		layout := "15:04:05"
		if y, m, d := at.Date(); y != time.Now().Year() || m != time.Now().Month() || d != time.Now().Day() {
			layout = "2006-01-02 15:04:05"
		}
		s += " since " + at.Format(layout)
	}
	return s
}

// modeName is how the CLI names a holder's mode: "exclusive", "shared" or
// "limited to N".
func modeName(h dlock.LockInfo) string {
	return dlock.DescribeMode(h.Mode, h.Limit)
}

// statusLine is a one-line status on a terminal, rewritten in place. It is
// safe for concurrent use.
type statusLine struct {
	w    *os.File
	mu   sync.Mutex
	used bool
}

func newStatusLine(w any, quiet bool) *statusLine {
	f, ok := w.(*os.File)
	if !ok || quiet {
		return &statusLine{}
	}
	if fi, err := f.Stat(); err != nil || fi.Mode()&os.ModeCharDevice == 0 {
		return &statusLine{}
	}
	return &statusLine{w: f}
}

// show rewrites the line with msg(width of the terminal), cut to that width. It writes
// only while dlock's process group is the terminal's foreground group: a
// job put in the background (`dlock run … &`, Ctrl-Z then bg) does not draw
// over the shell's prompt.
func (s *statusLine) show(msgFor func(width int) string) {
	if s.w == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	fd := int(s.w.Fd())
	if !foregroundOn(fd) {
		return
	}
	w := termWidth(fd)
	msg := msgFor(w)
	if w > 1 {
		// One column short of the width: a full line would wrap on some
		// terminals, and the next \r would rewrite only its second row.
		if r := []rune(msg); len(r) > w-1 {
			msg = string(r[:w-1])
		}
	}
	s.used = true
	fmt.Fprintf(s.w, "\r\033[K%s", msg)
}

func (s *statusLine) clear() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.used && foregroundOn(int(s.w.Fd())) {
		fmt.Fprint(s.w, "\r\033[K")
	}
}

// runMetadata is what `dlock list` shows of a holder: who runs what, where.
// "user=U host=H pid=P cmd=COMMAND ARGS…", cut to dlock.MaxMetadataLen
// bytes of valid UTF-8.
func runMetadata(argv []string) string {
	name := os.Getenv("USER")
	if u, err := user.Current(); err == nil {
		name = u.Username
	}
	if name == "" {
		name = strconv.Itoa(os.Getuid())
	}
	host, _ := os.Hostname()
	words := make([]string, len(argv))
	for i, w := range argv {
		words[i] = shellWord(w)
	}
	m := fmt.Sprintf("user=%s host=%s pid=%d cmd=%s", name, host, os.Getpid(), strings.Join(words, " "))
	m = strings.ToValidUTF8(strings.ReplaceAll(m, "\x00", ""), "\uFFFD")
	for len(m) > dlock.MaxMetadataLen {
		_, n := utf8.DecodeLastRuneInString(m)
		m = m[:len(m)-n]
	}
	return m
}

// shellWord is w as a shell would need it: as it is, or single-quoted.
func shellWord(w string) string {
	if w != "" && !strings.ContainsFunc(w, func(r rune) bool {
		return !(r == '/' || r == '.' || r == '-' || r == '_' || r == '=' || r == ':' || r == ',' || r == '+' || r == '@' ||
			'a' <= r && r <= 'z' || 'A' <= r && r <= 'Z' || '0' <= r && r <= '9')
	}) {
		return w
	}
	return "'" + strings.ReplaceAll(w, "'", `'\''`) + "'"
}

// endGroup ends what is left of process group pgid: SIGTERM if term, then
// SIGKILL at killAt if some of it still runs, and waits (a few seconds at
// most after the SIGKILL) until none of it is left.
func endGroup(pgid int, term bool, killAt time.Time) {
	alive := func() bool { return syscall.Kill(-pgid, 0) == nil }
	if !alive() {
		return
	}
	if term {
		_ = syscall.Kill(-pgid, syscall.SIGTERM)
		_ = syscall.Kill(-pgid, syscall.SIGCONT) // a stopped process gets it too
	}
	for alive() && time.Now().Before(killAt) {
		time.Sleep(20 * time.Millisecond)
	}
	if !alive() {
		return
	}
	_ = syscall.Kill(-pgid, syscall.SIGKILL)
	for end := time.Now().Add(5 * time.Second); alive() && time.Now().Before(end); {
		time.Sleep(20 * time.Millisecond)
	}
}

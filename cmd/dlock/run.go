package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/spf13/cobra"
)

type runCmd struct {
	a            *app
	ttl          time.Duration
	wait         time.Duration
	grace        time.Duration
	owner        string
	conflictCode int
	quiet        bool
}

func (a *app) runCmd() *cobra.Command {
	r := &runCmd{a: a}
	cmd := &cobra.Command{
		Use:   "run [flags] KEY -- COMMAND [ARGS...]",
		Short: "Run a command while holding a lock",
		Long: `run acquires KEY, runs COMMAND, and releases KEY when COMMAND exits.

COMMAND gets DLOCK_KEY, DLOCK_TOKEN (the fencing token: strictly larger for
every new holder of KEY) and DLOCK_OWNER in its environment. Its exit status is
dlock's. SIGINT, SIGTERM and SIGHUP are forwarded to it. If the lock is lost
while COMMAND runs, COMMAND gets SIGTERM, then SIGKILL after --grace, and dlock
exits with 76. If dlock itself dies, COMMAND is killed (Linux parent-death
signal).

Exit status: COMMAND's; 75 (or --conflict-exit-code) when the lock was not
obtained; 76 when the lock was lost; 64 on bad usage; 70 when the store failed.`,
		Example: `  # crontab on every machine: the report runs on one of them at a time
  */5 * * * * dlock run --db mysql://cron:secret@db:3306/ops --wait 0 nightly-report -- /usr/local/bin/report

  # wait up to a minute for the lock
  dlock run --wait 1m deploy -- ./deploy.sh`,
		Args: func(cmd *cobra.Command, args []string) error {
			if cmd.ArgsLenAtDash() != 1 || len(args) < 2 {
				return usageError("usage: dlock run [flags] KEY -- COMMAND [ARGS...]")
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			if !cmd.Flags().Changed("wait") {
				r.wait = -1
			}
			return r.run(args[0], args[1:])
		},
	}
	f := cmd.Flags()
	f.DurationVar(&r.ttl, "ttl", dlock.DefaultTTL, "lease; renewed every ttl/3 while COMMAND runs")
	f.DurationVar(&r.wait, "wait", 0, "how long to wait for the lock; 0 gives up at once (default: wait as long as it takes)")
	f.DurationVar(&r.grace, "grace", 10*time.Second, "time between SIGTERM and SIGKILL when the lock is lost")
	f.StringVar(&r.owner, "owner", "", "owner identity shown by `dlock list` and exported as DLOCK_OWNER (default: none; the metadata names host and pid)")
	f.IntVar(&r.conflictCode, "conflict-exit-code", exitConflict, "exit status when the lock was not obtained")
	f.BoolVarP(&r.quiet, "quiet", "q", false, "no status line while waiting, no conflict message")
	return cmd
}

func (r *runCmd) run(key string, argv []string) error {
	if r.conflictCode < 0 || r.conflictCode > 255 {
		return usageError("--conflict-exit-code %d is not in 0..255", r.conflictCode)
	}
	if err := dlock.ValidateKey(key); err != nil {
		return usageError("%w", err)
	}
	if _, err := exec.LookPath(argv[0]); err != nil {
		return usageError("%v", err)
	}
	// Signals while waiting abort the wait; later they go to COMMAND.
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	defer signal.Stop(sigs)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	s, err := r.a.openStore(ctx, false)
	if err != nil {
		return err
	}
	defer s.close()
	locker := dlock.New(s.backend, &dlock.Options{TTL: r.ttl, Logger: r.a.log})
	defer locker.Close(context.Background())

	lk, err := r.acquire(ctx, locker, key, sigs)
	if err != nil {
		var he *dlock.HeldError
		switch {
		case errors.As(err, &he) || errors.Is(err, dlock.ErrNotAcquired):
			if !r.quiet {
				fmt.Fprintln(r.a.stderr, "dlock: "+conflictMessage(key, err))
			}
			return &exitError{code: r.conflictCode}
		default:
			return failure(s.explain(err))
		}
	}
	return r.supervise(lk, argv, sigs)
}

// acquire takes the lock, showing a status line on a terminal while waiting.
func (r *runCmd) acquire(ctx context.Context, locker *dlock.Locker, key string, sigs <-chan os.Signal) (*dlock.Lock, error) {
	opts := []dlock.AcquireOption{dlock.WithOwner(r.owner)}
	if r.wait == 0 {
		return locker.TryAcquire(ctx, key, opts...)
	}
	if r.wait > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, r.wait)
		defer cancel()
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-sigs:
			cancel()
		case <-ctx.Done():
		}
	}()
	status := newStatusLine(r.a.stderr, r.quiet)
	defer status.clear()
	opts = append(opts, dlock.WithWaitFunc(func(h dlock.LockInfo) { status.show(waitMessage(key, h)) }))
	return locker.Acquire(ctx, key, opts...)
}

// supervise runs COMMAND and the single select over its exit, signals and
// lock loss.
func (r *runCmd) supervise(lk *dlock.Lock, argv []string, sigs <-chan os.Signal) error {
	defer lk.Release(context.Background())
	child := exec.Command(argv[0], argv[1:]...)
	child.Stdin, child.Stdout, child.Stderr = os.Stdin, os.Stdout, os.Stderr
	child.Env = append(os.Environ(),
		"DLOCK_KEY="+lk.Key(),
		"DLOCK_TOKEN="+strconv.FormatUint(lk.Token(), 10),
		"DLOCK_OWNER="+lk.Owner())
	// Its own process group, so that signals reach the whole job; and killed
	// if dlock dies, so that it never runs without the lock.
	child.SysProcAttr = childAttr()
	if err := child.Start(); err != nil {
		return failure(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- child.Wait() }()
	signalJob := func(sig syscall.Signal) { _ = syscall.Kill(-child.Process.Pid, sig) }

	var lost bool
	var kill <-chan time.Time
	done := lk.Done()
	for {
		select {
		case err := <-exited:
			if lost {
				return &exitError{code: exitLockLost}
			}
			return &exitError{code: exitCode(err)}
		case sig := <-sigs:
			signalJob(sig.(syscall.Signal))
		case <-done:
			lost, done = true, nil
			fmt.Fprintf(r.a.stderr, "dlock: lock %q lost (%v): stopping the command\n", lk.Key(), lk.Err())
			signalJob(syscall.SIGTERM)
			kill = time.After(r.grace)
		case <-kill:
			signalJob(syscall.SIGKILL)
		}
	}
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

func conflictMessage(key string, err error) string {
	var he *dlock.HeldError
	if errors.As(err, &he) {
		return fmt.Sprintf("%s (not waiting)", describeHolder(key, he.Holder))
	}
	return fmt.Sprintf("gave up waiting for %q", key)
}

func waitMessage(key string, h dlock.LockInfo) string {
	return "waiting: " + describeHolder(key, h)
}

func describeHolder(key string, h dlock.LockInfo) string {
	s := fmt.Sprintf("%q is held", key)
	if h.Owner != "" {
		s += " by " + h.Owner
	} else if h.Metadata != "" {
		s += " by " + h.Metadata
	}
	if !h.ExpiresAt.IsZero() {
		s += fmt.Sprintf(", lease expires in %s", time.Until(h.ExpiresAt).Round(time.Second))
	}
	return s
}

// statusLine is a one-line status on a terminal, rewritten in place.
type statusLine struct {
	w    *os.File
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

func (s *statusLine) show(msg string) {
	if s.w == nil {
		return
	}
	s.used = true
	fmt.Fprintf(s.w, "\r\033[K%s", msg)
}

func (s *statusLine) clear() {
	if s.used {
		fmt.Fprint(s.w, "\r\033[K")
	}
}

package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"runtime/debug"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"
)

// Exit codes of dlock itself; a command run by `dlock run` passes its own
// through.
const (
	exitUsage    = 64  // bad flags or arguments (EX_USAGE)
	exitFailure  = 70  // the store failed or another error (EX_SOFTWARE)
	exitConflict = 75  // default for "lock held by someone else" (EX_TEMPFAIL)
	exitLockLost = 76  // the lock was lost while the command ran, or found lost at release
	exitMaxTime  = 124 // COMMAND ran past --max-time (as timeout(1))
)

// DefaultTimeout bounds each store call that does not wait for a holder.
const defaultTimeout = 10 * time.Second

// signalGrace is how long dlock gives a command to end by itself after a
// signal cancelled it (a store client may not honour cancellation) before it
// exits anyway.
const signalGrace = 3 * time.Second

// version is set at build time with -ldflags "-X main.version=…".
var version = ""

// exitError carries an exit code (and possibly no message) up to main.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string {
	if e.err == nil {
		return fmt.Sprintf("exit status %d", e.code)
	}
	return e.err.Error()
}

func (e *exitError) Unwrap() error { return e.err }

type app struct {
	stdout, stderr io.Writer
	log            *slog.Logger
	db             string // --db
	dbSet          bool   // --db was given, maybe empty
	timeout        time.Duration
	verbose        bool
	logFormat      string   // --log-format
	secrets        []string // passwords of the store URL: never printed

	// beforeIO, if set, is called with the parsed store URL instead of
	// opening the store (for tests of argument handling).
	beforeIO func(*storeSpec) error

	// ctx is cancelled by SIGINT, SIGTERM or SIGHUP, except while `run`
	// forwards them to its command (see watchSignals).
	ctx       context.Context
	cancel    context.CancelFunc
	sigs      chan os.Signal
	stopWatch func() // stops the current watchSignals

	mu          sync.Mutex
	interrupted syscall.Signal // the signal that cancelled ctx, or 0
}

func newApp(stdout, stderr io.Writer) *app { return &app{stdout: stdout, stderr: stderr} }

func (a *app) main(args []string) int {
	a.ctx, a.cancel = context.WithCancel(context.Background())
	defer a.cancel()
	a.sigs = make(chan os.Signal, 4)
	for _, sig := range []os.Signal{syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP} {
		// A signal ignored when dlock started (nohup, trap '' HUP) stays
		// ignored, for dlock and for COMMAND.
		if !signal.Ignored(sig) {
			signal.Notify(a.sigs, sig)
		}
	}
	// A write to a closed stderr is an error, not death by SIGPIPE (which
	// would leave the lock and COMMAND's group behind). COMMAND gets the
	// default action back at exec, unlike with signal.Ignore.
	signal.Notify(make(chan os.Signal, 1), syscall.SIGPIPE)
	defer signal.Stop(a.sigs)
	a.stopWatch = a.watchSignals()
	defer func() { a.stopWatch() }()

	// A mistyped command line may make the flag parser echo a store URL.
	a.secrets = urlSecrets(append(args, os.Getenv("DLOCK_DB")))
	root := a.rootCmd()
	root.SetArgs(args)
	root.SetOut(a.stdout)
	root.SetErr(a.stderr)
	err := root.Execute()
	var ee *exitError
	sig := a.interruptedBy()
	switch {
	case errors.As(err, &ee) && (sig == 0 || ee.code == 128+int(sig)):
		if ee.err != nil {
			a.printErr(ee.err)
		}
		return ee.code
	case sig != 0:
		a.printErr(fmt.Errorf("interrupted by %s", unix.SignalName(sig)))
		return 128 + int(sig)
	case err == nil:
		return 0
	default: // cobra's own flag and argument errors
		a.printErr(err)
		return exitUsage
	}
}

// watchSignals cancels a.ctx at the first SIGINT, SIGTERM or SIGHUP, and
// exits with 128+N if the command has not ended signalGrace later (or at a
// second signal): a signal always ends dlock. stop stops watching, so that
// `run` can forward signals to its command.
func (a *app) watchSignals() (stop func()) {
	stopc, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		var sig os.Signal
		select {
		case sig = <-a.sigs:
		case <-stopc:
			return
		}
		sn := sig.(syscall.Signal)
		a.mu.Lock()
		a.interrupted = sn
		a.mu.Unlock()
		a.cancel()
		select {
		case <-time.After(signalGrace):
		case <-a.sigs:
		case <-stopc:
			return
		}
		a.printErr(fmt.Errorf("interrupted by %s", unix.SignalName(sn)))
		os.Exit(128 + int(sn))
	}()
	var once sync.Once
	return func() { once.Do(func() { close(stopc); <-done }) }
}

// interruptedBy returns the signal that cancelled a.ctx, or 0.
func (a *app) interruptedBy() syscall.Signal {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.interrupted
}

func usageError(format string, args ...any) error {
	return &exitError{code: exitUsage, err: fmt.Errorf(format, args...)}
}

// failure marks err as a store or internal failure, unless it already
// carries an exit code.
func failure(err error) error {
	var ee *exitError
	if errors.As(err, &ee) {
		return err
	}
	return &exitError{code: exitFailure, err: err}
}

// printErr prints an error on one line prefixed with "dlock:", without the
// store URL's passwords.
func (a *app) printErr(err error) {
	lines := strings.FieldsFunc(err.Error(), func(r rune) bool { return r == '\n' || r == '\r' })
	for i, l := range lines {
		lines[i] = strings.TrimSpace(l)
	}
	msg := strings.Join(lines, " ")
	msg = scrubSecrets(msg, a.secrets)
	if !strings.HasPrefix(msg, "dlock: ") {
		msg = "dlock: " + msg
	}
	fmt.Fprintln(a.stderr, msg)
}

func (a *app) rootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:   "dlock",
		Short: "Distributed locks on the database you already run",
		Long: `dlock runs a command under a lock shared by every machine that uses the same
store, so that a cron job installed on N machines runs on one at a time.

Stores (--db or $DLOCK_DB):
  mysql://user:pass@host:3306/db[?table=dlock_locks&strategy=lease|getlock|rowlock]
         [&doorbell=off|host:port]   (lease: its doorbells off, or on one server: Galera)
  postgres://user:pass@host:5432/db[?table=dlock_locks&strategy=lease|advisory&sslmode=…]
  redis://[user:pass@]host:6379/0[?prefix=dlock:]
  etcd://host:2379[,host2:2379…][?prefix=/dlock/]
  zk://host:2181[,host2:2181…][?root=/dlock&session=30s]   (--ttl at most the session)
  sqlite:///path/to/locks.db
  (none)  the embedded default: a SQLite file in $XDG_STATE_HOME/dlock/locks.db
          (else ~/.local/state/dlock/locks.db), for processes of one host

Percent-encode / ? # @ % in user names, passwords and parameter values
(# is %23). An empty --db or $DLOCK_DB is an error: leave both unset for the
embedded store.`,
		Example: `  dlock run --wait 0 nightly-report -- /usr/local/bin/report
  dlock --db mysql://cron:secret@db:3306/ops migrate
  dlock --db mysql://cron:secret@db:3306/ops list --json`,
		SilenceUsage:  true,
		SilenceErrors: true,
		PersistentPreRunE: func(cmd *cobra.Command, _ []string) error {
			a.dbSet = cmd.Flags().Changed("db")
			if a.timeout <= 0 {
				return usageError("--timeout %s is not positive", a.timeout)
			}
			log, err := newLogger(a.stderr, a.verbose, a.logFormat)
			if err != nil {
				return err
			}
			a.log = log
			routeDriverLogs(log)
			return nil
		},
	}
	root.PersistentFlags().StringVar(&a.db, "db", "", "lock store URL (default $DLOCK_DB, else the embedded SQLite store)")
	root.PersistentFlags().DurationVar(&a.timeout, "timeout", defaultTimeout, "bound on each store call that does not wait for the lock (connecting included)")
	root.PersistentFlags().BoolVarP(&a.verbose, "verbose", "v", false, "log to stderr: acquisitions and releases with wait and hold times, renewal failures, lock losses, the store clients' own messages")
	root.PersistentFlags().StringVar(&a.logFormat, "log-format", "text", "format of -v's log lines: text or json (one JSON object a line)")
	root.Version = versionString()
	root.SetVersionTemplate("dlock {{.Version}}\n")
	root.AddCommand(a.runCmd(), a.leaderCmd(), a.listCmd(), a.releaseCmd(), a.migrateCmd(), a.doctorCmd(), a.versionCmd())
	return root
}

func (a *app) versionCmd() *cobra.Command {
	return &cobra.Command{
		Use:     "version",
		Short:   "Print dlock's version",
		Example: "  dlock version\n  dlock --version",
		Args:    cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			fmt.Fprintln(a.stdout, "dlock", versionString())
			return nil
		},
	}
}

// versionString is the module version (or the one set with -ldflags
// "-X main.version=…"), then the VCS commit and time the binary was built
// from, when the go command recorded them: "v0.1.0", "(devel) commit
// 0123abcd… 2026-01-02T03:04:05Z, modified".
func versionString() string {
	bi, ok := debug.ReadBuildInfo()
	return formatVersion(version, bi, ok)
}

func formatVersion(v string, bi *debug.BuildInfo, ok bool) string {
	if v == "" {
		v = "(devel)"
		if ok && bi.Main.Version != "" {
			v = bi.Main.Version
		}
	}
	if !ok {
		return v
	}
	var rev, at string
	var modified bool
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.time":
			at = s.Value
		case "vcs.modified":
			modified = s.Value == "true"
		}
	}
	if rev != "" {
		v += " commit " + rev
		if at != "" {
			v += " " + at
		}
		if modified {
			v += ", modified"
		}
	}
	return v
}

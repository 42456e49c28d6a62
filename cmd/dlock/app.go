package main

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"runtime/debug"
	"strings"

	"github.com/spf13/cobra"
)

// Exit codes of dlock itself; a command run by `dlock run` passes its own
// through.
const (
	exitUsage    = 64 // bad flags or arguments (EX_USAGE)
	exitFailure  = 70 // the store failed or another error (EX_SOFTWARE)
	exitConflict = 75 // default for "lock held by someone else" (EX_TEMPFAIL)
	exitLockLost = 76 // the lock was lost while the command ran
)

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
	verbose        bool
}

func newApp(stdout, stderr io.Writer) *app { return &app{stdout: stdout, stderr: stderr} }

func (a *app) main(args []string) int {
	root := a.rootCmd()
	root.SetArgs(args)
	err := root.Execute()
	var ee *exitError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &ee):
		if ee.err != nil {
			a.printErr(ee.err)
		}
		return ee.code
	default: // cobra's own flag and argument errors
		a.printErr(err)
		return exitUsage
	}
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

// printErr prints an error once prefixed with "dlock:".
func (a *app) printErr(err error) {
	msg := err.Error()
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
  postgres://user:pass@host:5432/db[?table=dlock_locks&strategy=lease|advisory&sslmode=…]
  redis://[user:pass@]host:6379/0[?prefix=dlock:]
  etcd://host:2379[,host2:2379…][?prefix=/dlock/]
  zk://host:2181[,host2:2181…][?root=/dlock&session=30s]   (--ttl at most the session)
  sqlite:///path/to/locks.db
  (none)  the embedded default: a SQLite file in $XDG_STATE_HOME/dlock/locks.db
          (else ~/.local/state/dlock/locks.db), for processes of one host`,
		Example: `  dlock run --wait 0 nightly-report -- /usr/local/bin/report
  dlock --db mysql://cron:secret@db:3306/ops migrate
  dlock --db mysql://cron:secret@db:3306/ops list --json`,
		SilenceUsage:  true,
		SilenceErrors: true,
		PersistentPreRun: func(*cobra.Command, []string) {
			level := slog.LevelError + 1 // silent
			if a.verbose {
				level = slog.LevelDebug
			}
			a.log = slog.New(slog.NewTextHandler(a.stderr, &slog.HandlerOptions{Level: level}))
		},
	}
	root.PersistentFlags().StringVar(&a.db, "db", "", "lock store URL (default $DLOCK_DB, else the embedded SQLite store)")
	root.PersistentFlags().BoolVarP(&a.verbose, "verbose", "v", false, "log renewal failures and lock losses to stderr")
	root.AddCommand(a.runCmd(), a.listCmd(), a.releaseCmd(), a.migrateCmd(), a.versionCmd())
	return root
}

func (a *app) versionCmd() *cobra.Command {
	return &cobra.Command{
		Use:     "version",
		Short:   "Print dlock's version",
		Example: "  dlock version",
		Args:    cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			v := version
			if v == "" {
				v = "(devel)"
				if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" {
					v = bi.Main.Version
				}
			}
			fmt.Fprintln(a.stdout, "dlock", v)
			return nil
		},
	}
}

package torture

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"
)

// mariadbd is the server binary the restart fault kills and starts.
const mariadbd = "/usr/sbin/mariadbd"

// findServer returns the pid and arguments of the running mariadbd.
func findServer() (int, []string, error) {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return 0, nil, err
	}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		exe, err := os.Readlink(filepath.Join("/proc", e.Name(), "exe"))
		if err != nil || exe != mariadbd {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		parts := bytes.Split(bytes.TrimRight(cmdline, "\x00"), []byte{0})
		var args []string
		for _, p := range parts[1:] {
			args = append(args, string(p))
		}
		return pid, args, nil
	}
	return 0, nil, errors.New("no running " + mariadbd)
}

// restartMariaDB kills the local MariaDB with SIGKILL, starts it again with
// the same arguments through start-stop-daemon, and waits (bounded) until it
// answers queries.
func restartMariaDB(ctx context.Context, env *Env) (killed, ready int64, err error) {
	pid, args, err := findServer()
	if err != nil {
		return 0, 0, err
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		return 0, 0, fmt.Errorf("kill mariadbd %d: %w", pid, err)
	}
	killed = Mono()
	for deadline := time.Now().Add(30 * time.Second); ; {
		if _, err := os.Stat(filepath.Join("/proc", strconv.Itoa(pid))); errors.Is(err, os.ErrNotExist) {
			break
		}
		if time.Now().After(deadline) {
			return killed, 0, fmt.Errorf("mariadbd %d did not die", pid)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := startMariaDB(ctx, args); err != nil {
		return killed, 0, err
	}
	if err := waitReady(ctx, env.DB, 120*time.Second); err != nil {
		return killed, 0, err
	}
	return killed, Mono(), nil
}

func startMariaDB(ctx context.Context, args []string) error {
	cmdArgs := append([]string{"--start", "--oknodo", "--background", "--exec", mariadbd}, "--")
	cmdArgs = append(cmdArgs, args...)
	if out, err := exec.CommandContext(ctx, "start-stop-daemon", cmdArgs...).CombinedOutput(); err != nil {
		return fmt.Errorf("start-stop-daemon: %v: %s", err, out)
	}
	return nil
}

// waitReady pings db until it answers or the bound passes.
func waitReady(ctx context.Context, db *sql.DB, bound time.Duration) error {
	deadline := time.Now().Add(bound)
	for {
		pctx, cancel := context.WithTimeout(ctx, time.Second)
		var one int
		err := db.QueryRowContext(pctx, "SELECT 1").Scan(&one)
		cancel()
		if err == nil {
			return nil
		}
		if ctx.Err() != nil || time.Now().After(deadline) {
			return fmt.Errorf("MariaDB not ready after %s: %w", bound, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// ensureMariaDB starts MariaDB if it is not serving (used after a restart
// mode run, whatever happened, so that the server is left running).
func ensureMariaDB(db *sql.DB) error {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	err := db.PingContext(ctx)
	cancel()
	if err == nil {
		return nil
	}
	if _, _, ferr := findServer(); ferr != nil {
		if err := startMariaDB(context.Background(), nil); err != nil {
			return err
		}
	}
	return waitReady(context.Background(), db, 120*time.Second)
}

package torture

import (
	"context"
	"database/sql"
	"fmt"
	"os/exec"
	"time"
)

// mariadbd is the server binary ensureMariaDB starts when the harness leaves
// the server down.
const mariadbd = "/usr/sbin/mariadbd"

// restartMariaDB kills the MariaDB of the mysql strategies (the process
// listening on the store DSN's address: with several servers on the host,
// the one in use) with SIGKILL, starts the same command again (see
// restartListener), and waits (bounded) until it answers queries.
func restartMariaDB(ctx context.Context, env *Env) (killed, ready int64, err error) {
	addr, err := mysqlStoreUpstream(env)
	if err != nil {
		return 0, 0, err
	}
	return restartListener(ctx, env, addr, func(ctx context.Context) error {
		var one int
		return env.StoreDB.QueryRowContext(ctx, "SELECT 1").Scan(&one)
	}, nil)
}

// startMariaDB starts the default server as the machine does.
func startMariaDB(ctx context.Context) error {
	out, err := exec.CommandContext(ctx, "start-stop-daemon", "--start", "--oknodo", "--background", "--exec", mariadbd).CombinedOutput()
	if err != nil {
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

// ensureMariaDB makes sure the MariaDB is serving after a run with restarts,
// whatever happened: it waits for it (bounded), and if it does not come back
// starts the default server through start-stop-daemon.
func ensureMariaDB(db *sql.DB) error {
	if err := waitReady(context.Background(), db, 30*time.Second); err == nil {
		return nil
	}
	if err := startMariaDB(context.Background()); err != nil {
		return err
	}
	return waitReady(context.Background(), db, 120*time.Second)
}

package mysqllock_test

import (
	"context"
	"database/sql"
	"net"
	"slices"
	"testing"
	"time"

	"github.com/dlock-dev/dlock/internal/testproc"
	"github.com/dlock-dev/dlock/mysqllock"
	"github.com/go-sql-driver/mysql"
)

// TestReplicationFindings checks the replication findings Check decides
// from what the server reports.
func TestReplicationFindings(t *testing.T) {
	for _, c := range []struct {
		name string
		r    mysqllock.Replication
		want []string // the findings' settings
	}{
		{"no replicas", mysqllock.Replication{}, nil},
		{"replicas unseen (no privilege)", mysqllock.Replication{Replicas: -1}, nil},
		{"asynchronous replica", mysqllock.Replication{Replicas: 1, SemiSync: "OFF"}, []string{"rpl_semi_sync_master_enabled"}},
		{"no semi-sync plugin", mysqllock.Replication{Replicas: 2}, []string{"rpl_semi_sync_master_enabled"}},
		{"semi-sync after commit", mysqllock.Replication{Replicas: 1, SemiSync: "ON", WaitPoint: "AFTER_COMMIT"}, []string{"rpl_semi_sync_master_wait_point"}},
		{"semi-sync after sync", mysqllock.Replication{Replicas: 1, SemiSync: "ON", WaitPoint: "AFTER_SYNC"}, nil},
		{"semi-sync without replicas", mysqllock.Replication{SemiSync: "OFF"}, nil},
		{"a replica", mysqllock.Replication{IsReplica: true, ReadOnly: true}, []string{"replica_status"}},
		{"read only", mysqllock.Replication{ReadOnly: true}, []string{"read_only"}},
		{"a replica with replicas", mysqllock.Replication{IsReplica: true, Replicas: 1, SemiSync: "OFF"},
			[]string{"replica_status", "rpl_semi_sync_master_enabled"}},
	} {
		var got []string
		for _, f := range mysqllock.ReplicationFindings(c.r) {
			got = append(got, f.Setting)
			if f.Problem == "" || f.Fix == "" || f.Value == "" {
				t.Errorf("%s: finding without value, consequence or fix: %q", c.name, f)
			}
		}
		if !slices.Equal(got, c.want) {
			t.Errorf("%s: findings %q, want %q", c.name, got, c.want)
		}
	}
}

// TestCheckReplication starts a MariaDB primary and an asynchronous replica
// of it: Check on the primary reports the replica until semi-synchronous
// replication with AFTER_SYNC is on, and Check on the replica reports it is
// one.
func TestCheckReplication(t *testing.T) {
	testproc.Short(t, "a MariaDB primary and replica")
	primaryDSN := startMariaDB(t, "--log-bin=binlog", "--sync-binlog=1", "--server-id=1", "--binlog-format=ROW")
	replicaDSN := startMariaDB(t, "--server-id=2", "--report-host=127.0.0.1")
	primary, replica := openDSN(t, primaryDSN), openDSN(t, replicaDSN)
	cfg, err := mysql.ParseDSN(primaryDSN)
	if err != nil {
		t.Fatal(err)
	}
	_, port, _ := net.SplitHostPort(cfg.Addr)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	for _, q := range []string{
		"CHANGE MASTER TO MASTER_HOST='127.0.0.1', MASTER_PORT=" + port + ", MASTER_USER='root', MASTER_USE_GTID=slave_pos",
		"START SLAVE",
	} {
		if _, err := replica.ExecContext(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	settings := func(db *sql.DB) []string {
		b, err := mysqllock.New(db, &mysqllock.Options{Table: scoped("dlock_repl")})
		if err != nil {
			t.Fatal(err)
		}
		defer b.Close()
		fs, err := b.Check(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, f := range fs {
			out = append(out, f.Setting)
		}
		return out
	}
	// until polls (bounded by ctx) until db's findings include want, or
	// no longer include it.
	until := func(db *sql.DB, want string, present bool) {
		t.Helper()
		for {
			got := settings(db)
			if slices.Contains(got, want) == present {
				return
			}
			if ctx.Err() != nil {
				t.Fatalf("findings %q: want %q present=%v", got, want, present)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	until(primary, "rpl_semi_sync_master_enabled", true)
	until(replica, "replica_status", true)
	for _, q := range []string{
		"SET GLOBAL rpl_semi_sync_master_enabled = ON",
		"SET GLOBAL rpl_semi_sync_master_wait_point = AFTER_COMMIT",
	} {
		if _, err := primary.ExecContext(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	until(primary, "rpl_semi_sync_master_wait_point", true)
	if _, err := primary.ExecContext(ctx, "SET GLOBAL rpl_semi_sync_master_wait_point = AFTER_SYNC"); err != nil {
		t.Fatal(err)
	}
	if got := settings(primary); len(got) != 0 {
		t.Errorf("semi-synchronous AFTER_SYNC primary: findings %q, want none", got)
	}
}

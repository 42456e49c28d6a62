package mysqllock

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/go-sql-driver/mysql"
)

// replication is what a server says of its replication, as Check reads it.
type replication struct {
	// Replicas is how many replicas are attached: the larger of the rows
	// of SHOW REPLICA HOSTS and the binlog dump threads in the process list
	// (-1 when neither could be read for want of privileges).
	Replicas int
	// SemiSync is rpl_semi_sync_master_enabled (MariaDB, MySQL before
	// 8.0.26) or rpl_semi_sync_source_enabled, "" when the server has
	// neither (the plugin is not loaded).
	SemiSync string
	// WaitPoint is rpl_semi_sync_master_wait_point or
	// rpl_semi_sync_source_wait_point: AFTER_SYNC or AFTER_COMMIT.
	WaitPoint string
	// ReadOnly is read_only; IsReplica is whether SHOW REPLICA STATUS
	// has rows.
	ReadOnly, IsReplica bool
}

// replicationFindings decides what r breaks: a primary whose replicas
// acknowledge nothing before a commit returns, a semi-synchronous one whose
// commits are seen before a replica has them, and a replica.
func replicationFindings(r replication) []Finding {
	var out []Finding
	if r.IsReplica || r.ReadOnly {
		v := "ON"
		setting := "read_only"
		if r.IsReplica {
			setting, v = "replica_status", "running"
		}
		out = append(out, Finding{
			Setting: setting, Value: v,
			Problem: "this server is a replica: lock writes fail, or land on a copy that its primary's clients do not see (two holders)",
			Fix:     "point the store at the primary",
		})
	}
	if r.Replicas <= 0 {
		return out
	}
	on := strings.EqualFold(r.SemiSync, "ON") || r.SemiSync == "1"
	switch {
	case !on:
		v := r.SemiSync
		if v == "" {
			v = "missing"
		}
		out = append(out, Finding{
			Setting: "rpl_semi_sync_master_enabled", Value: v,
			Problem: strconv.Itoa(r.Replicas) + " replicas replicate asynchronously: a failover to one can lose the last grants (two holders, a repeated fence)",
			Fix: "semi-synchronous replication with rpl_semi_sync_master_wait_point = AFTER_SYNC (rpl_semi_sync_slave_enabled = ON on the replicas, " +
				"a long rpl_semi_sync_master_timeout), and promote only a replica that acknowledged",
		})
	case !strings.EqualFold(r.WaitPoint, "AFTER_SYNC"):
		out = append(out, Finding{
			Setting: "rpl_semi_sync_master_wait_point", Value: r.WaitPoint,
			Problem: "a grant is visible on the primary before a replica acknowledged it, so a failover can lose a grant whose holder already acted",
			Fix:     "SET GLOBAL rpl_semi_sync_master_wait_point = AFTER_SYNC",
		})
	}
	return out
}

// readReplication reads what replicationFindings needs. Variables need no
// privilege; the replica hosts, the process list and the replica status
// do: where they are refused, that part counts as nothing found.
func readReplication(ctx context.Context, db querier) (replication, error) {
	var r replication
	rows, err := db.QueryContext(ctx, `SHOW GLOBAL VARIABLES WHERE Variable_name IN ('read_only',
  'rpl_semi_sync_master_enabled', 'rpl_semi_sync_source_enabled',
  'rpl_semi_sync_master_wait_point', 'rpl_semi_sync_source_wait_point')`)
	if err != nil {
		return r, err
	}
	defer rows.Close()
	for rows.Next() {
		var name, value string
		if err := rows.Scan(&name, &value); err != nil {
			return r, err
		}
		switch name {
		case "read_only":
			r.ReadOnly = value == "ON" || value == "1"
		case "rpl_semi_sync_master_enabled", "rpl_semi_sync_source_enabled":
			r.SemiSync = value
		case "rpl_semi_sync_master_wait_point", "rpl_semi_sync_source_wait_point":
			r.WaitPoint = value
		}
	}
	if err := rows.Close(); err != nil {
		return r, err
	}
	hosts, err := countRows(ctx, db, "SHOW REPLICA HOSTS", "SHOW SLAVE HOSTS")
	if err != nil {
		return r, err
	}
	var dumps int
	if err := queryRow(ctx, db, `SELECT COUNT(*) FROM information_schema.PROCESSLIST
WHERE COMMAND IN ('Binlog Dump', 'Binlog Dump GTID')`, &dumps); err != nil {
		return r, err
	}
	r.Replicas = max(hosts, dumps)
	status, err := countRows(ctx, db, "SHOW REPLICA STATUS", "SHOW SLAVE STATUS")
	if err != nil {
		return r, err
	}
	r.IsReplica = status > 0
	return r, nil
}

// countRows counts the rows of query, or of old (its name before MySQL
// 8.0.22 and MariaDB 10.5) where the server does not know query. A query
// refused for want of privileges counts 0.
func countRows(ctx context.Context, db querier, query, old string) (int, error) {
	rows, err := db.QueryContext(ctx, query)
	var me *mysql.MySQLError
	if errors.As(err, &me) && me.Number == 1064 { // syntax: an older server
		rows, err = db.QueryContext(ctx, old)
	}
	if errors.As(err, &me) && (me.Number == 1227 || me.Number == 1142) { // access denied
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("%s: %w", query, err)
	}
	defer rows.Close()
	n := 0
	for rows.Next() {
		n++
	}
	return n, rows.Close()
}

package pglock

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Severities of a Finding.
const (
	// SeverityWarning: a guarantee of dlock does not hold on this server.
	SeverityWarning = "warning"
	// SeverityInfo: worth knowing, but dlock's guarantees hold.
	SeverityInfo = "info"
)

// A Finding is one thing about a server that weakens what dlock guarantees,
// or is worth knowing about.
type Finding struct {
	// Severity is SeverityWarning or SeverityInfo.
	Severity string
	// Setting names what was found: a server parameter, or "replication".
	Setting string
	// Message is one line: what was found, what it breaks, how to fix it.
	Message string
}

// String returns the finding as one line.
func (f Finding) String() string { return f.Severity + ": " + f.Message }

// Check inspects the settings of pool's server, as a session of pool sees
// them (the server's, the database's and the role's defaults applied), and
// returns one Finding per setting that weakens dlock's guarantees:
//
//   - fsync off: a crash can lose any commit, and corrupt the data
//     directory; fences can repeat and held locks come back free.
//   - full_page_writes off: a crash can leave torn pages; the same.
//   - synchronous_commit not on by default (info): dlock's own grants and
//     renewals commit durably whatever the default, so its guarantees hold.
//   - standbys that replicate asynchronously: a failover to one can lose
//     recent grants, so a fence can be handed out twice and a held lock be
//     free on the new primary.
//
// It needs no tables, and only reads. Rows of pg_stat_replication are
// visible to superusers and members of pg_read_all_stats; for other roles
// that check finds nothing.
func Check(ctx context.Context, pool *pgxpool.Pool) ([]Finding, error) {
	var fsync, fullPages, syncCommit string
	err := pool.QueryRow(ctx, `SELECT current_setting('fsync'), current_setting('full_page_writes'),
  current_setting('synchronous_commit')`).Scan(&fsync, &fullPages, &syncCommit)
	if err != nil {
		return nil, fmt.Errorf("pglock: check: %w", err)
	}
	var out []Finding
	if fsync == "off" {
		out = append(out, Finding{SeverityWarning, "fsync",
			"fsync is off: a crash of the server or its host can lose any commit, so fences can repeat and held locks come back free; set fsync = on"})
	}
	if fullPages == "off" {
		out = append(out, Finding{SeverityWarning, "full_page_writes",
			"full_page_writes is off: a crash can leave torn pages and lose or corrupt lock rows; set full_page_writes = on"})
	}
	if syncCommit != "on" {
		out = append(out, Finding{SeverityInfo, "synchronous_commit",
			fmt.Sprintf("synchronous_commit defaults to %s: other commits may be lost in a crash, but dlock's grants and renewals set it to on for their own transactions, so its guarantees hold", syncCommit)})
	}
	rows, err := pool.Query(ctx, `SELECT COALESCE(application_name, ''), COALESCE(client_addr::text, ''), sync_state
FROM pg_stat_replication WHERE sync_state IN ('async', 'potential') ORDER BY application_name`)
	if err != nil {
		return out, fmt.Errorf("pglock: check replication: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var name, addr, state string
		if err := rows.Scan(&name, &addr, &state); err != nil {
			return out, fmt.Errorf("pglock: check replication: %w", err)
		}
		out = append(out, Finding{SeverityWarning, "replication",
			fmt.Sprintf("standby %q (%s) replicates asynchronously (%s): a failover to it can lose recent grants, handing a fence out twice and freeing held locks; list it in synchronous_standby_names or never promote it", name, addr, state)})
	}
	if err := rows.Err(); err != nil {
		return out, fmt.Errorf("pglock: check replication: %w", err)
	}
	return out, nil
}

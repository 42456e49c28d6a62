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
//     free on the new primary .
//   - the server is itself a standby.
//
// It needs no tables, and only reads. The states of the rows of
// pg_stat_replication are visible to superusers and members of
// pg_read_all_stats; for other roles a standby counts as asynchronous when
// synchronous_standby_names is empty, and is reported as info otherwise.
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
	var r replication
	err = pool.QueryRow(ctx, `SELECT pg_is_in_recovery(), current_setting('synchronous_standby_names')`).Scan(&r.InRecovery, &r.SyncNames)
	if err != nil {
		return out, fmt.Errorf("pglock: check replication: %w", err)
	}
	rows, err := pool.Query(ctx, `SELECT COALESCE(application_name, ''), COALESCE(client_addr::text, ''),
  COALESCE(sync_state, '') FROM pg_stat_replication ORDER BY application_name`)
	if err != nil {
		return out, fmt.Errorf("pglock: check replication: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var s standby
		if err := rows.Scan(&s.Name, &s.Addr, &s.State); err != nil {
			return out, fmt.Errorf("pglock: check replication: %w", err)
		}
		r.Standbys = append(r.Standbys, s)
	}
	if err := rows.Err(); err != nil {
		return out, fmt.Errorf("pglock: check replication: %w", err)
	}
	return append(out, replicationFindings(r)...), nil
}

// replication is what Check reads of a server's replication.
type replication struct {
	InRecovery bool      // pg_is_in_recovery(): the server is a standby
	SyncNames  string    // synchronous_standby_names
	Standbys   []standby // the rows of pg_stat_replication
}

// standby is one row of pg_stat_replication. Name and Addr are empty and
// State is "" for roles that may not read them (neither superusers nor
// members of pg_read_all_stats).
type standby struct {
	Name, Addr string
	State      string // sync_state: sync, quorum, potential or async
}

// replicationFindings returns what r breaks. dlock's grants and renewals
// commit with synchronous_commit on, so a synchronous standby has flushed
// each of them before it counts; a failover to any other standby can lose
// the last grants. A standby in a quorum (ANY n) may lack a grant that the
// others have, and a standby of unknown state counts as asynchronous when
// synchronous_standby_names is empty.
func replicationFindings(r replication) []Finding {
	var out []Finding
	if r.InRecovery {
		out = append(out, Finding{SeverityWarning, "replication",
			"this server is a standby: lock writes fail, and advisory locks taken here are not seen on the primary; point the store at the primary"})
	}
	for _, s := range r.Standbys {
		state := s.State
		if state == "" && r.SyncNames == "" {
			state = "async"
		}
		switch state {
		case "async", "potential":
			out = append(out, Finding{SeverityWarning, "replication",
				fmt.Sprintf("standby %q (%s) replicates asynchronously (%s): a failover to it can lose recent grants, handing a fence out twice and freeing held locks; list it in synchronous_standby_names or never promote it", s.Name, s.Addr, state)})
		case "quorum":
			out = append(out, Finding{SeverityInfo, "replication",
				fmt.Sprintf("standby %q (%s) is one of a quorum: each grant reached enough standbys, not necessarily this one; at a failover, promote the most advanced standby", s.Name, s.Addr)})
		case "":
			out = append(out, Finding{SeverityInfo, "replication",
				"a standby is attached, but this role may not read its sync_state: check that it is sync (grant pg_read_all_stats to see it)"})
		}
	}
	return out
}

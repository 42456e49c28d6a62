package pglock_test

import (
	"slices"
	"testing"

	"github.com/dlock-dev/dlock/pglock"
)

// TestReplicationFindings checks the replication findings Check decides
// from what the server reports.
func TestReplicationFindings(t *testing.T) {
	sb := func(state string) pglock.Standby { return pglock.Standby{Name: "s1", Addr: "10.0.0.2", State: state} }
	for _, c := range []struct {
		name string
		r    pglock.Replication
		want []string // the findings' severities
	}{
		{"no standbys", pglock.Replication{}, nil},
		{"synchronous", pglock.Replication{SyncNames: "s1", Standbys: []pglock.Standby{sb("sync")}}, nil},
		{"asynchronous", pglock.Replication{Standbys: []pglock.Standby{sb("async")}}, []string{pglock.SeverityWarning}},
		{"potential", pglock.Replication{SyncNames: "FIRST 1 (s0, s1)", Standbys: []pglock.Standby{sb("sync"), sb("potential")}}, []string{pglock.SeverityWarning}},
		{"quorum", pglock.Replication{SyncNames: "ANY 1 (s1, s2)", Standbys: []pglock.Standby{sb("quorum")}}, []string{pglock.SeverityInfo}},
		{"state unseen, no synchronous names", pglock.Replication{Standbys: []pglock.Standby{{}}}, []string{pglock.SeverityWarning}},
		{"state unseen, synchronous names", pglock.Replication{SyncNames: "*", Standbys: []pglock.Standby{{}}}, []string{pglock.SeverityInfo}},
		{"a standby", pglock.Replication{InRecovery: true}, []string{pglock.SeverityWarning}},
	} {
		var got []string
		for _, f := range pglock.ReplicationFindings(c.r) {
			got = append(got, f.Severity)
			if f.Setting != "replication" || f.Message == "" {
				t.Errorf("%s: finding %+v", c.name, f)
			}
		}
		if !slices.Equal(got, c.want) {
			t.Errorf("%s: findings %q, want %q", c.name, got, c.want)
		}
	}
}

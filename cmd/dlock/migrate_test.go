package main

import (
	"slices"
	"testing"

	"github.com/dlock-dev/dlock/pglock"
)

// TestSchemaTablesPG checks that migrate names every table of pglock's
// schema, unlogged ones included.
func TestSchemaTablesPG(t *testing.T) {
	schema, err := pglock.Schema("")
	if err != nil {
		t.Fatal(err)
	}
	got := schemaTables(schema)
	for _, want := range []string{"dlock_locks", "dlock_locks_session", "dlock_locks_readers", "dlock_locks_epochs", "dlock_locks_epoch_now", "dlock_locks_claims"} {
		if !slices.ContainsFunc(got, func(s string) bool { return unquote(s) == want }) {
			t.Errorf("tables of pglock's schema: %q, want %s among them", got, want)
		}
	}
}

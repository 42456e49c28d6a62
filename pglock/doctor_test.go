package pglock_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/pglock"
)

// TestCheckFindsUnsafeSettings runs a server with every setting Check knows
// about turned unsafe: each must be found, one line each, and Migrate must
// log them.
func TestCheckFindsUnsafeSettings(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a PostgreSQL server")
	}
	srv := startOwnServer(t, "fsync = off\nfull_page_writes = off\nsynchronous_commit = off\n")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool := srv.pool(t, 0)
	findings, err := pglock.Check(ctx, pool)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"fsync": pglock.SeverityWarning, "full_page_writes": pglock.SeverityWarning, "synchronous_commit": pglock.SeverityInfo}
	for _, f := range findings {
		if strings.Contains(f.String(), "\n") {
			t.Errorf("a finding spans lines: %q", f)
		}
		if sev, ok := want[f.Setting]; !ok || sev != f.Severity {
			t.Errorf("unexpected finding %+v", f)
		}
		delete(want, f.Setting)
	}
	if len(want) > 0 {
		t.Errorf("not found: %v (found %v)", want, findings)
	}
	var logged bytes.Buffer
	b, err := pglock.New(pool, &pglock.Options{Table: "doctor", Logger: slog.New(slog.NewTextHandler(&logged, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if err := b.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"level=WARN msg=\"pglock: fsync is off", "level=WARN msg=\"pglock: full_page_writes is off", "level=INFO msg=\"pglock: synchronous_commit"} {
		if !strings.Contains(logged.String(), s) {
			t.Errorf("Migrate did not log %q:\n%s", s, logged.String())
		}
	}
}

// TestCheckDefaultServer checks the shared test server: Check works and a
// default Logger keeps Migrate silent.
func TestCheckDefaultServer(t *testing.T) {
	pool := open(t, "")
	findings, err := pglock.Check(context.Background(), pool)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range findings {
		t.Log(f)
		if f.Setting == "replication" {
			t.Errorf("a replication finding on a server without standbys: %v", f)
		}
	}
}

// TestGrantCommitsDurably: with synchronous_commit off for the session (as a
// role's or database's default would make it), each advisory grant's
// transaction still commits with synchronous_commit on.
func TestGrantCommitsDurably(t *testing.T) {
	open(t, "")
	cfg := openConfig(t)
	cfg.ConnConfig.RuntimeParams["synchronous_commit"] = "off"
	pool := openWith(t, cfg)
	a := newAdvisory(t, pool)
	var seen []string
	pglock.SetGrantHook(a, func(s string) { seen = append(seen, s) })
	l := dlock.New(a, nil)
	defer l.Close(context.Background())
	lk, err := l.TryAcquire(context.Background(), fmt.Sprintf("durablegrant/%d", time.Now().UnixNano()))
	if err != nil {
		t.Fatal(err)
	}
	lk.Release(context.Background())
	if len(seen) != 1 || seen[0] != "on" {
		t.Errorf("synchronous_commit in the grants' transactions: %v, want [on]", seen)
	}
}

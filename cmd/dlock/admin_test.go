package main

import (
	"database/sql"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// TestListShowsWhatIsThere checks dlock list: control characters escaped in
// the table, times with their zone (RFC 3339 in --json), and the holder's
// user and command line in the default metadata.
func TestListShowsWhatIsThere(t *testing.T) {
	e := embeddedEnv(t)
	key := uniqueKey(t) + "/\x1b[31mred\nline"
	h := startHolder(t, e, "run", "--owner", "bob\ttab", key, "--", "sleep", "30")
	waitHeld(t, e, "e2e/", h)

	r := run(t, e, "list", "e2e/")
	if strings.ContainsAny(r.stdout, "\x1b\t") || strings.Count(r.stdout, "\n") != 2 {
		t.Errorf("list printed control characters: %q", r.stdout)
	}
	if !strings.Contains(r.stdout, `\x1b[31mred\nline"`) || !strings.Contains(r.stdout, `"bob\ttab"`) {
		t.Errorf("list does not show the key and owner escaped: %q", r.stdout)
	}
	if !regexp.MustCompile(`\d\d:\d\d:\d\d [+-]\d\d:\d\d`).MatchString(r.stdout) {
		t.Errorf("list shows a time without its zone: %q", r.stdout)
	}
	if !strings.Contains(r.stdout, "cmd=sleep 30") || !strings.Contains(r.stdout, "user=") {
		t.Errorf("list does not show the holder's user and command line: %q", r.stdout)
	}

	r = run(t, e, "list", "--json", "e2e/")
	var got []struct {
		Key        string `json:"key"`
		AcquiredAt string `json:"acquired_at"`
		Metadata   string `json:"metadata"`
	}
	if err := json.Unmarshal([]byte(r.stdout), &got); err != nil || len(got) != 1 {
		t.Fatalf("list --json: %v %q", err, r.stdout)
	}
	if _, err := time.Parse(time.RFC3339, got[0].AcquiredAt); err != nil || got[0].Key != key {
		t.Errorf("list --json: key %q acquired_at %q (%v); want the key as it is and RFC 3339", got[0].Key, got[0].AcquiredAt, err)
	}
	if !strings.HasPrefix(got[0].Metadata, "user=") || !strings.HasSuffix(got[0].Metadata, " cmd=sleep 30") {
		t.Errorf("default metadata %q, want user=… host=… pid=… cmd=sleep 30", got[0].Metadata)
	}
}

// TestMetadataIsCut checks that a long command line still runs: the
// default metadata is cut to dlock.MaxMetadataLen.
func TestMetadataIsCut(t *testing.T) {
	e := embeddedEnv(t)
	args := []string{"run", uniqueKey(t), "--", "true"}
	for i := range 300 {
		args = append(args, fmt.Sprintf("argument-%d-é", i))
	}
	if r := run(t, e, args...); r.code != 0 {
		t.Errorf("a long command line: exit %d %q", r.code, r.stderr)
	}
}

// TestReleaseFreeKey checks that release says a free key is free, with
// and without --force, and still refuses a held key without --force.
func TestReleaseFreeKey(t *testing.T) {
	e := embeddedEnv(t)
	key := uniqueKey(t)
	for _, args := range [][]string{{"release", key}, {"release", "--force", key}} {
		if r := run(t, e, args...); r.code != 1 || !strings.Contains(r.stderr, "is free") {
			t.Errorf("dlock %q on a free key: exit %d %q, want 1 saying it is free", args, r.code, r.stderr)
		}
	}
	h := startHolder(t, e, "run", "--owner", "carol", key, "--", "sleep", "30")
	waitHeld(t, e, key, h)
	if r := run(t, e, "release", key); r.code != 64 || !strings.Contains(r.stderr, "carol") || !strings.Contains(r.stderr, "--force") {
		t.Errorf("release of a held key without --force: exit %d %q, want 64 naming the holder and --force", r.code, r.stderr)
	}
}

// TestMigrateSaysWhat checks that migrate names the tables it created, and
// says when there was nothing to do.
func TestMigrateSaysWhat(t *testing.T) {
	path := filepath.Join(t.TempDir(), "locks.db")
	e := env{"DLOCK_DB=sqlite://" + path}
	if r := run(t, e, "migrate"); r.code != 0 || !strings.Contains(r.stdout, "created") || !strings.Contains(r.stdout, "dlock_locks") {
		t.Errorf("first migrate: exit %d %q %q, want the tables it created", r.code, r.stdout, r.stderr)
	}
	if r := run(t, e, "migrate"); r.code != 0 || !strings.HasPrefix(r.stdout, "nothing to do") {
		t.Errorf("second migrate: exit %d %q %q, want nothing to do", r.code, r.stdout, r.stderr)
	}
	if testing.Short() {
		return
	}
	if addr := startRedis(t); addr != "" {
		if r := run(t, env{"DLOCK_DB=redis://" + addr + "/0"}, "migrate"); r.code != 0 || !strings.HasPrefix(r.stdout, "nothing to do") {
			t.Errorf("migrate on Redis: exit %d %q %q, want nothing to do", r.code, r.stdout, r.stderr)
		}
	}
	if mysqlStore(t) != nil {
		table := fmt.Sprintf("dlock_cli_mig_%d", os.Getpid())
		e := env{"DLOCK_DB=mysql://root@127.0.0.1:3306/test?table=" + table}
		t.Cleanup(func() {
			db := openMySQLForTest(t)
			defer db.Close()
			db.Exec("DROP TABLE IF EXISTS " + table + ", " + table + "_session, " + table + "_rows, " + table + "_claims, " + table + "_holders, " + table + "_journal, " + table + "_epoch, " + table + "_run")
		})
		if r := run(t, e, "migrate"); r.code != 0 || !strings.Contains(r.stdout, "created") || !strings.Contains(r.stdout, table+"_claims") {
			t.Errorf("first migrate on MySQL: exit %d %q %q", r.code, r.stdout, r.stderr)
		}
		if r := run(t, e, "migrate"); r.code != 0 || !strings.HasPrefix(r.stdout, "nothing to do") {
			t.Errorf("second migrate on MySQL: exit %d %q %q", r.code, r.stdout, r.stderr)
		}
	}
}

func openMySQLForTest(t *testing.T) *sql.DB {
	db, err := sql.Open("mysql", "root@tcp(127.0.0.1:3306)/test")
	if err != nil {
		t.Fatal(err)
	}
	return db
}

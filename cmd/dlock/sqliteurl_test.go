package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestSQLiteURLs checks that a sqlite:// URL names an absolute path in a
// directory that exists: dlock does not create a store where a typo points.
func TestSQLiteURLs(t *testing.T) {
	dir := t.TempDir()
	missing := filepath.Join(dir, "no-such-dir", "locks.db")
	for _, tc := range []struct{ url, want string }{
		{"sqlite://" + missing, "does not exist"},
		{"sqlite://rel/locks.db", "sqlite:///var/lib/dlock/locks.db"},
		{"sqlite://./locks.db", "sqlite:///var/lib/dlock/locks.db"},
		{"sqlite:locks.db", "sqlite:///var/lib/dlock/locks.db"},
		{"sqlite:" + filepath.Join(dir, "locks.db"), "sqlite:///var/lib/dlock/locks.db"},
	} {
		cmd, _, stderr := command(env{"DLOCK_DB=" + tc.url}, "run", "k", "--", "true")
		cmd.Dir = dir
		_ = cmd.Run()
		r := result{code: cmd.ProcessState.ExitCode(), stderr: stderr.String()}
		if r.code != 64 || !strings.Contains(r.stderr, tc.want) {
			t.Errorf("DLOCK_DB=%s: exit %d %q, want 64 saying %q", tc.url, r.code, r.stderr, tc.want)
		}
	}
	if _, err := os.Stat(filepath.Dir(missing)); err == nil {
		t.Errorf("dlock created %s", filepath.Dir(missing))
	}
	for _, rel := range []string{"rel", "."} {
		if _, err := os.Stat(filepath.Join(dir, rel, "locks.db")); err == nil {
			t.Errorf("dlock created a store relative to its working directory")
		}
	}
	good := filepath.Join(dir, "locks.db")
	if r := run(t, env{"DLOCK_DB=sqlite://" + good}, "run", "k", "--", "true"); r.code != 0 {
		t.Errorf("DLOCK_DB=sqlite://%s: exit %d %q", good, r.code, r.stderr)
	}
}

package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"strings"
	"testing"
)

// embeddedEnv is the embedded store in a fresh state directory.
func embeddedEnv(t *testing.T) env { return env{"XDG_STATE_HOME=" + t.TempDir(), "-DLOCK_DB"} }

// TestFlockFlags checks the flags flock(1) users type: -n, -w SECONDS, -E
// CODE and -c.
func TestFlockFlags(t *testing.T) {
	e := embeddedEnv(t)
	key := uniqueKey(t)
	h := startHolder(t, e, "run", "--owner", "alice", key, "--", "sleep", "30")
	waitHeld(t, e, key, h)

	if r := run(t, e, "run", "-n", key, "--", "true"); r.code != 75 || !strings.Contains(r.stderr, "not waiting") {
		t.Errorf("-n on a held key: exit %d %q, want 75 (not waiting)", r.code, r.stderr)
	}
	if r := run(t, e, "run", "-n", "-E", "3", key, "--", "true"); r.code != 3 {
		t.Errorf("-n -E 3 on a held key: exit %d %q, want 3", r.code, r.stderr)
	}
	// A plain number is seconds, as with flock -w.
	if r := run(t, e, "run", "-w", "0.3", key, "--", "true"); r.code != 75 || !strings.Contains(r.stderr, "gave up after 300ms") {
		t.Errorf("-w 0.3 on a held key: exit %d %q, want 75 after 300ms", r.code, r.stderr)
	}
	if r := run(t, e, "run", "--wait", "1", key, "--", "true"); r.code != 75 || !strings.Contains(r.stderr, "gave up after 1s") {
		t.Errorf("--wait 1 on a held key: exit %d %q, want 75 after 1s", r.code, r.stderr)
	}
	if r := run(t, e, "run", "-w", "300ms", key, "--", "true"); r.code != 75 || !strings.Contains(r.stderr, "gave up after 300ms") {
		t.Errorf("-w 300ms on a held key: exit %d %q, want 75 after 300ms", r.code, r.stderr)
	}
	for _, args := range [][]string{
		{"run", "-n", "-w", "1", key, "--", "true"},
		{"run", "-w", "-1", key, "--", "true"},
		{"run", "-w", "soon", key, "--", "true"},
		{"run", "-c", "true", key, "--", "true"},
		{"run", "-c", "true", key, "extra"},
	} {
		if r := run(t, e, args...); r.code != 64 {
			t.Errorf("dlock %q: exit %d %q, want 64", args, r.code, r.stderr)
		}
	}

	free := uniqueKey(t) + "/free"
	r := run(t, e, "run", free, "-c", `echo "in $DLOCK_KEY" | tr a-z A-Z; exit 4`)
	if r.code != 4 || strings.TrimSpace(r.stdout) != "IN "+strings.ToUpper(free) {
		t.Errorf("-c with a shell command line: exit %d stdout %q stderr %q, want 4 and the piped output", r.code, r.stdout, r.stderr)
	}
	if r := run(t, e, "run", "-c", "exit 5", free); r.code != 5 {
		t.Errorf("-c before KEY: exit %d %q, want 5", r.code, r.stderr)
	}
}

// TestRunArguments checks the hints for a missing --, keys that start with
// '-', and the exit status of a COMMAND that cannot be run.
func TestRunArguments(t *testing.T) {
	e := embeddedEnv(t)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"run", "k", "echo", "hi"}, "missing -- between KEY and COMMAND: dlock run [flags] k -- echo hi"},
		{[]string{"run", "k", "ls", "-la"}, "put -- between KEY and COMMAND"},
		{[]string{"run", "--", "-k", "ls"}, "another -- must come before COMMAND"},
	} {
		r := run(t, e, tc.args...)
		if r.code != 64 || !strings.Contains(r.stderr, tc.want) {
			t.Errorf("dlock %q: exit %d %q, want 64 saying %q", tc.args, r.code, r.stderr, tc.want)
		}
	}

	r := run(t, e, "run", "--", "-k", "--", "sh", "-c", `echo "$DLOCK_KEY"`)
	if r.code != 0 || strings.TrimSpace(r.stdout) != "-k" {
		t.Errorf("dlock run -- -k -- COMMAND: exit %d stdout %q stderr %q, want the key -k", r.code, r.stdout, r.stderr)
	}
	if r := run(t, e, "run", "-c", `echo "$DLOCK_KEY"`, "--", "-k2"); r.code != 0 || strings.TrimSpace(r.stdout) != "-k2" {
		t.Errorf("dlock run -c … -- -k2: exit %d stdout %q stderr %q, want the key -k2", r.code, r.stdout, r.stderr)
	}
	// COMMAND's own "--" is COMMAND's.
	if r := run(t, e, "run", "k", "--", "sh", "-c", `echo "$1"`, "sh", "--"); r.code != 0 || strings.TrimSpace(r.stdout) != "--" {
		t.Errorf("a -- among COMMAND's arguments: exit %d stdout %q stderr %q", r.code, r.stdout, r.stderr)
	}

	if r := run(t, e, "run", "k", "--", "/no/such/command"); r.code != 127 {
		t.Errorf("a COMMAND that does not exist: exit %d %q, want 127", r.code, r.stderr)
	}
	if r := run(t, e, "run", "k", "--", "no-such-command-on-the-path"); r.code != 127 || !strings.Contains(r.stderr, "not found") {
		t.Errorf("a COMMAND not on $PATH: exit %d %q, want 127 saying it is not found", r.code, r.stderr)
	}
	notExec := filepath.Join(t.TempDir(), "script")
	if err := os.WriteFile(notExec, []byte("#!/bin/sh\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if r := run(t, e, "run", "k", "--", notExec); r.code != 126 {
		t.Errorf("a COMMAND that is not executable: exit %d %q, want 126", r.code, r.stderr)
	}
}

// TestVersionFlag checks dlock --version next to dlock version, and that a
// binary built from a git checkout names its commit.
func TestVersionFlag(t *testing.T) {
	e := embeddedEnv(t)
	flag, cmd := run(t, e, "--version"), run(t, e, "version")
	if flag.code != 0 || !strings.HasPrefix(flag.stdout, "dlock ") || flag.stdout != cmd.stdout {
		t.Errorf("dlock --version: exit %d %q; dlock version: %q; want the same line", flag.code, flag.stdout, cmd.stdout)
	}
	// The go command stamps the commit only in a checkout whose .git is a
	// directory (not in a git worktree), and not with -buildvcs=false.
	top, err := exec.Command("git", "rev-parse", "--show-toplevel").Output()
	if err != nil {
		t.Logf("not checking the commit: not in a git checkout: %v", err)
		return
	}
	out, _ := exec.Command("go", "version", "-m", binary).Output()
	if fi, err := os.Stat(filepath.Join(strings.TrimSpace(string(top)), ".git")); err != nil || !fi.IsDir() || !strings.Contains(string(out), "vcs.revision=") {
		t.Logf("not checking the commit: the binary has no VCS stamp (a git worktree, or -buildvcs=false)")
		return
	}
	head, _ := exec.Command("git", "rev-parse", "HEAD").Output()
	if !strings.Contains(flag.stdout, "commit "+strings.TrimSpace(string(head))) {
		t.Errorf("dlock --version: %q, want the commit %s", flag.stdout, head)
	}
}

// TestFormatVersion checks the version line built from the build
// information.
func TestFormatVersion(t *testing.T) {
	bi := &debug.BuildInfo{Main: debug.Module{Version: "v0.1.0"}, Settings: []debug.BuildSetting{
		{Key: "vcs.revision", Value: "0123abcd"}, {Key: "vcs.time", Value: "2026-01-02T03:04:05Z"}, {Key: "vcs.modified", Value: "true"}}}
	for _, tc := range []struct {
		v    string
		bi   *debug.BuildInfo
		want string
	}{
		{"", bi, "v0.1.0 commit 0123abcd 2026-01-02T03:04:05Z, modified"},
		{"v9", &debug.BuildInfo{Main: debug.Module{Version: "v0.1.0"}}, "v9"},
		{"", &debug.BuildInfo{}, "(devel)"},
		{"", nil, "(devel)"},
	} {
		if got := formatVersion(tc.v, tc.bi, tc.bi != nil); got != tc.want {
			t.Errorf("formatVersion(%q, …) = %q, want %q", tc.v, got, tc.want)
		}
	}
}

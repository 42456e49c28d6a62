package main

import (
	"encoding/json"
	"strings"
	"testing"
)

// jsonLines parses stderr: each line a JSON object, except dlock's own
// messages ("dlock: …").
func jsonLines(t *testing.T, stderr string) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, line := range strings.Split(strings.TrimRight(stderr, "\n"), "\n") {
		if line == "" || strings.HasPrefix(line, "dlock: ") {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Errorf("--log-format json wrote a line that is not JSON: %q", line)
			continue
		}
		out = append(out, m)
	}
	return out
}

// TestVerboseLogs checks -v's acquired and released lines with wait and
// hold times, in text and JSON.
func TestVerboseLogs(t *testing.T) {
	e := embeddedEnv(t)
	r := run(t, e, "-v", "run", uniqueKey(t), "--", "true")
	if r.code != 0 || !strings.Contains(r.stderr, "msg=acquired") || !strings.Contains(r.stderr, " waited=") ||
		!strings.Contains(r.stderr, "msg=released") || !strings.Contains(r.stderr, " held=") {
		t.Errorf("dlock -v run: exit %d stderr %q, want acquired with waited= and released with held=", r.code, r.stderr)
	}
	if r := run(t, e, "run", uniqueKey(t), "--", "true"); strings.Contains(r.stderr, "acquired") {
		t.Errorf("dlock run without -v logged: %q", r.stderr)
	}
	r = run(t, e, "-v", "--log-format", "json", "run", uniqueKey(t), "--", "true")
	msgs := map[string]map[string]any{}
	for _, m := range jsonLines(t, r.stderr) {
		msgs[m["msg"].(string)] = m
	}
	if r.code != 0 || msgs["acquired"]["waited"] == nil || msgs["released"]["held"] == nil {
		t.Errorf("dlock -v --log-format json run: exit %d stderr %q, want acquired with waited and released with held", r.code, r.stderr)
	}
	if r := run(t, e, "--log-format", "xml", "list"); r.code != 64 {
		t.Errorf("--log-format xml: exit %d %q, want 64", r.code, r.stderr)
	}
}

// TestDriverLogs checks that the store clients' own log lines (the
// ZooKeeper client logs each failed connection) go through dlock's logger:
// JSON with --log-format json, nothing without -v.
func TestDriverLogs(t *testing.T) {
	e := env{"DLOCK_DB=zk://127.0.0.1:1"}
	r := run(t, e, "--timeout", "3s", "list")
	if lines := strings.Split(strings.TrimSpace(r.stderr), "\n"); r.code != 70 || len(lines) != 1 || !strings.HasPrefix(lines[0], "dlock: ") {
		t.Errorf("an unreachable ZooKeeper without -v: exit %d stderr %q, want 70 and one dlock: line", r.code, r.stderr)
	}
	r = run(t, e, "-v", "--log-format", "json", "--timeout", "3s", "list")
	var driver int
	for _, m := range jsonLines(t, r.stderr) {
		if m["driver"] == "zookeeper" {
			driver++
		}
	}
	if r.code != 70 || driver == 0 {
		t.Errorf("an unreachable ZooKeeper with -v --log-format json: exit %d stderr %q, want 70 and the client's lines as JSON", r.code, r.stderr)
	}
}

package main

import (
	"strings"
	"testing"
)

// TestStrategiesDoNotShareKeys checks that a key locked with one strategy
// is refused (exit 64, naming both strategies) to a client of the same
// store with another strategy, while held and after: two strategies on one
// key would not exclude each other.
func TestStrategiesDoNotShareKeys(t *testing.T) {
	groups := map[string][]env{}
	if e := mysqlStore(t); e != nil {
		groups["mysql"] = []env{e, {e[0] + "&strategy=getlock"}, {e[0] + "&strategy=rowlock"}}
	}
	if e := postgresStore(t); e != nil {
		groups["postgres"] = []env{e, {e[0] + "&strategy=advisory"}}
	}
	for name, envs := range groups {
		t.Run(name, func(t *testing.T) {
			for i, first := range envs {
				key := uniqueKey(t)
				h := startHolder(t, first, "run", "--ttl", "2s", "--owner", "alice", key, "--", "sleep", "30")
				waitHeld(t, first, key, h)
				for j, other := range envs {
					if j == i {
						continue
					}
					r := run(t, other, "run", "--wait", "0", key, "--", "true")
					if r.code != exitUsage || !strings.Contains(r.stderr, "strategy") {
						t.Errorf("%s holds %q; %s: exit %d %q, want 64 naming the strategies", first[0], key, other[0], r.code, r.stderr)
					}
					if r := run(t, other, "release", "--force", key); r.code != exitUsage {
						t.Errorf("release --force with %s of a key of %s: exit %d %q, want 64", other[0], first[0], r.code, r.stderr)
					}
				}
				h.cmd.Process.Kill()
				<-h.done
				// Free now, and still refused: the key stays with its strategy.
				for j, other := range envs {
					if j != i {
						if r := run(t, other, "run", "--wait", "5s", key, "--", "true"); r.code != exitUsage {
							t.Errorf("%q used with %s, then %s: exit %d %q, want 64", key, first[0], other[0], r.code, r.stderr)
						}
					}
				}
				if r := run(t, first, "run", "--wait", "20s", key, "--", "true"); r.code != 0 {
					t.Errorf("%q with its own strategy again: exit %d %q", key, r.code, r.stderr)
				}
			}
		})
	}
}

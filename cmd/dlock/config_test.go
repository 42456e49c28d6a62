package main

import (
	"fmt"
	"strings"
	"testing"
)

// testPassword is a password with every character that a URL gives a
// meaning to; no message may show any part of it.
const testPassword = "Tp9#Xq?Wz/Kd@Vm%Lr:Bn&Hy=Jc;"

// leaks returns a substring of at least 3 bytes of password that out
// contains, or "".
func leaks(out, password string) string {
	for i := 0; i+3 <= len(password); i++ {
		if s := password[i : i+3]; strings.Contains(out, s) {
			return s
		}
	}
	return ""
}

// badStoreURLs are store URLs that must be refused before any I/O, without
// showing any part of the password: passwords with URL syntax in them,
// malformed and unknown parameters, empty values.
func badStoreURLs(password string) []string {
	var out []string
	hosts := map[string]string{
		"mysql": "127.0.0.1:1/test", "postgres": "127.0.0.1:1/test", "redis": "127.0.0.1:1/0",
		"etcd": "127.0.0.1:1", "zk": "127.0.0.1:1",
	}
	for scheme, hp := range hosts {
		out = append(out,
			scheme+"://u:"+password+"@"+hp,                  // raw '#', '?', '/', '@', '%' in the password
			scheme+"://u:Top#secret@"+hp,                    // the example
			scheme+"://u:12?tabel=x@"+hp,                    // '?' in a password that starts with digits
			scheme+"://u:12/ab@"+hp,                         // '/' in a password that starts with digits
			scheme+"://u:p@"+hp+"?strategy=getlock;",        // ';' is not a separator
			scheme+"://u:p@"+hp+"?tabel=x",                  // unknown parameter
			scheme+"://u:p@"+hp+"?strategy=",                // empty value
			scheme+"://u:p@"+hp+"?prefix=a&prefix=b",        // repeated parameter
			scheme+"://u:p@"+hp+"?%zz=1",                    // bad escape
			scheme+"://u:p@"+hp+"#frag",                     // a fragment
			scheme+"://u:p@"+hp+"?password=ab&cde=1&fgh=2",  // '&' in a password parameter
			scheme+"://u:"+password+"@"+hp+"?strategy=nope", // a bad value next to a password
		)
	}
	return out
}

// TestStoreURLNeverEchoesPassword checks that a refused store URL gives one
// line, exit 64, and never any part of its password.
func TestStoreURLNeverEchoesPassword(t *testing.T) {
	for _, u := range badStoreURLs(testPassword) {
		for _, args := range [][]string{{"--db", u, "list"}, {"run", "--db", u, "k", "--", "true"}} {
			r := run(t, env{"-DLOCK_DB"}, args...)
			if r.code != exitUsage {
				t.Errorf("dlock %q: exit %d, want 64: %q", args, r.code, r.stderr)
			}
			oneLine(t, fmt.Sprintf("dlock %q", args), r.stderr)
			for _, pw := range []string{testPassword, "Top#secret", "secret", "12?tabel", "12/ab", "ab&cde=1&fgh=2"} {
				if strings.Contains(u, pw) {
					if s := leaks(r.stderr, pw); s != "" {
						t.Errorf("dlock %q shows %q of the password: %q", args, s, r.stderr)
					}
				}
			}
		}
	}
}

// TestPostgresUnknownParameter checks that a misspelt parameter is refused
// instead of reaching the server as a setting.
func TestPostgresUnknownParameter(t *testing.T) {
	pg := postgresStore(t)
	if pg == nil {
		return
	}
	r := run(t, env{pg[0] + "&tabel=x"}, "list")
	if r.code != exitUsage || !strings.Contains(r.stderr, "tabel") {
		t.Errorf("?tabel=x: exit %d %q, want 64 naming the parameter", r.code, r.stderr)
	}
	// Settings the user means are still accepted.
	if r := run(t, env{pg[0] + "&application_name=cron&connect_timeout=3"}, "list"); r.code != 0 {
		t.Errorf("application_name and connect_timeout: exit %d %q", r.code, r.stderr)
	}
}

// TestEmptyStoreIsError checks that an explicitly empty store (an unset
// variable in a crontab) is refused instead of falling back to this host's
// embedded store, and that the embedded store says so when run from a
// non-interactive session.
func TestEmptyStoreIsError(t *testing.T) {
	state := "XDG_STATE_HOME=" + t.TempDir()
	for _, c := range []struct {
		e    env
		args []string
	}{
		{env{state}, []string{"run", "--db", "", "k", "--", "true"}},
		{env{state}, []string{"run", "--db=", "k", "--", "true"}},
		{env{state}, []string{"--db", "", "list"}},
		{env{state, "DLOCK_DB="}, []string{"run", "k", "--", "true"}},
	} {
		r := run(t, c.e, c.args...)
		if r.code != exitUsage || !strings.Contains(r.stderr, "empty") {
			t.Errorf("%q %q: exit %d %q, want 64 saying the store is empty", c.e, c.args, r.code, r.stderr)
		}
		oneLine(t, fmt.Sprintf("%q", c.args), r.stderr)
	}
	// stdin is not a terminal here.
	r := run(t, env{state, "-DLOCK_DB"}, "run", "k", "--", "true")
	if r.code != 0 || !strings.Contains(r.stderr, "embedded") {
		t.Errorf("the embedded store from a non-interactive session: exit %d %q, want 0 and a note", r.code, r.stderr)
	}
	oneLine(t, "embedded store note", r.stderr)
	if r := run(t, env{state, "-DLOCK_DB"}, "run", "-q", "k", "--", "true"); r.code != 0 || r.stderr != "" {
		t.Errorf("-q on the embedded store: exit %d %q, want 0 and nothing", r.code, r.stderr)
	}
}

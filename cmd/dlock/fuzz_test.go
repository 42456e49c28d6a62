package main

import (
	"bytes"
	"errors"
	"net/url"
	"strings"
	"testing"
)

// Fuzz targets for the store URL parser and the argument handling. They run
// in the process, stopping before any I/O. CI runs each for a bounded time:
//
//	go test -run '^$' -fuzz '^FuzzParseStore$' -fuzztime 10s ./cmd/dlock

// fuzzPasswords are the passwords put into fuzzed URLs; no output may show
// a part of one. None holds a Y or a G (FuzzArgs's control password).
var fuzzPasswords = []string{testPassword, "Hq7Zx2Wv9Kj", "Zq8%4Kx:w7@Vm", "p4Qs w0Zd!'()*"}

// fuzzURL builds a URL with password pw in its user info: raw (as a user
// might type it) or encoded.
func fuzzURL(scheme, user, rest string, pw string, encode bool) string {
	if encode {
		return scheme + "://" + url.UserPassword(user, pw).String() + "@" + rest
	}
	return scheme + "://" + user + ":" + pw + "@" + rest
}

// checkNoLeak fails if out shows a part of pw that the input outside the
// password does not explain.
func checkNoLeak(t *testing.T, out, pw string, others ...string) {
	t.Helper()
	s := leaks(out, pw)
	if s == "" {
		return
	}
	for _, o := range others {
		if strings.Contains(o, s) {
			return // the input has it elsewhere
		}
	}
	t.Fatalf("output shows %q of the password %q: %q", s, pw, out)
}

func FuzzParseStore(f *testing.F) {
	for _, s := range []string{"mysql", "postgres", "postgresql", "redis", "rediss", "etcd", "zk", "zookeeper", "sqlite", "memcached"} {
		f.Add(s, "u", "127.0.0.1:1/test", uint8(0), false)
		f.Add(s, "root", "db:3306/ops?strategy=getlock&table=t", uint8(1), true)
		f.Add(s, "u", "h/0?prefix=a&prefix=b", uint8(2), false)
		f.Add(s, "", "h1:2379,h2:2379?prefix=/x/", uint8(3), true)
		f.Add(s, "u", "h/db?strategy=getlock;", uint8(0), true)
		f.Add(s, "u", "h/db?password=ab&cde=1", uint8(1), false)
		f.Add(s, "u", "h:5432/db?sslmode=disable&tabel=x#frag", uint8(2), true)
	}
	f.Fuzz(func(t *testing.T, scheme, user, rest string, which uint8, encode bool) {
		pw := fuzzPasswords[int(which)%len(fuzzPasswords)]
		raw := fuzzURL(scheme, user, rest, pw, encode)
		spec, err := parseStore(raw, "--db")
		if err != nil {
			var ee *exitError
			if !errors.As(err, &ee) || ee.code != exitUsage {
				t.Fatalf("parseStore(%q): %v, want a usage error", raw, err)
			}
			var buf bytes.Buffer
			a := &app{stderr: &buf}
			a.printErr(err)
			if strings.Count(buf.String(), "\n") != 1 {
				t.Fatalf("parseStore(%q): not one line: %q", raw, buf.String())
			}
			checkNoLeak(t, buf.String(), pw, scheme, user, rest)
			return
		}
		checkNoLeak(t, spec.name, pw, scheme, user, rest)
		if strings.ContainsAny(spec.name, "\n\r") {
			t.Fatalf("parseStore(%q): name %q has a line break", raw, spec.name)
		}
	})
}

// FuzzParseStoreRaw feeds whole strings: no panic, and every refusal a
// one-line usage error.
func FuzzParseStoreRaw(f *testing.F) {
	for _, s := range []string{"", "mysql://u:p@h/db", "mysql:u:p@h/db", "u:p@tcp(h:3306)/db",
		"postgres://u:Top#secret@h/db", "redis://:p?x@h/0", "sqlite:///tmp/x.db", "sqlite://rel/x.db",
		"zk://h1,h2?session=10s&root=/r", "etcd://h?prefix=%zz", "mysql://u:p@[::1]:3306/db", "MYSQL://h/db"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, raw string) {
		_, err := parseStore(raw, "--db")
		if err == nil {
			return
		}
		var ee *exitError
		if !errors.As(err, &ee) || ee.code != exitUsage {
			t.Fatalf("parseStore(%q): %v, want a usage error", raw, err)
		}
		var buf bytes.Buffer
		(&app{stderr: &buf}).printErr(err)
		if strings.Count(buf.String(), "\n") != 1 {
			t.Fatalf("parseStore(%q): not one line: %q", raw, buf.String())
		}
	})
}

// errStop stops a fuzzed command where it would open the store.
var errStop = &exitError{code: 99}

// FuzzArgs runs the CLI's argument handling up to the store's opening: no
// panic, every refusal one line with exit 64, and no part of the store
// URL's password in any output.
func FuzzArgs(f *testing.F) {
	for _, s := range []string{
		"run\nk\n--\ntrue", "run\n--wait\n0\nk\n--\ntrue", "run\n--ttl\n10ms\nk\n--\ntrue",
		"run\n--conflict-exit-code\n300\nk\n--\ntrue", "run\nk", "list\na\nb", "list\n--json",
		"release\nk", "release\n--force\nk", "migrate\n--print", "--timeout\n0\nlist", "frobnicate",
		"run\n--wait\nx\nk\n--\ntrue", "run\n\n--\ntrue", "--bogus", "version",
	} {
		f.Add(s, "mysql", "u", "h/db?table=t", uint8(0), false)
		f.Add(s, "postgres", "u", "h/db?tabel=x", uint8(1), true)
	}
	f.Fuzz(func(t *testing.T, args, scheme, user, rest string, which uint8, encode bool) {
		if strings.Contains(args, "-h") || strings.Contains(args, "help") || strings.Contains(args, "complet") {
			return // help and shell completion print at length, on purpose
		}
		pw := fuzzPasswords[int(which)%len(fuzzPasswords)]
		run := func(pw string) (argv []string, code int, stdout, stderr string) {
			argv = append(strings.Split(args, "\n"), "--db", fuzzURL(scheme, user, rest, pw, encode))
			var o, e bytes.Buffer
			a := newApp(&o, &e)
			a.beforeIO = func(*storeSpec) error { return errStop }
			code = a.main(argv)
			return argv, code, o.String(), e.String()
		}
		argv, code, stdout, stderr := run(pw)
		if leaks(stdout+stderr, pw) != "" {
			// Text that the same command prints with another password
			// (help, the command line's own words) is no leak.
			_, _, o, e := run(strings.Repeat("YG", len(pw))[:len(pw)])
			checkNoLeak(t, stdout+stderr, pw, args, scheme, user, rest, o+e)
		}
		switch code {
		case 0, errStop.code:
		case exitUsage, 126, 127: // usage; COMMAND not executable or not found (checked before any I/O)
			if strings.Count(stderr, "\n") != 1 {
				t.Fatalf("dlock %q: exit %d without exactly one line: %q", argv, code, stderr)
			}
		default:
			t.Fatalf("dlock %q: exit %d before any I/O: %q", argv, code, stderr)
		}
	})
}

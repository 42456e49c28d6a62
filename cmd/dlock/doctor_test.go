package main

import (
	"net"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dlock-dev/dlock/internal/testproc"
)

// startRedisWith starts a redis-server on a loopback port with args, for
// the test, and returns its address ("" without redis-server, outside CI).
func startRedisWith(t *testing.T, args ...string) string {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		testproc.Missing(t, "redis-server", testproc.RedisHint, err)
		return ""
	}
	port := freeLoopbackPort(t)
	p := startProc(t, bin, append([]string{"--bind", "127.0.0.1", "--port", strconv.Itoa(port), "--dir", t.TempDir(), "--save", ""}, args...)...)
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	err = p.WaitReady(10*time.Second, 50*time.Millisecond, func() bool {
		c, err := net.Dial("tcp", addr)
		if err == nil {
			c.Close()
		}
		return err == nil
	})
	if err != nil {
		t.Fatalf("redis-server on %s did not start: %v", addr, err)
	}
	return addr
}

// checkDoctorOutput checks that every line of the doctor's output is one
// finding or the verdict.
func checkDoctorOutput(t *testing.T, r result) {
	t.Helper()
	for _, l := range strings.Split(strings.TrimSuffix(r.stdout, "\n"), "\n") {
		if !strings.HasPrefix(l, "ok: ") && !strings.HasPrefix(l, "unsafe: ") && !strings.HasPrefix(l, "info: ") {
			t.Errorf("doctor line %q is not a finding", l)
		}
	}
}

// TestDoctorRedis checks each unsafe Redis setting on servers started with
// it, and a safe server.
func TestDoctorRedis(t *testing.T) {
	testproc.Short(t, "redis-server")
	for _, c := range []struct {
		args []string
		want string // "" for healthy
	}{
		{[]string{"--appendonly", "no"}, "appendonly=no"},
		{[]string{"--appendonly", "yes", "--appendfsync", "everysec"}, "appendfsync=everysec"},
		{[]string{"--appendonly", "yes", "--appendfsync", "always", "--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru"}, "maxmemory-policy=allkeys-lru"},
		{[]string{"--appendonly", "yes", "--appendfsync", "always", "--maxmemory", "100mb", "--maxmemory-policy", "volatile-ttl"}, "maxmemory-policy=volatile-ttl"},
		{[]string{"--appendonly", "yes", "--appendfsync", "always"}, ""},
	} {
		addr := startRedisWith(t, c.args...)
		if addr == "" {
			return
		}
		r := run(t, env{"DLOCK_DB=redis://" + addr + "/0"}, "doctor")
		checkDoctorOutput(t, r)
		switch {
		case c.want == "" && (r.code != 0 || !strings.Contains(r.stdout, "ok: ")):
			t.Errorf("redis-server %q: doctor exit %d %q %q, want 0 and ok", c.args, r.code, r.stdout, r.stderr)
		case c.want != "" && (r.code != 1 || !strings.Contains(r.stdout, "unsafe: "+c.want)):
			t.Errorf("redis-server %q: doctor exit %d %q %q, want 1 and %q", c.args, r.code, r.stdout, r.stderr, c.want)
		}
	}

	// A primary with a replica, and the replica.
	primary := startRedisWith(t, "--appendonly", "yes", "--appendfsync", "always")
	if primary == "" {
		return
	}
	host, port, _ := net.SplitHostPort(primary)
	replica := startRedisWith(t, "--appendonly", "yes", "--appendfsync", "always", "--replicaof", host, port)
	var r result
	for i := 0; i < 100; i++ { // the replica connects within seconds
		if r = run(t, env{"DLOCK_DB=redis://" + primary + "/0"}, "doctor"); strings.Contains(r.stdout, "connected_slaves=1") {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if r.code != 1 || !strings.Contains(r.stdout, "unsafe: connected_slaves=1") {
		t.Errorf("a primary with a replica: doctor exit %d %q %q", r.code, r.stdout, r.stderr)
	}
	if r := run(t, env{"DLOCK_DB=redis://" + replica + "/0"}, "doctor"); r.code != 1 || !strings.Contains(r.stdout, "replica") {
		t.Errorf("a replica: doctor exit %d %q %q", r.code, r.stdout, r.stderr)
	}

	// min_replicas: each grant waits for the replica; more than there are
	// makes every acquisition fail.
	waiting := env{"DLOCK_DB=redis://" + primary + "/0?min_replicas=1"}
	if r := run(t, waiting, "doctor"); r.code != 0 || !strings.Contains(r.stdout, "info: each grant waits for 1 of 1 replicas") {
		t.Errorf("a primary with a replica and min_replicas=1: doctor exit %d %q %q", r.code, r.stdout, r.stderr)
	}
	if r := run(t, waiting, "run", "-q", "repl", "--", "true"); r.code != 0 {
		t.Errorf("run with min_replicas=1: exit %d %q", r.code, r.stderr)
	}
	tooMany := env{"DLOCK_DB=redis://" + primary + "/0?min_replicas=2"}
	if r := run(t, tooMany, "doctor"); r.code != 1 || !strings.Contains(r.stdout, "unsafe: min_replicas=2 but connected_slaves=1") {
		t.Errorf("min_replicas=2 with one replica: doctor exit %d %q %q", r.code, r.stdout, r.stderr)
	}
	if r := run(t, tooMany, "run", "-q", "repl", "--", "true"); r.code != exitFailure || !strings.Contains(r.stderr, "replicas") {
		t.Errorf("run with min_replicas=2 and one replica: exit %d %q, want %d", r.code, r.stderr, exitFailure)
	}
	// The grant that was not replicated was released.
	if r := run(t, waiting, "run", "-q", "-n", "repl", "--", "true"); r.code != 0 {
		t.Errorf("the key after a grant that was not replicated: exit %d %q", r.code, r.stderr)
	}
}

// TestRedisMinReplicasURL checks that a bad min_replicas is refused before
// any I/O.
func TestRedisMinReplicasURL(t *testing.T) {
	for _, v := range []string{"-1", "x", "1.5"} {
		r := run(t, env{"DLOCK_DB=redis://127.0.0.1:1/0?min_replicas=" + v}, "list")
		if r.code != exitUsage || !strings.Contains(r.stderr, "min_replicas") {
			t.Errorf("min_replicas=%s: exit %d %q, want %d", v, r.code, r.stderr, exitUsage)
		}
	}
}

// TestDoctorHealthyStores runs the doctor on the other stores: the ones the
// test starts are healthy; the shared servers are only checked to answer
// in the doctor's format (their settings are not the test's).
func TestDoctorHealthyStores(t *testing.T) {
	healthy := map[string]env{
		"embedded": {"XDG_STATE_HOME=" + t.TempDir(), "-DLOCK_DB"},
	}
	if testing.Short() {
		t.Log("SKIPPING etcd (-short)")
	} else if addr := startEtcd(t); addr != "" {
		healthy["etcd"] = env{"DLOCK_DB=etcd://" + addr}
	}
	if testing.Short() {
		t.Log("SKIPPING ZooKeeper (-short)")
	} else {
		addr, _ := testproc.StartZooKeeper(t)
		healthy["zk"] = env{"DLOCK_DB=zk://" + addr}
	}
	for name, e := range healthy {
		if name == "embedded" { // once before the store's file exists, once after
			if r := run(t, e, "doctor"); r.code != 0 || !strings.Contains(r.stdout, "does not exist yet") {
				t.Errorf("doctor before the first lock: exit %d %q %q", r.code, r.stdout, r.stderr)
			}
			run(t, e, "run", "-q", "k", "--", "true")
		}
		r := run(t, e, "doctor")
		t.Logf("%s: doctor exit %d: %q", name, r.code, r.stdout)
		checkDoctorOutput(t, r)
		if r.code != 0 || !strings.Contains(r.stdout, "ok: ") {
			t.Errorf("%s: doctor exit %d %q %q, want 0", name, r.code, r.stdout, r.stderr)
		}
	}
	shared := map[string]env{}
	if e := mysqlStore(t); e != nil {
		shared["mysql"], shared["mysql-getlock"] = e, env{e[0] + "&strategy=getlock"}
	}
	if e := postgresStore(t); e != nil {
		shared["postgres"] = e
	}
	for name, e := range shared {
		r := run(t, e, "doctor")
		checkDoctorOutput(t, r)
		if r.code != 0 && r.code != 1 {
			t.Errorf("%s: doctor exit %d %q %q, want 0 or 1", name, r.code, r.stdout, r.stderr)
		}
	}
	if r := run(t, env{"DLOCK_DB=redis://" + closedAddr(t) + "/0"}, "doctor"); r.code != exitFailure {
		t.Errorf("doctor on a store that is down: exit %d %q, want 70", r.code, r.stderr)
	}
}

// TestClockSkew checks the clock comparison the etcd and ZooKeeper checks
// make, with a server that answers with a skewed Date.
func TestClockSkew(t *testing.T) {
	for _, c := range []struct {
		skew time.Duration
		bad  bool
	}{{0, false}, {time.Second, false}, {30 * time.Second, true}, {-time.Minute, true}} {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Date", time.Now().Add(c.skew).UTC().Format(http.TimeFormat))
		}))
		fs, err := httpDateSkew(t.Context(), "test server", srv.URL)
		srv.Close()
		if err != nil {
			t.Fatal(err)
		}
		if got := len(fs) > 0; got != c.bad {
			t.Errorf("server clock %s off: findings %v", c.skew, fs)
		}
	}
}

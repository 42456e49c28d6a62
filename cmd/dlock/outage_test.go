package main

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/dlock-dev/dlock/internal/testproc"
)

// The outage tests run the binary against stores that are down (a closed
// loopback port) or that accept connections and never answer.

// storeURLs returns a URL of every scheme for the server at addr.
func storeURLs(addr string) map[string]string {
	return map[string]string{
		"mysql":    "mysql://root@" + addr + "/test?table=dlock_cli_test",
		"postgres": "postgres://postgres@" + addr + "/test?sslmode=disable&table=dlock_cli_test",
		"redis":    "redis://" + addr + "/0",
		"etcd":     "etcd://" + addr,
		"zk":       "zk://" + addr,
	}
}

// closedAddr returns a loopback address where nothing listens.
func closedAddr(t *testing.T) string {
	return fmt.Sprintf("127.0.0.1:%d", freeLoopbackPort(t))
}

// silentServer listens on loopback, accepts every connection and never
// answers. It returns its address and a channel that receives once per
// accepted connection.
func silentServer(t *testing.T) (string, <-chan struct{}) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	accepted := make(chan struct{}, 1000)
	var mu sync.Mutex
	var conns []net.Conn
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			select {
			case accepted <- struct{}{}:
			default:
			}
		}
	}()
	t.Cleanup(func() {
		l.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	return l.Addr().String(), accepted
}

// oneLine checks that stderr is exactly one line.
func oneLine(t *testing.T, what, stderr string) {
	t.Helper()
	if strings.Count(stderr, "\n") != 1 || !strings.HasSuffix(stderr, "\n") {
		t.Errorf("%s: stderr is not one line: %q", what, stderr)
	}
}

// TestStoreDownIsFailure checks that a store that is down ends every command
// with 70 and one line, never with the conflict code (or 0 with
// --conflict-exit-code 0), whatever --wait says.
func TestStoreDownIsFailure(t *testing.T) {
	testproc.Short(t, "minutes of store timeouts")
	for scheme, url := range storeURLs(closedAddr(t)) {
		t.Run(scheme, func(t *testing.T) {
			t.Parallel()
			var wg sync.WaitGroup // the commands run at once: each waits for timeouts
			for _, args := range [][]string{
				{"run", "--wait", "0", "k", "--", "true"},
				{"run", "--wait", "0", "--conflict-exit-code", "0", "k", "--", "true"},
				{"run", "--wait", "1s", "--conflict-exit-code", "0", "k", "--", "true"},
				{"run", "--wait", "3s", "k", "--", "true"},
				{"run", "k", "--", "true"},
				{"list"},
				{"release", "--force", "k"},
			} {
				wg.Go(func() {
					start := time.Now()
					r := run(t, env{"DLOCK_DB=" + url}, append([]string{"--timeout", "5s"}, args...)...)
					if r.code != exitFailure {
						t.Errorf("%s is down: dlock %q exited %d, want 70: %q", scheme, args, r.code, r.stderr)
					}
					oneLine(t, fmt.Sprintf("dlock %q", args), r.stderr)
					if strings.Contains(r.stderr, "is held") {
						t.Errorf("dlock %q reports an outage as a conflict: %q", args, r.stderr)
					}
					t.Logf("dlock %q: %s, %q", args, time.Since(start).Round(time.Millisecond), r.stderr)
				})
			}
			wg.Wait()
		})
	}
}

// TestSilentStore checks that a store that accepts connections and never
// answers ends every command with 70 and one line within its --timeout (each
// store call is bounded).
func TestSilentStore(t *testing.T) {
	testproc.Short(t, "minutes of store timeouts")
	addr, _ := silentServer(t)
	for scheme, url := range storeURLs(addr) {
		t.Run(scheme, func(t *testing.T) {
			t.Parallel()
			var wg sync.WaitGroup // the commands run at once: each waits for timeouts
			for _, args := range [][]string{
				{"run", "--wait", "0", "k", "--", "true"},
				{"run", "--wait", "2s", "k", "--", "true"},
				{"list"},
				{"migrate"},
				{"release", "--force", "k"},
			} {
				cmd, _, stderr := command(env{"DLOCK_DB=" + url}, append([]string{"--timeout", "2s"}, args...)...)
				if err := cmd.Start(); err != nil {
					t.Fatal(err)
				}
				h := watch(t, cmd, stderr, func() string { return "" })
				wg.Go(func() {
					if !h.exited(60 * time.Second) {
						t.Errorf("dlock %q on a silent %s store still runs after 60 s (--timeout 2s)", args, scheme)
						return
					}
					if code := cmd.ProcessState.ExitCode(); code != exitFailure {
						t.Errorf("dlock %q on a silent %s store: exit %d, want 70: %q", args, scheme, code, stderr)
					}
					oneLine(t, fmt.Sprintf("dlock %q", args), stderr.String())
				})
			}
			wg.Wait()
		})
	}
}

// TestSignalEndsDlock checks that SIGTERM and SIGINT end dlock with 128+N
// while it talks to a store that never answers (default bounds: the signal
// must not wait for them).
func TestSignalEndsDlock(t *testing.T) {
	testproc.Short(t, "minutes of store timeouts")
	for scheme := range storeURLs("127.0.0.1:1") {
		t.Run(scheme, func(t *testing.T) {
			// Each process has a silent store of its own, so that all of
			// them wait at once and each one's connection is its own.
			var wg sync.WaitGroup
			for _, args := range [][]string{
				{"run", "--wait", "0", "k", "--", "true"},
				{"run", "k", "--", "true"},
				{"list"},
				{"migrate"},
			} {
				for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGINT} {
					addr, accepted := silentServer(t)
					wg.Go(func() { signalWhileSilent(t, storeURLs(addr)[scheme], accepted, args, sig) })
				}
			}
			wg.Wait()
		})
	}
}

// signalWhileSilent starts dlock with args on the silent store at url,
// signals it with sig once it waits for an answer, and checks that it
// exits at once with 128+sig. It runs on its own goroutine: it reports
// with t.Errorf.
func signalWhileSilent(t *testing.T, url string, accepted <-chan struct{}, args []string, sig syscall.Signal) {
	cmd, _, stderr := command(env{"DLOCK_DB=" + url}, args...)
	if err := cmd.Start(); err != nil {
		t.Errorf("start dlock %q: %v", args, err)
		return
	}
	h := watch(t, cmd, stderr, func() string { return "" })
	select {
	case <-accepted:
	case <-h.done:
		t.Errorf("dlock %q exited %d before connecting: %q", args, cmd.ProcessState.ExitCode(), stderr)
		return
	case <-time.After(30 * time.Second):
		t.Errorf("dlock %q did not connect to the silent store within 30 s", args)
		return
	}
	time.Sleep(200 * time.Millisecond) // now waiting for an answer
	cmd.Process.Signal(sig)
	if !h.exited(30 * time.Second) {
		t.Errorf("dlock %q on a silent store %s ignored %v for 30 s", args, url, sig)
		return
	}
	if code := shellStatus(cmd); code != 128+int(sig) {
		t.Errorf("dlock %q, %v: exit %d, want %d: %q", args, sig, code, 128+int(sig), stderr)
	}
}

// shellStatus is the exited cmd's status as a shell shows it: 128+N when
// signal N killed it.
func shellStatus(cmd *exec.Cmd) int {
	if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return 128 + int(ws.Signal())
	}
	return cmd.ProcessState.ExitCode()
}

// TestLostLockNoticedAtRelease checks that a lock freed by someone else while
// COMMAND ran is reported (exit 76) even when dlock learns it only at
// release, after COMMAND exited 0.
func TestLostLockNoticedAtRelease(t *testing.T) {
	forEachStore(t, func(t *testing.T, e env) {
		key, dir := uniqueKey(t), t.TempDir()
		goFile := filepath.Join(dir, "go")
		// A 30 s lease is renewed after 10 s: COMMAND ends before that.
		h := startHolder(t, e, "run", "--ttl", "30s", key, "--", "sh", "-c", `until [ -e "`+goFile+`" ]; do sleep 0.05; done`)
		waitHeld(t, e, key, h)
		if r := run(t, e, "release", "--force", key); r.code != 0 {
			t.Fatalf("release --force: %d %s", r.code, r.stderr)
		}
		if err := os.WriteFile(goFile, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if !h.exited(20 * time.Second) {
			t.Fatal("dlock run did not exit within 20 s of its command")
		}
		if code := h.cmd.ProcessState.ExitCode(); code != exitLockLost {
			t.Errorf("the lock was freed by someone else while COMMAND ran: exit %d, want 76; stderr %q", code, h.stderr)
		}
	})
}

// Package testproc runs the server processes of the backends' integration
// tests: it finds a server's binary (failing under CI=true, skipping
// otherwise), picks free loopback ports, and starts, signals and kills a
// process with its output captured for the test's messages.
//
// It is for _test.go files only.
package testproc

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"testing"
	"time"
)

// Missing ends a test that cannot run without what (a server, a binary):
// under CI=true the test fails, and otherwise it is skipped with a reason
// that says how to install it (installHint). It does not return.
func Missing(t testing.TB, what, installHint string, err error) {
	t.Helper()
	if os.Getenv("CI") == "true" {
		t.Fatalf("%s is required (CI=true): %v", what, err)
	}
	t.Skipf("SKIPPING: %s is not installed (%s): %v", what, installHint, err)
}

// Short skips a test that needs what (a server) when go test runs with
// -short: the fast tier runs without any server.
func Short(t testing.TB, what string) {
	t.Helper()
	if testing.Short() {
		t.Skipf("-short: needs %s", what)
	}
}

// Binary returns the path of the executable name, or ends the test as
// Missing does when there is none in $PATH. A server's binary is needed
// only to start the server: with -short the test is skipped (see Short).
func Binary(t testing.TB, name, installHint string) string {
	t.Helper()
	Short(t, name)
	bin, err := exec.LookPath(name)
	if err != nil {
		Missing(t, name, installHint, err)
	}
	return bin
}

// FreePorts returns n distinct loopback ports in [lo, hi) that are free now
// and for which also (when not nil) holds. It fails the test when 100·n
// random tries find fewer. A port may be taken again before the caller
// listens on it, so callers retry a start that fails.
func FreePorts(t testing.TB, n, lo, hi int, also func(port int) bool) []int {
	t.Helper()
	var ports []int
	seen := map[int]bool{}
	for range 100 * n {
		p := lo + rand.IntN(hi-lo)
		if !seen[p] && IsFree(p) && (also == nil || also(p)) {
			seen[p] = true
			if ports = append(ports, p); len(ports) == n {
				return ports
			}
		}
	}
	t.Fatalf("no %d free loopback ports found in [%d, %d)", n, lo, hi)
	return nil
}

// IsFree reports whether a TCP listener can be opened on the loopback port
// now.
func IsFree(port int) bool {
	l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	if err != nil {
		return false
	}
	l.Close()
	return true
}

// SyncBuffer is a bytes.Buffer that is safe for concurrent use: a process
// writes its output into it while the test reads it.
type SyncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

// Write appends p to the buffer.
func (b *SyncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

// String returns what has been written so far.
func (b *SyncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// KillTimeout bounds how long Kill waits for the process to exit.
const KillTimeout = 10 * time.Second

// Proc is a server process of a test, its stdout and stderr captured. On
// Linux the kernel kills it if the test process dies without cleaning up.
//
// The zero Proc has no process; Start starts one, and after Kill another
// one. Its methods are safe for concurrent use.
type Proc struct {
	mu      sync.Mutex
	cmd     *exec.Cmd
	out     *SyncBuffer
	done    chan struct{} // closed when the process has exited
	stopped bool          // SIGSTOPped
}

// Start starts bin with args as p's process, in place of an earlier one
// that has exited. It does not wait for the server to serve: see WaitReady.
func (p *Proc) Start(bin string, args ...string) error {
	cmd := exec.Command(bin, args...)
	cmd.SysProcAttr = procAttr()
	out := &SyncBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		return err
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	p.mu.Lock()
	p.cmd, p.out, p.done, p.stopped = cmd, out, done, false
	p.mu.Unlock()
	return nil
}

// Output returns what the current process has written so far.
func (p *Proc) Output() string {
	p.mu.Lock()
	out := p.out
	p.mu.Unlock()
	if out == nil {
		return ""
	}
	return out.String()
}

// Exited reports whether the current process has exited (false when none
// was started).
func (p *Proc) Exited() bool {
	p.mu.Lock()
	done := p.done
	p.mu.Unlock()
	if done == nil {
		return false
	}
	select {
	case <-done:
		return true
	default:
		return false
	}
}

// WaitReady calls ready every interval until it returns true, and returns
// an error with the process's output when the process exits first or d
// passes.
func (p *Proc) WaitReady(d, interval time.Duration, ready func() bool) error {
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		if p.Exited() {
			return fmt.Errorf("exited: %s", p.Output())
		}
		if ready() {
			return nil
		}
		time.Sleep(interval)
	}
	return fmt.Errorf("not ready within %s: %s", d, p.Output())
}

// Stopped reports whether the process was stopped by Stop and not continued
// by Cont since.
func (p *Proc) Stopped() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stopped
}

// Kill sends SIGKILL to the current process, if there is one, and waits up
// to KillTimeout for it to exit. A stopped process dies of SIGKILL too.
func (p *Proc) Kill() error {
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.mu.Unlock()
	if cmd == nil {
		return nil
	}
	cmd.Process.Kill()
	select {
	case <-done:
		return nil
	case <-time.After(KillTimeout):
		return errors.New("did not exit after SIGKILL")
	}
}

package locktest

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
)

// Environment of helper processes.
const (
	envRole   = "DLOCK_LOCKTEST_ROLE"
	envSuite  = "DLOCK_LOCKTEST_SUITE"
	envKey    = "DLOCK_LOCKTEST_KEY"
	envDir    = "DLOCK_LOCKTEST_DIR"
	envRounds = "DLOCK_LOCKTEST_ROUNDS"
)

// spawn starts the test binary as a helper process in role, running only
// the test that called Run.
func (s *suite) spawn(t *testing.T, suite, role, key, dir string, rounds int) *exec.Cmd {
	t.Helper()
	var parts []string
	for _, p := range strings.Split(suite, "/") {
		parts = append(parts, "^"+regexp.QuoteMeta(p)+"$")
	}
	cmd := exec.Command(os.Args[0], "-test.run="+strings.Join(parts, "/"), "-test.count=1", "-test.timeout=120s")
	cmd.Env = append(os.Environ(),
		envRole+"="+role, envSuite+"="+suite, envKey+"="+key, envDir+"="+dir,
		envRounds+"="+strconv.Itoa(rounds))
	cmd.Stderr = os.Stderr
	return cmd
}

// suiteName is the name of the test that called Run, from a subtest's name.
func suiteName(t *testing.T) string {
	n := t.Name()
	return n[:strings.LastIndex(n, "/")]
}

// helper runs in a helper process and exits it.
func (s *suite) helper(t *testing.T, role string) {
	code := 0
	if err := s.runHelper(t, role); err != nil {
		fmt.Fprintf(os.Stderr, "locktest helper %s (pid %d): %v\n", role, os.Getpid(), err)
		code = 1
	}
	os.Exit(code)
}

func (s *suite) runHelper(t *testing.T, role string) error {
	k, dir := os.Getenv(envKey), os.Getenv(envDir)
	l := dlock.New(s.newBackend(t), nil)
	defer l.Close(context.Background())
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	switch role {
	case "contend":
		rounds, _ := strconv.Atoi(os.Getenv(envRounds))
		for range rounds {
			if err := contendOnce(ctx, l, k, dir); err != nil {
				return err
			}
		}
		return nil
	case "share":
		ms, _ := strconv.Atoi(os.Getenv(envRounds))
		// Start together: a process that starts early would have the key
		// to itself for a while (slow starts under -race on a loaded host
		// decided the shares more than the backend did).
		fmt.Println("READY")
		if _, err := bufio.NewReader(os.Stdin).ReadString('\n'); err != nil {
			return fmt.Errorf("waiting for the start: %w", err)
		}
		sctx, cancel := context.WithTimeout(ctx, time.Duration(ms)*time.Millisecond)
		defer cancel()
		n := 0
		for sctx.Err() == nil {
			lk, err := l.Acquire(sctx, k, dlock.WithTTL(5*time.Second))
			if err != nil {
				if errors.Is(err, dlock.ErrNotAcquired) && errors.Is(err, context.DeadlineExceeded) {
					break
				}
				return err
			}
			n++
			if err := lk.Release(context.Background()); err != nil {
				return err
			}
		}
		fmt.Printf("COUNT %d\n", n)
		return nil
	case "pause":
		return pauseHelper(l, k)
	case "hold", "hold-limited", "hold-delay":
		opts := []dlock.AcquireOption{dlock.WithTTL(ttl)}
		switch role {
		case "hold-limited":
			opts = append(opts, dlock.WithLimit(1))
		case "hold-delay":
			opts = append(opts, dlock.WithLockDelay(killedDelay))
		}
		lk, err := l.Acquire(ctx, k, opts...)
		if err != nil {
			return err
		}
		fmt.Printf("HELD %d\n", lk.Fence())
		<-ctx.Done() // killed long before
		return nil
	case "lead":
		term, err := dlock.NewElection(l, k).Campaign(ctx, fmt.Sprintf("pid %d", os.Getpid()), dlock.WithTTL(ttl))
		if err != nil {
			return err
		}
		fmt.Printf("HELD %d\n", term.Fence())
		<-ctx.Done() // killed long before
		return nil
	case "limited":
		rounds, _ := strconv.Atoi(os.Getenv(envRounds))
		return limitHelper(ctx, l, k, dir, rounds)
	case "all":
		// envRounds carries rounds*100 + the helper's index.
		n, _ := strconv.Atoi(os.Getenv(envRounds))
		return allHelper(ctx, l, k, dir, n/100, n%100)
	}
	return fmt.Errorf("unknown role %q", role)
}

// contendOnce takes k, runs the critical section and releases k.
func contendOnce(ctx context.Context, l *dlock.Locker, k, dir string) error {
	lk, err := l.Acquire(ctx, k, dlock.WithTTL(procTTL))
	if err != nil {
		return err
	}
	err = criticalSection(dir, lk.Fence())
	return dlock.Join(err, lk.Err(), lk.Release(context.Background()))
}

// criticalSection detects overlap across processes with an exclusively
// created marker file, and logs the entry with its fence.
func criticalSection(dir string, fence uint64) error {
	marker := filepath.Join(dir, "inside")
	f, err := os.OpenFile(marker, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		if errors.Is(err, os.ErrExist) {
			return errors.New("rule: mutual exclusion among processes; another process was inside")
		}
		return err
	}
	f.Close()
	log, err := os.OpenFile(filepath.Join(dir, "log"), os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	fmt.Fprintf(log, "%d %d\n", os.Getpid(), fence)
	log.Close()
	time.Sleep(time.Millisecond)
	return os.Remove(marker)
}

func (s *suite) exclusionProcesses(t *testing.T) {
	if s.inProcess {
		t.Skip("in-process backend: state is not shared between processes")
	}
	k, dir := key(t, "k"), t.TempDir()
	const procs, rounds = 4, 25
	var cmds []*exec.Cmd
	for range procs {
		cmd := s.spawn(t, suiteName(t), "contend", k, dir, rounds)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		cmds = append(cmds, cmd)
	}
	// This process contends too, so that fencing is checked across all.
	l, _ := s.locker(t)
	for range rounds {
		if err := contendOnce(ctxT(t, 90*time.Second), l, k, dir); err != nil {
			t.Error(err)
			break
		}
	}
	for _, cmd := range cmds {
		if err := cmd.Wait(); err != nil {
			t.Errorf("helper %d: %v", cmd.Process.Pid, err)
		}
	}
	data, err := os.ReadFile(filepath.Join(dir, "log"))
	if err != nil {
		t.Fatal(err)
	}
	pids := map[string]int{}
	var last uint64
	lines := strings.Split(strings.TrimSpace(string(data)), "\n")
	for _, line := range lines {
		var pid string
		var fence uint64
		if _, err := fmt.Sscan(line, &pid, &fence); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		if fence <= last {
			t.Errorf("rule: fences increase across processes; %d after %d", fence, last)
		}
		last = fence
		pids[pid]++
	}
	if n := len(lines); n != (procs+1)*rounds || len(pids) != procs+1 {
		t.Errorf("%d critical sections by %d processes, want %d by %d", n, len(pids), (procs+1)*rounds, procs+1)
	}
}

func (s *suite) killedHolder(t *testing.T) {
	if s.inProcess {
		t.Skip("in-process backend: state is not shared between processes")
	}
	k := key(t, "k")
	held := s.spawnHolder(t, k, "hold")
	l, _ := s.locker(t)
	mustBeHeld(t, l, k)
	held.kill(t)
	lk, err := l.Acquire(ctxT(t, s.crashBound), k, dlock.WithTTL(ttl))
	if err != nil {
		t.Fatalf("rule: a killed holder's lock is free again within %s; %v", s.crashBound, err)
	}
	defer lk.Release(context.Background())
	if lk.Fence() <= held.fence {
		t.Errorf("fencing: %d after the killed holder's %d", lk.Fence(), held.fence)
	}
}

// holderProc is a helper process that holds a key until killed.
type holderProc struct {
	cmd   *exec.Cmd
	fence uint64
}

// spawnHolder starts a helper process in role ("hold", "hold-limited",
// "hold-delay", "lead") and
// waits until it holds k. It is killed at the end of the test.
func (s *suite) spawnHolder(t *testing.T, k, role string) *holderProc {
	t.Helper()
	cmd := s.spawn(t, suiteName(t), role, k, t.TempDir(), 0)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	line, err := bufio.NewReader(out).ReadString('\n')
	h := &holderProc{cmd: cmd}
	if _, serr := fmt.Sscanf(line, "HELD %d", &h.fence); err != nil || serr != nil {
		t.Fatalf("helper did not report holding the lock: %q %v %v", line, err, serr)
	}
	return h
}

// kill sends SIGKILL to the holder.
func (h *holderProc) kill(t *testing.T) {
	t.Helper()
	if err := h.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
}

// FairShare runs procs processes (the test binary re-executed, each with its
// own Locker over its own backend) that acquire and release one key in a
// loop for d, and fails the test if any of them got less than half of a fair
// share of the acquisitions. Call it from a test function of its own.
func FairShare(t *testing.T, newBackend func(t *testing.T) dlock.Backend, procs int, d time.Duration) {
	if os.Getenv(envRole) == "share" && os.Getenv(envSuite) == t.Name() {
		s := &suite{newBackend: newBackend}
		s.helper(t, "share")
	}
	s := &suite{newBackend: newBackend}
	k := key(t, "k")
	type proc struct {
		cmd *exec.Cmd
		in  io.WriteCloser
		out *bufio.Reader
	}
	var ps []proc
	for range procs {
		cmd := s.spawn(t, t.Name(), "share", k, t.TempDir(), int(d.Milliseconds()))
		in, out := startWithPipes(t, cmd)
		ps = append(ps, proc{cmd, in, out})
	}
	// Every process is up before any starts counting.
	for _, p := range ps {
		if line, err := p.out.ReadString('\n'); line != "READY\n" {
			t.Fatalf("helper %d did not get ready: %q %v", p.cmd.Process.Pid, line, err)
		}
	}
	for _, p := range ps {
		if _, err := io.WriteString(p.in, "GO\n"); err != nil {
			t.Fatal(err)
		}
	}
	counts := make([]int, 0, procs)
	total := 0
	for _, p := range ps {
		line, _ := p.out.ReadString('\n')
		var n int
		if _, err := fmt.Sscanf(line, "COUNT %d", &n); err != nil {
			t.Fatalf("helper %d output %q: %v", p.cmd.Process.Pid, line, err)
		}
		if err := p.cmd.Wait(); err != nil {
			t.Fatalf("helper %d: %v", p.cmd.Process.Pid, err)
		}
		counts = append(counts, n)
		total += n
	}
	fair := float64(total) / float64(procs)
	t.Logf("%d acquisitions in %s by %d processes: %v", total, d, procs, counts)
	if total < 2*procs {
		t.Fatalf("only %d acquisitions by %d processes in %s: too few to judge fairness (all: %v)", total, procs, d, counts)
	}
	for i, n := range counts {
		if float64(n) < fair/2 {
			t.Errorf("rule: fair share; process %d got %d acquisitions, less than half of the fair %.0f (all: %v)", i, n, fair, counts)
		}
	}
}

// startWithPipes starts a helper process with pipes to its stdin and from
// its stdout; it is killed and reaped when the test ends.
func startWithPipes(t *testing.T, cmd *exec.Cmd) (io.WriteCloser, *bufio.Reader) {
	t.Helper()
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	return in, bufio.NewReader(out)
}

package main

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The terminal tests run dlock as a shell at a prompt does: as the leader of
// a session on a new pseudo-terminal, in its foreground process group.

// terminal is the master side of a pseudo-terminal and what was read from it.
type terminal struct {
	ptm *os.File
	mu  sync.Mutex
	out bytes.Buffer
}

// startOnTerminal starts `dlock args...` on a new pseudo-terminal; it is
// killed when the test ends.
func startOnTerminal(t *testing.T, e env, args ...string) (*holder, *terminal) {
	t.Helper()
	cmd, _, stderr := command(e, args...)
	return startCmdOnTerminal(t, cmd, stderr)
}

// termCols is the width of the test terminals.
const termCols = 80

// startCmdOnTerminal starts cmd on a new pseudo-terminal of termCols
// columns; it is killed when the test ends.
func startCmdOnTerminal(t *testing.T, cmd *exec.Cmd, stderr *bytes.Buffer) (*holder, *terminal) {
	t.Helper()
	ptm, err := os.OpenFile("/dev/ptmx", os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		t.Skipf("SKIPPING: no pseudo-terminals: %v", err)
	}
	t.Cleanup(func() { ptm.Close() })
	var n int
	var ioctlErr error
	rc, err := ptm.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	err = rc.Control(func(fd uintptr) {
		if ioctlErr = unix.IoctlSetPointerInt(int(fd), unix.TIOCSPTLCK, 0); ioctlErr == nil { // unlock
			n, ioctlErr = unix.IoctlGetInt(int(fd), unix.TIOCGPTN)
		}
		if ioctlErr == nil {
			ioctlErr = unix.IoctlSetWinsize(int(fd), unix.TIOCSWINSZ, &unix.Winsize{Row: 24, Col: termCols})
		}
	})
	if err != nil || ioctlErr != nil {
		t.Fatalf("pseudo-terminal: %v %v", err, ioctlErr)
	}
	pts, err := os.OpenFile(fmt.Sprintf("/dev/pts/%d", n), os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = pts, pts, pts
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0}
	err = cmd.Start()
	pts.Close()
	if err != nil {
		t.Fatal(err)
	}
	term := &terminal{ptm: ptm}
	go func() {
		buf := make([]byte, 4096)
		for {
			n, err := ptm.Read(buf) // EIO once nobody has the slave side open
			term.mu.Lock()
			term.out.Write(buf[:n])
			term.mu.Unlock()
			if err != nil {
				return
			}
		}
	}()
	return watch(t, cmd, stderr, func() string { return fmt.Sprintf("terminal: %q", term.output()) }), term
}

func (term *terminal) output() string {
	term.mu.Lock()
	defer term.mu.Unlock()
	return term.out.String()
}

// waitFor waits up to d for the terminal to show s.
func (term *terminal) waitFor(t *testing.T, s string, d time.Duration) {
	t.Helper()
	for deadline := time.Now().Add(d); !strings.Contains(term.output(), s); {
		if time.Now().After(deadline) {
			t.Fatalf("the terminal did not show %q within %s: %q", s, d, term.output())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestRunReadsTerminal checks that COMMAND can read the terminal dlock runs
// in the foreground of (it used to stop with SIGTTIN in a background process
// group, and dlock waited for ever).
func TestRunReadsTerminal(t *testing.T) {
	e := env{"XDG_STATE_HOME=" + t.TempDir(), "-DLOCK_DB"}
	h, term := startOnTerminal(t, e, "run", uniqueKey(t), "--", "sh", "-c", `read x; echo "got $x"; exit 3`)
	if _, err := term.ptm.WriteString("hello\n"); err != nil {
		t.Fatal(err)
	}
	if !h.exited(20 * time.Second) {
		t.Fatalf("dlock run did not exit within 20 s: COMMAND could not read the terminal? %q", term.output())
	}
	if code := h.cmd.ProcessState.ExitCode(); code != 3 || !strings.Contains(term.output(), "got hello") {
		t.Errorf("exit %d, terminal %q; want 3 and COMMAND's \"got hello\"", code, term.output())
	}
}

// TestWaitOnTerminal checks the status line while waiting on a terminal:
// one line rewritten in place and cut to the terminal's width, that counts
// the wait up every second, also on stores that wait in the server and
// report the holder rarely (MySQL lease: once per lease), and names the
// holder and since when it holds the key (not its lease, whose countdown
// jumps back at every renewal). Ctrl-C ends the wait with 130, not the
// conflict code.
func TestWaitOnTerminal(t *testing.T) {
	e := mysqlStore(t)
	if e == nil {
		e = env{"XDG_STATE_HOME=" + t.TempDir(), "-DLOCK_DB"}
	}
	// Long enough for the line not to fit in termCols columns.
	key := uniqueKey(t) + "/" + strings.Repeat("x", termCols/2)
	alice := startHolder(t, e, "run", "--owner", "alice", "--ttl", "2s", key, "--", "sleep", "30")
	waitHeld(t, e, key, alice)

	h, term := startOnTerminal(t, e, "run", key, "--", "true")
	term.waitFor(t, "waiting ", 20*time.Second)
	time.Sleep(3500 * time.Millisecond) // the holder renews its 2 s lease twice
	out := term.output()
	waited, since := map[string]bool{}, map[string]bool{}
	for _, m := range regexp.MustCompile(`waiting (\d+s) for`).FindAllStringSubmatch(out, -1) {
		waited[m[1]] = true
	}
	for _, m := range regexp.MustCompile(`since (\d\d:\d\d:\d\d)`).FindAllStringSubmatch(out, -1) {
		since[m[1]] = true
	}
	if len(waited) < 2 {
		t.Errorf("the status line showed waits of %v over 3.5 s; want them counted up", waited)
	}
	if len(since) != 1 {
		t.Errorf("the status line showed the holder holding it since %v; want the one time it was acquired", since)
	}
	if strings.Contains(out, "expires") {
		t.Errorf("the status line shows a lease countdown: %q", out)
	}
	if !strings.Contains(out, "alice") {
		t.Errorf("the status line does not name the holder: %q", out)
	}
	if strings.ContainsAny(out, "\n") {
		t.Errorf("the status line is not one line rewritten in place: %q", out)
	}
	for _, line := range strings.Split(out, "\r\033[K") {
		if n := len([]rune(line)); n >= termCols {
			t.Errorf("a status line of %d characters on a terminal of %d columns: %q", n, termCols, line)
		}
	}

	if _, err := term.ptm.WriteString("\x03"); err != nil { // Ctrl-C
		t.Fatal(err)
	}
	if !h.exited(10 * time.Second) {
		t.Fatal("dlock run kept waiting after Ctrl-C")
	}
	if code := h.cmd.ProcessState.ExitCode(); code != 130 || !strings.Contains(term.output(), "interrupted by SIGINT") {
		t.Errorf("Ctrl-C while waiting: exit %d, terminal %q; want 130 saying it was interrupted", code, term.output())
	}
}

// TestWaitInBackground checks that dlock waiting in a background job of a
// terminal (a shell's `dlock run … &`) draws no status line over the
// foreground job's output.
func TestWaitInBackground(t *testing.T) {
	e := env{"XDG_STATE_HOME=" + t.TempDir(), "-DLOCK_DB"}
	key := uniqueKey(t)
	alice := startHolder(t, e, "run", "--owner", "alice", key, "--", "sleep", "30")
	waitHeld(t, e, key, alice)

	// set -m: the shell runs the job in a process group of its own, not the
	// terminal's foreground group, which stays the shell's.
	cmd, _, stderr := command(e)
	cmd.Path, cmd.Args = "/bin/sh", []string{"sh", "-c", `set -m; "$0" run --wait 2.5 "$1" -- true & wait $!; echo "background job exited $?"`, binary, key}
	h, term := startCmdOnTerminal(t, cmd, stderr)
	if !h.exited(20 * time.Second) {
		t.Fatalf("the background dlock did not give up after --wait 2.5: %q", term.output())
	}
	term.waitFor(t, "background job exited 75", 5*time.Second)
	if out := term.output(); strings.Contains(out, "\033[K") {
		t.Errorf("dlock drew its status line from a background job: %q", out)
	}
}

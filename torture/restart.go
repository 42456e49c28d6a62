package torture

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
)

// The restart fault for the servers of redis-lease, etcd-lease and zk-lease
// (MariaDB has its own, through start-stop-daemon: see mariadb.go). The
// server is whatever process listens on the strategy's address: the harness
// reads its executable, arguments, working directory and environment from
// /proc, kills it with SIGKILL, and starts the same command again. A server
// the harness's own process started (TestShortRun's) comes back as the
// harness's child and dies with it, as the original would have; any other
// server comes back in a session of its own, logging to server-<pid>.log in
// the run's directory, and keeps running after the harness exits.

// serverProc is a running server as /proc describes it.
type serverProc struct {
	pid, ppid int
	exe       string
	argv      []string // argv[0] too: redis-server is a link to redis-check-rdb, which reads its mode from argv[0]
	dir       string
	env       []string
	cred      *syscall.Credential // its user and groups (PostgreSQL refuses to run as root)
	children  []int               // its child processes (PostgreSQL's backends), listed while it is stopped
}

// relaunched are the servers the harness started again as its children; Run
// kills them when it returns.
type relaunched struct {
	mu      sync.Mutex
	cmds    []*exec.Cmd
	done    []chan struct{}
	foreign map[int]bool // pids of servers relaunched for someone else (children of ours, but not to be killed)
}

// markForeign records that pid is someone else's server, relaunched.
func (rl *relaunched) markForeign(pid int) {
	rl.mu.Lock()
	defer rl.mu.Unlock()
	if rl.foreign == nil {
		rl.foreign = map[int]bool{}
	}
	rl.foreign[pid] = true
}

func (rl *relaunched) isForeign(pid int) bool {
	rl.mu.Lock()
	defer rl.mu.Unlock()
	return rl.foreign[pid]
}

func (rl *relaunched) add(cmd *exec.Cmd, done chan struct{}) {
	rl.mu.Lock()
	rl.cmds, rl.done = append(rl.cmds, cmd), append(rl.done, done)
	rl.mu.Unlock()
}

// killAll kills the relaunched children and waits (bounded) for them.
func (rl *relaunched) killAll() {
	rl.mu.Lock()
	defer rl.mu.Unlock()
	for i, c := range rl.cmds {
		_ = c.Process.Kill()
		select {
		case <-rl.done[i]:
		case <-time.After(10 * time.Second):
		}
	}
	rl.cmds, rl.done = nil, nil
}

// listenerPid returns the process listening on TCP port of this network
// namespace (from /proc/net/tcp{,6} and the processes' open sockets).
func listenerPid(port int) (int, error) {
	inodes := map[string]bool{}
	for _, f := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		data, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(bytes.NewReader(data))
		sc.Scan() // header
		for sc.Scan() {
			fs := strings.Fields(sc.Text())
			if len(fs) < 10 || fs[3] != "0A" { // LISTEN
				continue
			}
			_, hexPort, ok := strings.Cut(fs[1], ":")
			p, err := strconv.ParseUint(hexPort, 16, 16)
			if ok && err == nil && int(p) == port {
				inodes["socket:["+fs[9]+"]"] = true
			}
		}
	}
	if len(inodes) == 0 {
		return 0, fmt.Errorf("nothing listens on port %d", port)
	}
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return 0, err
	}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		fds, err := os.ReadDir(filepath.Join("/proc", e.Name(), "fd"))
		if err != nil {
			continue
		}
		for _, fd := range fds {
			if l, err := os.Readlink(filepath.Join("/proc", e.Name(), "fd", fd.Name())); err == nil && inodes[l] {
				return pid, nil
			}
		}
	}
	return 0, fmt.Errorf("no process of this host holds the listener on port %d", port)
}

// readServerProc reads what it takes to start pid's command again.
func readServerProc(pid int) (serverProc, error) {
	dir := filepath.Join("/proc", strconv.Itoa(pid))
	sp := serverProc{pid: pid}
	var err error
	if sp.exe, err = os.Readlink(filepath.Join(dir, "exe")); err != nil {
		return sp, err
	}
	if sp.dir, err = os.Readlink(filepath.Join(dir, "cwd")); err != nil {
		return sp, err
	}
	cmdline, err := os.ReadFile(filepath.Join(dir, "cmdline"))
	if err != nil {
		return sp, err
	}
	sp.argv = strings.Split(strings.TrimRight(string(cmdline), "\x00"), "\x00")
	environ, err := os.ReadFile(filepath.Join(dir, "environ"))
	if err != nil {
		return sp, err
	}
	if s := strings.TrimRight(string(environ), "\x00"); s != "" {
		sp.env = strings.Split(s, "\x00")
	}
	if sp.ppid, err = readPPid(pid); err != nil {
		return sp, err
	}
	status, err := os.ReadFile(filepath.Join(dir, "status"))
	if err != nil {
		return sp, err
	}
	if sp.cred, err = credential(string(status)); err != nil {
		return sp, fmt.Errorf("%s/status: %w", dir, err)
	}
	return sp, nil
}

// procStat returns the fields of /proc/<pid>/stat after the command name:
// state, ppid, …
func procStat(pid int) ([]string, error) {
	stat, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return nil, err
	}
	// pid (comm) state ppid …: comm may hold spaces and parentheses.
	i := bytes.LastIndexByte(stat, ')')
	fs := strings.Fields(string(stat[i+1:]))
	if i < 0 || len(fs) < 2 {
		return nil, fmt.Errorf("unreadable /proc/%d/stat", pid)
	}
	return fs, nil
}

// readPPid returns pid's parent.
func readPPid(pid int) (int, error) {
	fs, err := procStat(pid)
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(fs[1])
}

// credential reads the real user, group and supplementary groups from a
// /proc/<pid>/status text.
func credential(status string) (*syscall.Credential, error) {
	ids := map[string][]uint32{}
	for _, line := range strings.Split(status, "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok || (k != "Uid" && k != "Gid" && k != "Groups") {
			continue
		}
		ids[k] = []uint32{}
		for _, f := range strings.Fields(v) {
			n, err := strconv.ParseUint(f, 10, 32)
			if err != nil {
				return nil, fmt.Errorf("%s: %q", k, v)
			}
			ids[k] = append(ids[k], uint32(n))
		}
	}
	if len(ids["Uid"]) == 0 || len(ids["Gid"]) == 0 {
		return nil, errors.New("no Uid or Gid line")
	}
	return &syscall.Credential{Uid: ids["Uid"][0], Gid: ids["Gid"][0], Groups: ids["Groups"]}, nil
}

// childrenOf lists the processes whose parent is pid.
func childrenOf(pid int) []int {
	ents, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range ents {
		c, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if pp, err := readPPid(c); err == nil && pp == pid {
			out = append(out, c)
		}
	}
	return out
}

// gone reports whether pid has exited (a zombie counts as exited: its
// sockets are closed).
func gone(pid int) bool {
	fs, err := procStat(pid)
	return err != nil || fs[0] == "Z"
}

// restartListener kills the server listening on addr with SIGKILL, starts
// its command again, and returns once ready reports it serving (bounded by
// 120 s), with the Mono() times of the kill and of readiness.
//
// A server that rewrites its command line (Redis shows its address there)
// passes argv, which returns the command to start again instead (read before
// the kill).
func restartListener(ctx context.Context, env *Env, addr string, ready func(ctx context.Context) error,
	argv func(ctx context.Context) ([]string, error)) (killed, readyAt int64, err error) {
	_, portStr, err := net.SplitHostPort(addr)
	if err != nil {
		return 0, 0, err
	}
	port, err := strconv.Atoi(portStr)
	if err != nil {
		return 0, 0, err
	}
	pid, err := listenerPid(port)
	if err != nil {
		return 0, 0, err
	}
	sp, err := readServerProc(pid)
	if err != nil {
		return 0, 0, fmt.Errorf("read server process %d: %w", pid, err)
	}
	if argv != nil {
		if sp.argv, err = argv(ctx); err != nil {
			return 0, 0, fmt.Errorf("server command line: %w", err)
		}
		sp.exe = sp.argv[0]
	}
	// Stopped, it forks no more children (PostgreSQL starts a backend per
	// connection): the list is complete when the kill comes.
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		return 0, 0, fmt.Errorf("stop server %d: %w", pid, err)
	}
	sp.children = childrenOf(pid)
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		return 0, 0, fmt.Errorf("kill server %d: %w", pid, err)
	}
	killed = Mono()
	// Its children too: PostgreSQL's backends exit when they notice their
	// postmaster's death, and a new postmaster refuses to start while they
	// still hold its shared memory.
	deadline := time.Now().Add(30 * time.Second)
	for _, p := range append([]int{pid}, sp.children...) {
		for !gone(p) {
			if time.Now().After(deadline) {
				return killed, 0, fmt.Errorf("server %d (or its child %d) did not die", pid, p)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	// A zombie has closed its sockets, but PostgreSQL's new postmaster
	// still takes it (kill(pid, 0)) for a live one holding its data
	// directory: give its parent a moment to reap it.
	for reaped := time.Now().Add(5 * time.Second); time.Now().Before(reaped); time.Sleep(5 * time.Millisecond) {
		if _, err := os.Stat(filepath.Join("/proc", strconv.Itoa(pid))); err != nil {
			break
		}
	}
	cmd := &exec.Cmd{Path: sp.exe, Args: sp.argv}
	cmd.Dir, cmd.Env = sp.dir, sp.env
	// Ours: started by this process, and not as the relaunch of someone
	// else's server.
	ours := sp.ppid == os.Getpid() && (env.relaunched == nil || !env.relaunched.isForeign(pid))
	if ours {
		// Dies with the harness, as the original (a child of ours) would.
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	} else {
		// Someone else's server: it outlives the harness.
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	}
	if sp.cred.Uid != uint32(os.Getuid()) {
		cmd.SysProcAttr.Credential = sp.cred
	}
	logf, err := os.Create(filepath.Join(env.Dir, fmt.Sprintf("server-%d.log", pid)))
	if err != nil {
		return killed, 0, err
	}
	defer logf.Close()
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		return killed, 0, fmt.Errorf("start %s again: %w", sp.exe, err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	switch {
	case env.relaunched == nil:
	case ours:
		env.relaunched.add(cmd, done)
	default:
		env.relaunched.markForeign(cmd.Process.Pid)
	}
	deadline = time.Now().Add(120 * time.Second)
	for {
		rctx, cancel := context.WithTimeout(ctx, time.Second)
		err := ready(rctx)
		cancel()
		if err == nil {
			return killed, Mono(), nil
		}
		select {
		case <-done:
			out, _ := os.ReadFile(logf.Name())
			return killed, 0, fmt.Errorf("%s exited after its restart: %s", sp.exe, lastLines(out, 5))
		default:
		}
		if ctx.Err() != nil || time.Now().After(deadline) {
			return killed, 0, fmt.Errorf("server at %s not ready 120 s after its restart: %w", addr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func lastLines(b []byte, n int) string {
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// roundTrip sends req to addr on a new connection and returns the reply: up
// to 4 KiB, until it holds until, the server closes, or 1 s passes.
func roundTrip(ctx context.Context, addr, req, until string) (string, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(time.Second))
	if _, err := c.Write([]byte(req)); err != nil {
		return "", err
	}
	buf := make([]byte, 4096)
	n := 0
	for n < len(buf) {
		m, err := c.Read(buf[n:])
		n += m
		if err != nil || bytes.Contains(buf[:n], []byte(until)) {
			break
		}
	}
	return string(buf[:n]), nil
}

// Readiness checks of the restartable servers.
func redisReady(addr string) func(ctx context.Context) error {
	return func(ctx context.Context) error {
		out, err := roundTrip(ctx, addr, "PING\r\n", "\n")
		if err == nil && !strings.HasPrefix(out, "+PONG") {
			err = fmt.Errorf("PING: %q", out)
		}
		return err
	}
}

func etcdReady(addr string) func(ctx context.Context) error {
	return func(ctx context.Context) error {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/health", nil)
		if err != nil {
			return err
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		var body [256]byte
		n, _ := resp.Body.Read(body[:])
		if resp.StatusCode != http.StatusOK || !strings.Contains(string(body[:n]), `"health":"true"`) {
			return fmt.Errorf("etcd /health: %d %q", resp.StatusCode, body[:n])
		}
		return nil
	}
}

func zkReady(addr string) func(ctx context.Context) error {
	return func(ctx context.Context) error {
		out, err := roundTrip(ctx, addr, "srvr", "Mode: ")
		if err == nil && !strings.Contains(out, "Mode: ") {
			err = errors.New("srvr: not serving")
		}
		return err
	}
}

// redisSettings are the settings that define where and how a Redis serves,
// which redisArgv passes on its command line (they override its config file).
var redisSettings = []string{"port", "bind", "unixsocket", "unixsocketperm", "dir", "dbfilename", "save",
	"appendonly", "appendfilename", "requirepass", "protected-mode", "logfile", "databases",
	"maxmemory", "maxmemory-policy", "notify-keyspace-events", "timeout", "tcp-keepalive"}

// redisArgv returns the command that starts the Redis at addr again, in the
// foreground: Redis replaces its command line with its address, so it is
// rebuilt from INFO (executable, config file) and CONFIG GET of
// redisSettings.
func redisArgv(addr string) func(ctx context.Context) ([]string, error) {
	return func(ctx context.Context) ([]string, error) {
		rdb := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
		defer rdb.Close()
		info, err := rdb.Info(ctx, "server").Result()
		if err != nil {
			return nil, err
		}
		fields := map[string]string{}
		for _, line := range strings.Split(info, "\n") {
			if k, v, ok := strings.Cut(strings.TrimSpace(line), ":"); ok {
				fields[k] = v
			}
		}
		exe := fields["executable"]
		if _, err := os.Stat(exe); err != nil {
			// Redis joins a relative argv[0] to its working directory: a
			// server started as "redis-server" from $PATH names a file that
			// does not exist.
			if exe, err = exec.LookPath(filepath.Base(exe)); err != nil {
				return nil, fmt.Errorf("INFO server's executable %q: %w", fields["executable"], err)
			}
		}
		argv := []string{exe}
		if cf := fields["config_file"]; cf != "" {
			argv = append(argv, cf)
		}
		for _, name := range redisSettings {
			kv, err := rdb.ConfigGet(ctx, name).Result()
			if err != nil {
				return nil, err
			}
			if v, ok := kv[name]; ok {
				argv = append(argv, "--"+name, v)
			}
		}
		return append(argv, "--daemonize", "no"), nil
	}
}

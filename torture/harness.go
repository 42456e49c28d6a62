// Package torture is dlock's fault harness: it runs worker processes that
// contend for a few keys through dlock and guard a fenced resource with them,
// injects faults (SIGKILL and SIGSTOP of holders, network partitions,
// connection cuts and latency through an embedded toxiproxy, kill -9 of the
// database server), and checks the record: mutual exclusion at the store and
// at the resource, fencing, liveness and loss notification. See README.md.
package torture

import (
	"bufio"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/go-sql-driver/mysql"
)

// Fault kinds.
const (
	FaultKill      = "kill"      // SIGKILL a holder; its slot restarts
	FaultStop      = "stop"      // SIGSTOP a holder for 2×TTL, then SIGCONT
	FaultBlackhole = "blackhole" // drop all traffic between a holder and the store for 2×TTL
	FaultCut       = "cut"       // close a holder's store connections and refuse new ones for TTL
	FaultLatency   = "latency"   // add latency to a holder's store traffic for 3×TTL
	FaultDBRestart = "dbrestart" // kill -9 the store's server and start it again
	FaultPartition = "partition" // the kernel drops a holder's packets to and from the store for 2×TTL (Config.Netns)
)

// holderFaults are the kinds aimed at one holder; networkFaults need a
// networked store.
var (
	holderFaults  = []string{FaultKill, FaultStop, FaultBlackhole, FaultCut, FaultLatency, FaultPartition}
	networkFaults = []string{FaultBlackhole, FaultCut, FaultLatency, FaultPartition}
)

// Config is one harness invocation.
type Config struct {
	Strategies []string      // adapter names; empty means all
	Duration   time.Duration // per strategy
	Workers    int           // worker processes per strategy
	Keys       int           // lock keys
	// ModeKeys adds, for each strategy, a reader-writer key if it grants
	// shared locks and a semaphore key if it grants limited ones, and an
	// exclusive key taken through a dlock.Election and observed by every
	// worker (see modes.go), next to the Keys exclusive ones.
	ModeKeys   bool
	TTL        time.Duration // lease
	Seed       uint64        // fault schedule and worker choices
	Faults     []string      // holder fault kinds to inject
	FaultEvery time.Duration // mean interval between holder faults
	LongFrac   float64       // share of holds up to 2×TTL (the rest up to 50 ms)
	// ClientFaults are the client fault kinds the workers inject in the
	// strategies' runs (not in the positive controls): see client.go.
	ClientFaults []string
	// ClientFaultsExcept names strategies whose runs inject no client
	// faults and run one lane per worker (their findings under client
	// faults are open: see docs/faults.md).
	ClientFaultsExcept []string
	// Lanes is the number of goroutines per worker that each run the
	// worker's loop on its one Locker, so that a worker holds several locks
	// on the same store sessions (0: 2 with client faults, else 1).
	Lanes int
	// DBRestart also kills the store's server with SIGKILL and starts it
	// again, every DBRestartEvery, for each strategy that has a restart
	// (Adapter.Restart: every networked one), or only for
	// those in RestartOnly if it is not empty. Disruptive: every other user
	// of the server sees it die.
	DBRestart      bool
	DBRestartEvery time.Duration
	RestartOnly    []string
	// Failover, if set, is the replicated store of every selected
	// strategy (Cluster.Configure names them): every FailoverEvery the
	// failover fault kills its primary and promotes a replica. The store's
	// own record of its history is not read in such a run (a failover
	// loses part of it): the checker judges by the resource and the
	// workers' reports.
	Failover      Cluster
	FailoverEvery time.Duration
	NoFencing     bool    // the whole run is a positive control
	ClockSkew     float64 // workers' clocks run at 1−skew (even slots) or 1+skew (odd)
	// Netns runs the workers of networked strategies in network namespaces
	// of their own (root, ip and nft needed), which the partition fault
	// requires.
	Netns    bool
	Control  time.Duration // after each strategy, a positive-control run this long (0: none)
	MySQLDSN string        // the MariaDB for the resource and the mysql strategies
	// StoreDSN, if set, is another MariaDB for the mysql strategies' lock
	// tables, whose clock need not be this host's (libfaketime): the
	// harness samples it through the run and maps the store's instants by
	// it. The resource stays on MySQLDSN.
	StoreDSN string
	// Galera: the lock tables' server (StoreDSN) is a node of a MariaDB
	// Galera cluster, which does not replicate named locks: the lease
	// strategy's doorbells go to GaleraBells, one node's DSN that every
	// worker reaches directly (mysqllock.Options.Connector), or are off
	// (Options.NoDoorbell) without it.
	Galera      bool
	GaleraBells string
	// VersionSessions: see Env.VersionSessions.
	VersionSessions bool
	PGDSN           string    // the PostgreSQL for the pg strategies (needed only for those)
	RedisAddr       string    // host:port of the Redis of redis-lease
	EtcdAddr        string    // host:port (client URL) of the etcd of etcd-lease
	ZKAddr          string    // host:port of the ZooKeeper of zk-lease
	ZKDataDir       string    // that ZooKeeper's dataDir (its transaction log is zk-lease's history)
	Out             string    // output directory
	Tag             string    // table-name tag: torture_<tag>_*
	Log             io.Writer // progress lines; nil discards

	// RedisMinReplicas is redis-lease's redislock.Options.MinReplicas:
	// how many replicas acknowledge each grant and extension (WAIT).
	RedisMinReplicas int
}

var tagRE = regexp.MustCompile(`^[a-z0-9]{1,16}$`)

func (c *Config) check() error {
	if len(c.Strategies) == 0 {
		for _, a := range Adapters {
			c.Strategies = append(c.Strategies, a.Name)
		}
	}
	for _, s := range c.Strategies {
		a := adapterByName(s)
		switch {
		case a == nil:
			return fmt.Errorf("unknown strategy %q (have %s)", s, adapterNames())
		case a.Networked && a.Upstream == nil:
			return fmt.Errorf("strategy %s: networked without Upstream", s)
		}
	}
	for _, f := range c.ClientFaults {
		if !slices.Contains(clientFaults, f) {
			return fmt.Errorf("unknown client fault %q (have %s)", f, strings.Join(clientFaults, ","))
		}
	}
	if c.Lanes == 0 {
		c.Lanes = 1
		if len(c.ClientFaults) > 0 {
			c.Lanes = 2
		}
	}
	for _, f := range c.Faults {
		if !slices.Contains(holderFaults, f) {
			return fmt.Errorf("unknown fault %q (have %s)", f, strings.Join(holderFaults, ","))
		}
		if f == FaultPartition && !c.Netns {
			return errors.New("the partition fault needs network namespaces (Config.Netns, -netns)")
		}
	}
	if c.Netns {
		if err := netnsAvailable(); err != nil {
			return err
		}
	}
	switch {
	case c.Workers < 2 || c.Workers > 64:
		return errors.New("workers must be 2..64")
	case c.Lanes < 1 || c.Lanes > 8:
		return errors.New("lanes must be 1..8")
	case c.Keys < 1 || c.Keys > 1000:
		return errors.New("keys must be 1..1000")
	case c.TTL < time.Second:
		return errors.New("ttl must be at least 1s (dlock.MinTTL)")
	case c.Duration < 5*time.Second:
		return errors.New("duration must be at least 5s")
	case c.FaultEvery <= 0:
		return errors.New("fault interval must be positive")
	case !tagRE.MatchString(c.Tag):
		return errors.New("tag must be 1-16 of [a-z0-9]")
	case c.LongFrac < 0 || c.LongFrac > 1:
		return errors.New("long-frac must be in [0,1]")
	case c.ClockSkew < 0 || c.ClockSkew >= 1:
		return errors.New("clock-skew must be in [0,1)")
	}
	if c.StoreDSN != "" && c.DBRestart {
		for _, s := range c.Strategies {
			if strings.HasPrefix(s, "mysql-") && (len(c.RestartOnly) == 0 || slices.Contains(c.RestartOnly, s)) {
				return errors.New("a separate lock server (StoreDSN, -store-dsn) is not restarted by the restart fault: leave the mysql strategies out of it")
			}
		}
	}
	if c.DBRestartEvery <= 0 {
		c.DBRestartEvery = 30 * time.Second
	}
	if c.Failover != nil && c.DBRestart {
		return errors.New("the failover fault and the restart fault do not run together")
	}
	if c.FailoverEvery <= 0 {
		c.FailoverEvery = 20 * time.Second
	}
	if c.Log == nil {
		c.Log = io.Discard
	}
	c.Log = &syncWriter{w: c.Log} // fault goroutines log concurrently
	return nil
}

type syncWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (s *syncWriter) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(p)
}

// mode is one run of one strategy.
type mode struct {
	adapter    *Adapter
	noFencing  bool
	control    bool // a positive-control run appended to a normal one
	faults     []string
	client     []string // client fault kinds
	faultEvery time.Duration
	duration   time.Duration
	longFrac   float64
	dbRestart  bool
	failover   bool
	name       string // directory and report name
}

// Run runs the harness and returns its report. The error is for setup
// failures; violations are in the report (Report.Failed).
func Run(ctx context.Context, cfg Config) (*Report, error) {
	if err := cfg.check(); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(cfg.Out, 0o755); err != nil {
		return nil, err
	}
	dsn, err := directDSN(cfg.MySQLDSN)
	if err != nil {
		return nil, err
	}
	db, err := sql.Open("mysql", dsn)
	if err != nil {
		return nil, err
	}
	defer db.Close()
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	err = db.PingContext(pctx)
	cancel()
	if err != nil {
		return nil, fmt.Errorf("%w: MariaDB at %s: %v", ErrNoServer, cfg.MySQLDSN, err)
	}
	env := Env{MySQLDSN: dsn, DB: db, StoreDSN: dsn, StoreDB: db, PGDSN: cfg.PGDSN, RedisAddr: cfg.RedisAddr, RedisMinReplicas: cfg.RedisMinReplicas, EtcdAddr: cfg.EtcdAddr, ZKAddr: cfg.ZKAddr, ZKDataDir: cfg.ZKDataDir, TTL: cfg.TTL, VersionSessions: cfg.VersionSessions, Galera: cfg.Galera, GaleraBells: cfg.GaleraBells}
	if cfg.StoreDSN != "" {
		sdsn, err := directDSN(cfg.StoreDSN)
		if err != nil {
			return nil, fmt.Errorf("store DSN: %w", err)
		}
		sdb, err := sql.Open("mysql", sdsn)
		if err != nil {
			return nil, err
		}
		defer sdb.Close()
		pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err = sdb.PingContext(pctx)
		cancel()
		if err != nil {
			return nil, fmt.Errorf("%w: MariaDB of the locks at %s: %v", ErrNoServer, cfg.StoreDSN, err)
		}
		env.StoreDSN, env.StoreDB = sdsn, sdb
	}
	if err := checkServers(ctx, cfg.Strategies, &env); err != nil {
		return nil, err
	}
	env.relaunched = &relaunched{}
	defer env.relaunched.killAll()
	rep := &Report{Config: reportConfig(cfg), Started: time.Now().UTC()}
	if cfg.DBRestart {
		// Whatever happens, leave the server running.
		defer func() {
			if err := ensureMariaDB(db); err != nil {
				fmt.Fprintln(cfg.Log, "WARNING: could not restart MariaDB:", err)
			}
		}()
	}
	var modes []mode
	for _, s := range cfg.Strategies {
		a := adapterByName(s)
		faults := cfg.Faults
		if !a.Networked {
			faults = slices.DeleteFunc(slices.Clone(faults), func(f string) bool { return slices.Contains(networkFaults, f) })
		}
		name := a.Name
		if cfg.NoFencing {
			name += "-nofencing"
		}
		client := cfg.ClientFaults
		if slices.Contains(cfg.ClientFaultsExcept, a.Name) {
			client = nil
		}
		modes = append(modes, mode{adapter: a, noFencing: cfg.NoFencing, control: cfg.NoFencing, faults: faults,
			client: client, faultEvery: cfg.FaultEvery, duration: cfg.Duration, longFrac: cfg.LongFrac,
			dbRestart: cfg.DBRestart && a.Restart != nil && (len(cfg.RestartOnly) == 0 || slices.Contains(cfg.RestartOnly, a.Name)),
			failover:  cfg.Failover != nil,
			name:      name})
		if cfg.Control > 0 && !cfg.NoFencing {
			modes = append(modes, mode{adapter: a, noFencing: true, control: true, faults: []string{FaultStop},
				faultEvery: cfg.TTL, duration: cfg.Control, longFrac: 1, name: a.Name + "-control"})
		}
	}
	for i, m := range modes {
		if ctx.Err() != nil {
			break
		}
		sr, err := runMode(ctx, cfg, m, i, env)
		if err != nil {
			return rep, fmt.Errorf("%s: %w", m.name, err)
		}
		rep.Runs = append(rep.Runs, sr)
	}
	rep.Finished = time.Now().UTC()
	rep.finish()
	return rep, ctx.Err()
}

// ErrNoServer means a database server the harness needs is unreachable:
// the MariaDB, or the server of a selected networked strategy.
var ErrNoServer = errors.New("torture: no database server")

// checkServers makes sure, before any run, that the server of each selected
// networked strategy accepts connections, so that a missing one fails the
// invocation at once rather than after the other strategies ran.
func checkServers(ctx context.Context, strategies []string, env *Env) error {
	for _, s := range strategies {
		a := adapterByName(s)
		if !a.Networked {
			continue
		}
		up, err := a.Upstream(env)
		if err != nil {
			return fmt.Errorf("%s: %w", a.Name, err)
		}
		d := net.Dialer{Timeout: 5 * time.Second}
		c, err := d.DialContext(ctx, "tcp", up)
		if err != nil {
			return fmt.Errorf("%w: %s: %v", ErrNoServer, a.Name, err)
		}
		c.Close()
	}
	return nil
}

// directDSN is the DSN for the harness and the resource: as given, with
// interpolated parameters (one round trip per statement).
func directDSN(dsn string) (string, error) {
	cfg, err := mysql.ParseDSN(dsn)
	if err != nil {
		return "", err
	}
	cfg.InterpolateParams = true
	if cfg.Timeout == 0 {
		cfg.Timeout = 2 * time.Second
	}
	return cfg.FormatDSN(), nil
}

// runner is the state of one mode's run.
type runner struct {
	cfg      Config
	m        mode
	env      *Env
	store    string
	dir      string
	keys     []string
	modeKeys map[string]int // keys taken in other modes (Config.ModeKeys)
	leader   string         // the key taken through an Election (Config.ModeKeys)
	fp       *faultProxies
	rng      *rand.Rand    // fault choices; used by the scheduler goroutine only
	ns       *namespaces   // with Config.Netns, for networked stores
	rp       *faultProxies // the workers' way to the resource, in namespaces (never faulted)
	// rec is the adapter's recording (Adapter.Record); collect stops it
	// and clears stopRecord.
	rec        *Recording
	stopRecord func(ctx context.Context) ([]LeaseEvent, error)
	clock      clockSampler
	storeClock *storeClock // with Config.StoreDSN and Adapter.StoreClock

	mu       sync.Mutex
	procs    []*proc // current process per slot
	all      []*proc
	faults   []FaultRecord
	stopping bool
}

// proc is one worker process.
type proc struct {
	slot   int
	id     string
	cmd    *exec.Cmd
	stdin  io.Closer
	events string
	exited chan struct{}

	mu       sync.Mutex
	killed   bool // by the harness
	lateKill bool // SIGKILLed because it ignored SIGTERM
	termed   bool // sent SIGTERM at the end of the run
	faulted  bool // a fault is aimed at it now
	holds    map[string]heldKey
	waitErr  error
}

// heldKey is a hold a worker reported.
type heldKey struct {
	fence uint64
	end   int64 // planned end (Mono)
}

// FaultRecord is one injected fault, with Mono() times.
type FaultRecord struct {
	Kind   string `json:"kind"`
	Slot   int    `json:"slot"`
	Worker string `json:"worker,omitempty"`
	Pid    int    `json:"pid,omitempty"`
	Key    string `json:"key,omitempty"`   // the hold the harness saw when injecting
	Fence  uint64 `json:"fence,omitempty"` // its fence
	Start  int64  `json:"start"`
	End    int64  `json:"end"`
	Err    string `json:"err,omitempty"`
}

func runMode(ctx context.Context, cfg Config, m mode, idx int, env Env) (*RunReport, error) {
	r := &runner{
		cfg: cfg, m: m,
		dir:   filepath.Join(cfg.Out, m.name),
		rng:   rand.New(rand.NewPCG(cfg.Seed, uint64(idx)+1)),
		procs: make([]*proc, cfg.Workers),
	}
	if err := os.RemoveAll(r.dir); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(r.dir, 0o755); err != nil {
		return nil, err
	}
	tag := fmt.Sprintf("%s%d", cfg.Tag, idx)
	env.Tag, env.Dir = tag, r.dir
	env.Unrecorded = m.failover
	r.env = &env
	db := env.DB
	for i := range cfg.Keys {
		r.keys = append(r.keys, fmt.Sprintf("k%d", i))
	}
	if cfg.ModeKeys {
		r.modeKeys = modeKeys(m.adapter.Modes)
		for _, k := range []string{rwKey, semKey} {
			if _, ok := r.modeKeys[k]; ok {
				r.keys = append(r.keys, k)
			}
		}
		r.leader = leaderKey
		r.keys = append(r.keys, leaderKey)
	}
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := setupResource(sctx, db, tag, r.keys); err != nil {
		return nil, err
	}
	store, err := m.adapter.Prepare(sctx, r.env)
	if err != nil {
		return nil, err
	}
	r.store = store
	if m.adapter.Record != nil && !m.failover {
		rec, err := m.adapter.Record(ctx, r.env, store)
		if err != nil {
			return nil, fmt.Errorf("record the store: %w", err)
		}
		r.rec, r.stopRecord = rec, rec.Stop
		defer func() {
			if r.stopRecord != nil { // not collected: an early return
				_, _ = r.stopRecord(context.Background())
			}
		}()
	}
	if m.adapter.Networked {
		up, err := m.adapter.Upstream(r.env)
		if err != nil {
			return nil, err
		}
		var listen func(int) string
		if cfg.Netns {
			if r.ns, err = newNamespaces(cfg.Workers); err != nil {
				return nil, err
			}
			defer r.ns.close()
			listen = func(slot int) string { return r.ns.hostIP(slot).String() }
			// The resource too is reached through the slot's veth.
			resUp, err := mysqlUpstream(r.env)
			if err != nil {
				return nil, err
			}
			if r.rp, err = newFaultProxies(cfg.Workers, []string{resUp}, listen); err != nil {
				return nil, err
			}
			defer r.rp.close()
		}
		ups := []string{up}
		if s, ok := cfg.Failover.(Spread); ok && m.failover {
			ups = s.Upstreams()
		}
		if r.fp, err = newFaultProxies(cfg.Workers, ups, listen); err != nil {
			return nil, err
		}
		defer r.fp.close()
	}
	fmt.Fprintf(cfg.Log, "== %s: %d workers × %d lanes, %d keys%s, ttl %s, %s, faults %v every ~%s%s, client faults %v, fencing %v\n",
		m.name, cfg.Workers, r.lanes(), cfg.Keys, describeModeKeys(r.modeKeys, r.leader), cfg.TTL, m.duration, m.faults, m.faultEvery,
		map[bool]string{true: " + db restarts", false: ""}[m.dbRestart]+map[bool]string{true: " + failovers", false: ""}[m.failover], m.client, !m.noFencing)

	stopClock := make(chan struct{})
	clockDone := make(chan struct{})
	go func() { r.clock.run(stopClock); close(clockDone) }()
	storeClockDone := make(chan struct{})
	if cfg.StoreDSN != "" && m.adapter.StoreClock != nil {
		r.storeClock = &storeClock{}
		go func() {
			r.storeClock.run(func(ctx context.Context) (int64, error) { return m.adapter.StoreClock(ctx, r.env) },
				100*time.Millisecond, stopClock)
			close(storeClockDone)
		}()
	} else {
		close(storeClockDone)
	}

	// Workers: one supervisor per slot restarts killed workers.
	var sup sync.WaitGroup
	defer r.killAll() // also on panic
	for slot := range cfg.Workers {
		sup.Add(1)
		go func() { defer sup.Done(); r.supervise(slot) }()
	}

	rctx, rcancel := context.WithTimeout(ctx, m.duration)
	started := Mono()
	var faults sync.WaitGroup
	faults.Add(1)
	go func() { defer faults.Done(); r.schedule(rctx, &faults) }()
	if m.dbRestart {
		faults.Add(1)
		go func() { defer faults.Done(); r.restarts(rctx) }()
	}
	if m.failover {
		faults.Add(1)
		go func() { defer faults.Done(); r.failovers(rctx) }()
	}
	<-rctx.Done()
	rcancel()
	faults.Wait() // every fault has been undone (SIGCONT sent, toxics removed)
	ended := Mono()
	r.stopAll()
	sup.Wait()
	close(stopClock)
	<-clockDone
	<-storeClockDone

	if m.dbRestart {
		if err := waitReady(context.Background(), db, 120*time.Second); err != nil {
			return nil, err
		}
	}
	return r.collect(started, ended)
}

// supervise keeps a worker running in slot until the run stops.
func (r *runner) supervise(slot int) {
	for inc := 1; ; inc++ {
		r.mu.Lock()
		stopping := r.stopping
		r.mu.Unlock()
		if stopping {
			return
		}
		p, err := r.start(slot, inc)
		if err != nil {
			r.recordFault(FaultRecord{Kind: "spawn-error", Slot: slot, Start: Mono(), End: Mono(), Err: err.Error()})
			time.Sleep(time.Second)
			continue
		}
		<-p.exited
		time.Sleep(200 * time.Millisecond) // a restarted service comes back after a while
	}
}

// lanes is the run's lanes per worker: one for a strategy run without
// client faults (ClientFaultsExcept).
func (r *runner) lanes() int {
	if slices.Contains(r.cfg.ClientFaultsExcept, r.m.adapter.Name) {
		return 1
	}
	return r.cfg.Lanes
}

func (r *runner) start(slot, inc int) (*proc, error) {
	id := fmt.Sprintf("w%d.%d", slot, inc)
	p := &proc{slot: slot, id: id, events: filepath.Join(r.dir, id+".jsonl"), exited: make(chan struct{})}
	addr, resAddr := "", ""
	if r.fp != nil {
		addr = r.fp.addr(slot)
	}
	if r.rp != nil {
		resAddr = r.rp.addr(slot)
	}
	wc := workerConfig{
		ID: id, Strategy: r.m.adapter.Name, Tag: r.env.Tag, Keys: r.keys, ModeKeys: r.modeKeys, Leader: r.leader, TTL: r.cfg.TTL,
		Open:         OpenArgs{DSN: r.env.MySQLDSN, StoreDSN: r.env.StoreDSN, Galera: r.env.Galera, GaleraBells: r.env.GaleraBells, PGDSN: r.env.PGDSN, Store: r.store, Addr: addr, RedisMinReplicas: r.env.RedisMinReplicas},
		Lanes:        r.lanes(),
		ClientFaults: r.m.client,
		Resource:     resAddr,
		Seed:         r.cfg.Seed ^ uint64(slot)<<32 ^ uint64(inc),
		LongFrac:     r.m.longFrac,
		NoFencing:    r.m.noFencing,
		ClockRate:    workerRate(slot, r.cfg.ClockSkew),
		Events:       p.events,
	}
	if slices.Contains(r.m.client, ClientSmallPool) && r.m.adapter.Pooled {
		wc.Open.PoolSize = poolSize(slot)
	}
	js, _ := json.Marshal(wc)
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	stderr, err := os.Create(filepath.Join(r.dir, id+".stderr"))
	if err != nil {
		return nil, err
	}
	defer stderr.Close()
	var args []string
	if strings.HasSuffix(exe, ".test") {
		args = []string{"-test.run=^$"} // the harness is a test: run no tests in the worker
	}
	cmd := exec.Command(exe, args...)
	if r.ns != nil {
		cmd = r.ns.command(slot, exe, args...)
	}
	cmd.Env = append(os.Environ(), workerEnv+"="+string(js))
	cmd.Stderr = stderr
	// The kernel kills workers if the harness dies, even while stopped.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	if r.stopping {
		r.mu.Unlock()
		return nil, errors.New("stopping")
	}
	if err := cmd.Start(); err != nil {
		r.mu.Unlock()
		return nil, err
	}
	p.cmd, p.stdin = cmd, stdin
	r.procs[slot] = p
	r.all = append(r.all, p)
	r.mu.Unlock()

	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			p.state(sc.Text())
		}
		err := cmd.Wait()
		p.mu.Lock()
		p.waitErr = err
		p.holds = nil
		p.mu.Unlock()
		close(p.exited)
	}()
	return p, nil
}

// state applies a state line from the worker.
func (p *proc) state(line string) {
	f := strings.Fields(line)
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case len(f) == 4 && f[0] == "H":
		fence, _ := strconv.ParseUint(f[2], 10, 64)
		ms, _ := strconv.ParseInt(f[3], 10, 64)
		if p.holds == nil {
			p.holds = map[string]heldKey{}
		}
		p.holds[f[1]] = heldKey{fence, Mono() + ms*int64(time.Millisecond)}
	case len(f) == 2 && f[0] == "E":
		delete(p.holds, f[1])
	}
}

func (p *proc) pid() int { return p.cmd.Process.Pid }

func (p *proc) signal(sig syscall.Signal) { _ = syscall.Kill(p.pid(), sig) }

// stopSupervising tells the supervisors to start no more workers and
// returns every worker started so far.
func (r *runner) stopSupervising() []*proc {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.stopping = true
	return slices.Clone(r.all)
}

// stopAll ends the workers: SIGTERM (they release and exit), then SIGKILL
// for any still running after a grace period.
func (r *runner) stopAll() {
	procs := r.stopSupervising()
	for _, p := range procs {
		select {
		case <-p.exited:
			continue
		default:
		}
		p.mu.Lock()
		p.termed = true
		p.mu.Unlock()
		p.signal(syscall.SIGCONT)
		p.signal(syscall.SIGTERM)
	}
	grace := make(chan struct{})
	t := time.AfterFunc(10*time.Second, func() { close(grace) })
	defer t.Stop()
	for _, p := range procs {
		select {
		case <-p.exited:
		case <-grace:
			p.mu.Lock()
			p.killed, p.lateKill = true, true
			p.mu.Unlock()
			p.signal(syscall.SIGKILL)
			<-p.exited
		}
	}
}

// killAll SIGKILLs every worker still alive (on the way out, panics included).
func (r *runner) killAll() {
	for _, p := range r.stopSupervising() {
		select {
		case <-p.exited:
		default:
			p.mu.Lock()
			p.killed = true
			p.mu.Unlock()
			p.signal(syscall.SIGKILL)
		}
	}
}

func (r *runner) recordFault(f FaultRecord) {
	r.mu.Lock()
	r.faults = append(r.faults, f)
	r.mu.Unlock()
}

// schedule injects holder faults at jittered intervals until ctx ends.
func (r *runner) schedule(ctx context.Context, wg *sync.WaitGroup) {
	if len(r.m.faults) == 0 {
		return
	}
	for {
		d := r.m.faultEvery/2 + time.Duration(r.rng.Int64N(int64(r.m.faultEvery)))
		if !sleepCtx(ctx, d) {
			return
		}
		kind := r.m.faults[r.rng.IntN(len(r.m.faults))]
		// One-way latency for FaultLatency: up to TTL/3 more than 50 ms (a
		// renewal is two round trips, so the upper range makes renewals miss
		// their deadline).
		lat := 50 + r.rng.Int64N(r.cfg.TTL.Milliseconds()/3)
		p, key, fence := r.pickHolder()
		if p == nil {
			r.recordFault(FaultRecord{Kind: kind, Slot: -1, Start: Mono(), End: Mono(), Err: "no eligible holder"})
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.inject(ctx, kind, p, key, fence, lat)
			p.mu.Lock()
			p.faulted = false
			p.mu.Unlock()
		}()
	}
}

// pickHolder chooses a live worker in a hold with at least 300 ms left and no
// fault aimed at it, preferring long holds; it marks the worker faulted.
func (r *runner) pickHolder() (*proc, string, uint64) {
	r.mu.Lock()
	procs := slices.Clone(r.procs)
	r.mu.Unlock()
	now := Mono()
	var long, any []*proc
	for _, p := range procs {
		if p == nil {
			continue
		}
		select {
		case <-p.exited:
			continue
		default:
		}
		p.mu.Lock()
		if !p.faulted && !p.killed && len(p.holds) > 0 {
			any = append(any, p)
			if _, h := p.lastHold(); h.end-now > int64(300*time.Millisecond) {
				long = append(long, p)
			}
		}
		p.mu.Unlock()
	}
	cands := long
	if len(cands) == 0 {
		cands = any
	}
	if len(cands) == 0 {
		return nil, "", 0
	}
	p := cands[r.rng.IntN(len(cands))]
	p.mu.Lock()
	defer p.mu.Unlock()
	p.faulted = true
	k, h := p.lastHold()
	return p, k, h.fence
}

// lastHold returns the hold that ends last. p.mu must be held.
func (p *proc) lastHold() (string, heldKey) {
	var key string
	var last heldKey
	for k, h := range p.holds {
		if key == "" || h.end > last.end || (h.end == last.end && k < key) {
			key, last = k, h
		}
	}
	return key, last
}

// inject applies one holder fault and undoes it (at once if ctx ends).
func (r *runner) inject(ctx context.Context, kind string, p *proc, key string, fence uint64, lat int64) {
	ttl := r.cfg.TTL
	f := FaultRecord{Kind: kind, Slot: p.slot, Worker: p.id, Pid: p.pid(), Key: key, Fence: fence}
	defer func() {
		f.End = Mono()
		r.recordFault(f)
		fmt.Fprintf(r.cfg.Log, "   %-9s %s (%s fence %d) for %s%s\n", kind, p.id, key, fence,
			time.Duration(f.End-f.Start).Round(time.Millisecond), map[bool]string{true: ": " + f.Err, false: ""}[f.Err != ""])
	}()
	switch kind {
	case FaultKill:
		p.mu.Lock()
		p.killed = true
		p.mu.Unlock()
		f.Start = Mono()
		p.signal(syscall.SIGKILL)
		<-p.exited
	case FaultStop:
		f.Start = Mono()
		p.signal(syscall.SIGSTOP)
		sleepCtx(ctx, 2*ttl)
		p.signal(syscall.SIGCONT)
	case FaultBlackhole:
		f.Start = Mono()
		if err := r.fp.addToxic(p.slot, "blackhole", "timeout", `{"timeout":0}`); err != nil {
			f.Err = err.Error()
		}
		sleepCtx(ctx, 2*ttl)
		r.fp.removeToxic(p.slot, "blackhole")
		// The toxic dropped bytes mid-stream: heal with fresh connections.
		r.fp.cut(p.slot)
		if err := r.fp.mend(p.slot); err != nil {
			f.Err = err.Error()
		}
	case FaultCut:
		f.Start = Mono()
		r.fp.cut(p.slot)
		sleepCtx(ctx, ttl)
		if err := r.fp.mend(p.slot); err != nil {
			f.Err = err.Error()
		}
	case FaultPartition:
		_, port, _ := net.SplitHostPort(r.fp.addr(p.slot))
		n, _ := strconv.ParseUint(port, 10, 16)
		f.Start = Mono()
		if err := r.ns.partition(p.slot, uint16(n)); err != nil {
			f.Err = err.Error()
		}
		sleepCtx(ctx, 2*ttl)
		if err := r.ns.heal(p.slot); err != nil && f.Err == "" {
			f.Err = err.Error()
		}
	case FaultLatency:
		f.Start = Mono()
		if err := r.fp.addToxic(p.slot, "latency", "latency", fmt.Sprintf(`{"latency":%d,"jitter":%d}`, lat, lat/4)); err != nil {
			f.Err = err.Error()
		}
		sleepCtx(ctx, 3*ttl)
		r.fp.removeToxic(p.slot, "latency")
	}
}

// restarts kills and restarts the store's server at intervals.
func (r *runner) restarts(ctx context.Context) {
	for {
		if !sleepCtx(ctx, r.cfg.DBRestartEvery) {
			return
		}
		fmt.Fprintln(r.cfg.Log, "   dbrestart: kill -9 of the server")
		f := r.restart()
		fmt.Fprintf(r.cfg.Log, "   dbrestart: serving again after %s %s\n", time.Duration(f.End-f.Start).Round(time.Millisecond), f.Err)
		r.recordFault(f)
	}
}

// restart kills the store's server and starts it again. With a recording
// that must see every change (Recording.Sync), the workers' way to the store
// is cut first and the record synced, and both are restored afterwards: the
// clients see their connections drop a few milliseconds before the kill
// instead of at it.
func (r *runner) restart() FaultRecord {
	f := FaultRecord{Kind: FaultDBRestart, Slot: -1}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var errs []error
	quiet := r.rec != nil && r.rec.Sync != nil && r.fp != nil
	if quiet {
		r.fp.takeAway()
		// A request the proxy passed on just before may still be in the
		// server's socket buffer: let it run before the sync.
		time.Sleep(20 * time.Millisecond)
		if err := r.rec.Sync(ctx); err != nil {
			errs = append(errs, fmt.Errorf("sync the record: %w", err))
		}
	}
	killed, ready, err := r.m.adapter.Restart(ctx, r.env)
	f.Start, f.End = killed, ready
	errs = append(errs, err)
	if killed > 0 && r.rec != nil && r.rec.Restarted != nil {
		killedUs := (killed + wallMinusMono()) / 1000
		if err := r.rec.Restarted(ctx, killedUs); err != nil {
			errs = append(errs, fmt.Errorf("record after the restart: %w", err))
		}
	}
	if quiet {
		errs = append(errs, r.fp.giveBack())
	}
	if err := errors.Join(errs...); err != nil {
		f.Err = err.Error()
	}
	if f.Start == 0 {
		f.Start = Mono()
	}
	if f.End == 0 {
		f.End = Mono()
	}
	return f
}

// failovers fails the cluster over at intervals.
func (r *runner) failovers(ctx context.Context) {
	for {
		if !sleepCtx(ctx, r.cfg.FailoverEvery) {
			return
		}
		fmt.Fprintln(r.cfg.Log, "   failover: begins")
		f := FaultRecord{Kind: FaultFailover, Slot: -1}
		fctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		killed, ready, err := r.cfg.Failover.Failover(fctx, r.cfg.Log)
		cancel()
		f.Start, f.End = killed, ready
		if err != nil {
			f.Err = err.Error()
		}
		if f.Start == 0 {
			f.Start = Mono()
		}
		if f.End == 0 {
			f.End = Mono()
		}
		fmt.Fprintf(r.cfg.Log, "   failover: serving again after %s %s\n", time.Duration(f.End-f.Start).Round(time.Millisecond), f.Err)
		r.recordFault(f)
	}
}

// sleepCtx sleeps d and reports whether ctx is still live.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

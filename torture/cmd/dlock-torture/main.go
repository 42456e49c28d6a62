// Command dlock-torture runs dlock's fault harness: worker processes contend
// for a few keys through every lock strategy while faults are injected, and
// the record is checked for mutual exclusion, fencing, liveness and loss
// notification. It prints a Markdown summary, writes summary.json and
// summary.md into the output directory, and exits 1 on any violation (or if
// the positive control finds none), 3 if a check was inconclusive.
//
//	go run ./torture/cmd/dlock-torture -duration 60s
//	go run ./torture/cmd/dlock-torture -duration 30m -workers 8 -keys 8   # the long run
//	go run ./torture/cmd/dlock-torture -db-restart -strategies mysql-lease
//	go run ./torture/cmd/dlock-torture -db-restart -strategies redis-lease -redis 127.0.0.1:26379
//	go run ./torture/cmd/dlock-torture -strategies pg-lease,pg-advisory
//	go run ./torture/cmd/dlock-torture -client-faults none   # server, network and process faults only
//
// See torture/README.md.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/dlock-dev/dlock/torture"
)

func main() {
	torture.RunWorkerIfRequested() // this binary is also the worker
	os.Exit(run())
}

func run() int {
	var (
		cfg        torture.Config
		strategies string
		faults     string
		client     string
	)
	dsn := os.Getenv("DLOCK_MYSQL_DSN")
	if dsn == "" {
		dsn = "root@tcp(127.0.0.1:3306)/test"
	}
	pgDSN := os.Getenv("DLOCK_PG_DSN")
	if pgDSN == "" {
		pgDSN = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	}
	envOr := func(name, def string) string {
		if v := os.Getenv(name); v != "" {
			return v
		}
		return def
	}
	flag.StringVar(&cfg.RedisAddr, "redis", envOr("DLOCK_REDIS_ADDR", "127.0.0.1:6379"), "host:port of the Redis for redis-lease ($DLOCK_REDIS_ADDR)")
	flag.StringVar(&cfg.EtcdAddr, "etcd", envOr("DLOCK_ETCD_ADDR", "127.0.0.1:2379"), "host:port of the etcd for etcd-lease ($DLOCK_ETCD_ADDR)")
	flag.StringVar(&cfg.ZKAddr, "zk", envOr("DLOCK_ZK_ADDR", "127.0.0.1:2181"), "host:port of the ZooKeeper for zk-lease ($DLOCK_ZK_ADDR)")
	flag.StringVar(&cfg.ZKDataDir, "zk-data-dir", os.Getenv("DLOCK_ZK_DATA_DIR"), "that ZooKeeper's dataDir, readable here: its transaction log is zk-lease's history ($DLOCK_ZK_DATA_DIR)")
	flag.StringVar(&strategies, "strategies", "", "comma-separated strategies (default all: "+strings.Join(names(), ",")+")")
	flag.DurationVar(&cfg.Duration, "duration", 60*time.Second, "run time per strategy")
	flag.IntVar(&cfg.Workers, "workers", 5, "worker processes per strategy")
	flag.IntVar(&cfg.Keys, "keys", 2, "lock keys the workers contend for")
	flag.BoolVar(&cfg.ModeKeys, "modes", true, "also a reader-writer key and a semaphore key (limit 2) on every strategy that grants those modes")
	flag.DurationVar(&cfg.TTL, "ttl", time.Second, "lease TTL")
	flag.Uint64Var(&cfg.Seed, "seed", uint64(time.Now().UnixNano()), "seed of the fault schedule and the workers' choices")
	flag.StringVar(&faults, "faults", "kill,stop,blackhole,cut,latency", "holder faults to inject (network ones only on networked stores)")
	flag.StringVar(&client, "client-faults", "all", "client faults the workers inject (acqdeadline,reldeadline,smallpool,dopanic; all; none): what applications do to a lock themselves")
	flag.IntVar(&cfg.Lanes, "lanes", 0, "goroutines per worker running its loop on its one Locker (0: 2 with client faults, else 1)")
	flag.DurationVar(&cfg.FaultEvery, "fault-every", 2*time.Second, "mean interval between holder faults")
	flag.Float64Var(&cfg.LongFrac, "long-frac", 0.3, "share of holds lasting up to 2×TTL (the rest last up to 50 ms)")
	flag.BoolVar(&cfg.DBRestart, "db-restart", false, "also kill -9 and restart the store's server: MariaDB for the mysql strategies, PostgreSQL for the pg ones, the Redis, etcd and ZooKeeper of theirs (disrupts every other user of them)")
	flag.DurationVar(&cfg.DBRestartEvery, "db-restart-every", 30*time.Second, "interval between server restarts")
	flag.Float64Var(&cfg.ClockSkew, "clock-skew", 0, "client clock rate error: even workers' Lockers time leases with a clock running at 1−skew, odd ones at 1+skew (0.05: ±5 %)")
	flag.BoolVar(&cfg.Netns, "netns", false, "run the workers of networked strategies in network namespaces of their own (root, ip, nft); adds the partition fault to the default faults")
	flag.BoolVar(&cfg.NoFencing, "no-fencing", false, "positive control: the resource accepts every write; the run must detect violations")
	flag.DurationVar(&cfg.Control, "control", 20*time.Second, "after each strategy, a positive-control run (no fencing, SIGSTOP faults) this long; 0 for none")
	flag.StringVar(&cfg.MySQLDSN, "dsn", dsn, "MariaDB DSN for the resource and the mysql strategies ($DLOCK_MYSQL_DSN)")
	flag.StringVar(&cfg.StoreDSN, "store-dsn", "", "another MariaDB for the mysql strategies' locks (the resource stays on -dsn), e.g. one whose clock libfaketime skews: its clock is sampled through the run and the store's instants mapped by it")
	flag.BoolVar(&cfg.VersionSessions, "version-sessions", false, "convert the mysql session strategies' MEMORY session table to InnoDB and version it, for the server's record of their grants (a restart then keeps the table)")
	flag.StringVar(&cfg.PGDSN, "pg-dsn", pgDSN, "PostgreSQL DSN for the pg strategies, used only by those ($DLOCK_PG_DSN)")
	flag.StringVar(&cfg.Out, "out", "", "output directory (default torture-out/<time>)")
	flag.StringVar(&cfg.Tag, "tag", "cli", "tag in table names: torture_<tag><n>_*")
	var cluster string
	flag.StringVar(&cluster, "failover", "", "start a replicated store of this kind ("+strings.Join(torture.ClusterKinds(), ", ")+") under the output directory, run its strategies on it and fail it over every -failover-every")
	flag.DurationVar(&cfg.FailoverEvery, "failover-every", 20*time.Second, "interval between failovers")
	flag.Parse()
	faultsSet := false
	flag.Visit(func(f *flag.Flag) { faultsSet = faultsSet || f.Name == "faults" })
	if strategies != "" {
		cfg.Strategies = strings.Split(strategies, ",")
	}
	if faults != "" {
		cfg.Faults = strings.Split(faults, ",")
	}
	var err error
	if cfg.ClientFaults, err = torture.ParseClientFaults(client); err != nil {
		fmt.Fprintln(os.Stderr, "dlock-torture:", err)
		return 2
	}
	if cfg.Netns && !faultsSet {
		cfg.Faults = append(cfg.Faults, torture.FaultPartition)
	}
	if cfg.Out == "" {
		cfg.Out = "torture-out/" + time.Now().Format("20060102-150405")
	}
	cfg.Log = os.Stderr
	fmt.Fprintf(os.Stderr, "dlock-torture: seed %d, output in %s\n", cfg.Seed, cfg.Out)

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if cluster != "" {
		c, err := torture.StartCluster(ctx, cluster, filepath.Join(cfg.Out, "cluster"), os.Stderr)
		if err != nil {
			fmt.Fprintln(os.Stderr, "dlock-torture:", err)
			return 2
		}
		defer c.Close()
		cfg.Failover = c
		if strategies == "" {
			cfg.Strategies = c.Configure(&cfg)
		} else {
			c.Configure(&cfg)
		}
	}
	rep, err := torture.Run(ctx, cfg)
	if rep != nil && len(rep.Runs) > 0 {
		rep.Markdown(os.Stdout)
		if werr := rep.WriteFiles(cfg.Out); werr != nil {
			fmt.Fprintln(os.Stderr, "dlock-torture:", werr)
		}
	}
	switch {
	case errors.Is(err, context.Canceled):
		fmt.Fprintln(os.Stderr, "dlock-torture: interrupted")
		return 130
	case err != nil:
		fmt.Fprintln(os.Stderr, "dlock-torture:", err)
		return 2
	}
	return rep.ExitCode()
}

func names() []string {
	var s []string
	for _, a := range torture.Adapters {
		s = append(s, a.Name)
	}
	return s
}

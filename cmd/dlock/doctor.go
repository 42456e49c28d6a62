package main

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/dlock-dev/dlock/mysqllock"
	"github.com/dlock-dev/dlock/pglock"
	"github.com/go-zookeeper/zk"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/spf13/cobra"
)

// A finding is one thing about a store that makes it unsafe for locks (or,
// when info is set, worth knowing but harmless), with its consequence and
// its fix, on one line.
type finding struct {
	info bool
	text string
}

// doctorFunc checks a store. An error means the check could not run.
type doctorFunc func(ctx context.Context) ([]finding, error)

// maxClockSkew is the largest difference between the store server's clock
// and this host's that the doctor accepts (HTTP dates have 1 s steps).
const maxClockSkew = 2 * time.Second

func (a *app) doctorCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "doctor",
		Short: "Report store settings that make locks unsafe",
		Long: `doctor checks the store's settings and prints one line per finding: what
was found, what it breaks, and how to fix it.

  MySQL, MariaDB  commits that are not durable (innodb_flush_log_at_trx_commit,
                  sync_binlog), Galera with getlock or rowlock, and with
                  those a session table not yet MEMORY or too small (run
                  migrate)
  PostgreSQL      fsync or full_page_writes off, asynchronous standbys
  Redis           appendonly off or appendfsync not always (a restart or crash
                  forgets leases and fencing counters), an eviction policy
                  that can evict lock keys, replicas (a failover loses grants)
  etcd, ZooKeeper the server's clock far from this host's
  SQLite          not in WAL mode, the file on a network filesystem

Exit status: 0 when nothing unsafe was found (lines marked "info:" do not
count), 1 when something was, 70 when the store could not be checked.`,
		Example: `  dlock doctor --db redis://locks:6379/0`,
		Args:    cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			ctx := a.ctx
			s, err := a.openStore(ctx, true)
			if err != nil {
				return err
			}
			defer s.close()
			fs, err := bounded(s.guard, ctx, "the checks", s.doctor)
			if err != nil {
				return a.storeErr(s, err)
			}
			unsafe := 0
			for _, f := range fs {
				if f.info {
					fmt.Fprintf(a.stdout, "info: %s\n", f.text)
					continue
				}
				unsafe++
				fmt.Fprintf(a.stdout, "unsafe: %s\n", f.text)
			}
			if unsafe > 0 {
				return &exitError{code: 1}
			}
			fmt.Fprintf(a.stdout, "ok: nothing unsafe found in %s\n", s.name)
			return nil
		},
	}
}

// mysqlDoctor runs the strategy's own Check and compares the server's
// clock with this host's.
func mysqlDoctor(db *sql.DB, b interface {
	Check(context.Context) ([]mysqllock.Finding, error)
}) doctorFunc {
	return func(ctx context.Context) ([]finding, error) {
		var out []finding
		if b != nil {
			fs, err := b.Check(ctx)
			if err != nil {
				return nil, err
			}
			for _, f := range fs {
				out = append(out, finding{text: f.String()})
			}
		}
		sent := time.Now()
		var raw string
		if err := db.QueryRowContext(ctx, "SELECT DATE_FORMAT(UTC_TIMESTAMP(6), '%Y-%m-%dT%H:%i:%s.%fZ')").Scan(&raw); err != nil {
			return out, err
		}
		got := time.Now()
		server, err := time.Parse(time.RFC3339Nano, raw)
		if err != nil {
			return out, err
		}
		return append(out, clockFinding("the MySQL server", server, sent, got, time.Microsecond)...), nil
	}
}

// pgDoctor runs pglock.Check and compares the server's clock with this
// host's.
func pgDoctor(pool *pgxpool.Pool) doctorFunc {
	return func(ctx context.Context) ([]finding, error) {
		fs, err := pglock.Check(ctx, pool)
		if err != nil {
			return nil, err
		}
		out := make([]finding, len(fs))
		for i, f := range fs {
			out[i] = finding{info: f.Severity == pglock.SeverityInfo, text: f.Message}
		}
		var server time.Time
		sent := time.Now()
		if err := pool.QueryRow(ctx, "SELECT clock_timestamp()").Scan(&server); err != nil {
			return out, err
		}
		return append(out, clockFinding("the PostgreSQL server", server, sent, time.Now(), time.Microsecond)...), nil
	}
}

// redisDoctor reads INFO (and CONFIG where allowed) for the settings that
// decide whether leases and fencing counters survive a restart or a
// failover, and whether lock keys can be evicted. minReplicas is the
// store URL's min_replicas.
func redisDoctor(c *redis.Client, minReplicas int) doctorFunc {
	return func(ctx context.Context) ([]finding, error) {
		raw, err := c.Info(ctx, "persistence", "memory", "replication").Result()
		if err != nil {
			return nil, err
		}
		info := parseRedisInfo(raw)
		var out []finding
		if info["aof_enabled"] == "0" {
			out = append(out, finding{text: "appendonly=no: a restart of Redis forgets every lease and fencing counter " +
				"(a held lock comes back free, fences start again from 1); fix: CONFIG SET appendonly yes, appendfsync always, and the same in redis.conf"})
		} else if fsync, err := c.ConfigGet(ctx, "appendfsync").Result(); err != nil {
			out = append(out, finding{info: true, text: "appendfsync could not be read (CONFIG is not allowed): check that it is always"})
		} else if v := fsync["appendfsync"]; v != "always" {
			out = append(out, finding{text: "appendfsync=" + v + ": a crash of the server or its host loses the last grants " +
				"(up to a second with everysec): a held lock comes back free, a fence can repeat; fix: CONFIG SET appendfsync always, and in redis.conf"})
		}
		if policy := info["maxmemory_policy"]; info["maxmemory"] != "0" && policy != "" && policy != "noeviction" {
			out = append(out, finding{text: "maxmemory-policy=" + policy + " with maxmemory set: Redis can evict lock keys and fencing counters " +
				"when memory runs short (a held lock becomes free); fix: CONFIG SET maxmemory-policy noeviction, or a Redis of its own for locks"})
		}
		if info["role"] == "slave" {
			out = append(out, finding{text: "this server is a replica: lock writes fail or go to a copy that a failover may not keep; " +
				"fix: point --db at the primary"})
		} else {
			replicas, _ := strconv.Atoi(info["connected_slaves"])
			out = append(out, redisReplicationFindings(replicas, minReplicas)...)
		}
		return out, nil
	}
}

// redisReplicationFindings compares a primary's connected replicas with
// the replicas each grant waits for (min_replicas).
func redisReplicationFindings(replicas, minReplicas int) []finding {
	switch {
	case minReplicas > replicas:
		return []finding{{text: fmt.Sprintf("min_replicas=%d but connected_slaves=%d: every acquisition waits for replicas that are not there, "+
			"and fails; fix: attach the replicas, or lower min_replicas", minReplicas, replicas)}}
	case replicas > 0 && minReplicas == 0:
		return []finding{{text: fmt.Sprintf("connected_slaves=%d: replication is asynchronous, so a Sentinel failover "+
			"to a replica can lose recent grants (two holders, a repeated fence); fix: min_replicas=%d in the store URL "+
			"(each grant waits for the replicas to acknowledge it), or a Redis without failover for locks", replicas, replicas)}}
	case replicas > 0:
		return []finding{{info: true, text: fmt.Sprintf("each grant waits for %d of %d replicas (min_replicas): a failover keeps it "+
			"only if the replica promoted is one that acknowledged; Redis stays not strongly consistent (see docs/replication.md)", minReplicas, replicas)}}
	}
	return nil
}

func parseRedisInfo(raw string) map[string]string {
	m := map[string]string{}
	for _, line := range strings.Split(raw, "\n") {
		if k, v, ok := strings.Cut(strings.TrimSpace(line), ":"); ok {
			m[k] = v
		}
	}
	return m
}

// clockFinding compares a server's clock, read at server, with this host's
// between sent and got.
func clockFinding(what string, server, sent, got time.Time, resolution time.Duration) []finding {
	mid := sent.Add(got.Sub(sent) / 2)
	skew := server.Sub(mid)
	slack := maxClockSkew + got.Sub(sent)/2 + resolution
	if skew > -slack && skew < slack {
		return nil
	}
	dir := "ahead of"
	if skew < 0 {
		dir, skew = "behind", -skew
	}
	return []finding{{text: fmt.Sprintf("%s's clock is %s %s this host's: the lock times dlock list shows are off by that much, "+
		"and a clock this far off is usually not synchronised and may be stepped; fix: run NTP (chrony) on the server and on this host",
		what, skew.Round(time.Second), dir)}}
}

// etcdDoctor reads each endpoint's clock from the Date header of its
// /version page.
func etcdDoctor(endpoints []string, tls bool) doctorFunc {
	return func(ctx context.Context) ([]finding, error) {
		scheme := "http"
		if tls {
			scheme = "https"
		}
		var out []finding
		for _, ep := range endpoints {
			fs, err := httpDateSkew(ctx, "etcd "+ep, scheme+"://"+ep+"/version")
			if err != nil {
				out = append(out, finding{info: true, text: fmt.Sprintf("the clock of etcd %s could not be read: %v", ep, err)})
			}
			out = append(out, fs...)
		}
		return out, nil
	}
}

// httpDateSkew compares the Date header of a GET of url with this host's
// clock.
func httpDateSkew(ctx context.Context, what, url string) ([]finding, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	sent := time.Now()
	resp, err := http.DefaultClient.Do(req)
	got := time.Now()
	if err != nil {
		return nil, err
	}
	resp.Body.Close()
	server, err := http.ParseTime(resp.Header.Get("Date"))
	if err != nil {
		return nil, fmt.Errorf("no Date header: %w", err)
	}
	return clockFinding(what, server, sent, got, time.Second), nil
}

// zkDoctor reads the server's clock from the creation time of an
// ephemeral node.
func zkDoctor(c *zk.Conn) doctorFunc {
	return func(ctx context.Context) ([]finding, error) {
		var b [8]byte
		_, _ = rand.Read(b[:])
		path := "/dlock-doctor-" + hex.EncodeToString(b[:])
		sent := time.Now()
		p, err := c.Create(path, nil, zk.FlagEphemeral, zk.WorldACL(zk.PermAll))
		got := time.Now()
		if err != nil {
			return nil, fmt.Errorf("create %s: %w", path, err)
		}
		_, stat, err := c.Exists(p)
		_ = c.Delete(p, -1)
		if err == nil && stat == nil {
			err = errors.New("no node")
		}
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", p, err)
		}
		return clockFinding("the ZooKeeper server", time.UnixMilli(stat.Ctime), sent, got, time.Millisecond), nil
	}
}

// sqliteDoctor checks the journal mode and the filesystem of the store's
// file.
func sqliteDoctor(path string) doctorFunc {
	return func(ctx context.Context) ([]finding, error) {
		var out []finding
		if nfs := networkFS(filepath.Dir(path)); nfs != "" {
			out = append(out, finding{text: fmt.Sprintf("%s is on a network filesystem (%s): SQLite's file locking is not reliable there, "+
				"so two hosts can both take a lock; fix: a local disk for one host's locks, or a server store (--db mysql://…, postgres://…) for several", path, nfs)})
		}
		if _, err := os.Stat(path); errors.Is(err, fs.ErrNotExist) {
			return append(out, finding{info: true, text: path + " does not exist yet: dlock creates it at the first lock"}), nil
		}
		db, err := sql.Open("sqlite", "file:"+path+"?mode=ro")
		if err != nil {
			return nil, err
		}
		defer db.Close()
		var mode string
		if err := db.QueryRowContext(ctx, "PRAGMA journal_mode").Scan(&mode); err != nil {
			return nil, err
		}
		if !strings.EqualFold(mode, "wal") {
			out = append(out, finding{text: "journal_mode=" + mode + ": dlock's SQLite store runs in WAL mode, which this file's filesystem refused; " +
				"waiters and holders then block each other; fix: put the file on a local filesystem that supports WAL"})
		}
		return out, nil
	}
}

// Package dlock provides distributed locks on the database a team already
// runs: mutual exclusion per key among processes, with owner tokens, leases
// timed by the store's clock, automatic renewal, loss notification, fencing
// tokens and counted reentrancy.
//
// A [Locker] wraps one [Backend] and hands out [Lock]s:
//
//	locker := dlock.New(backend, nil)
//	defer locker.Close(context.Background())
//	err := locker.Do(ctx, "invoice:42", func(ctx context.Context) error {
//		// ctx is cancelled if the lock is lost.
//		return nil
//	})
//
// Backends, each in a module of its own so that a program downloads only the
// client library it uses:
//
//   - github.com/dlock-dev/dlock/mysqllock: MySQL and MariaDB. The lease
//     strategy (a row per key, timed by the server's clock; works through
//     pools, proxies and Galera), GetLock (named locks held by a pinned
//     session) and RowLock (SELECT … FOR UPDATE in an open transaction).
//   - github.com/dlock-dev/dlock/pglock: PostgreSQL. The lease strategy and
//     Advisory (advisory locks held by a pinned session).
//   - github.com/dlock-dev/dlock/redislock: Redis, Redis Cluster, and
//     Redlock over independent servers.
//   - github.com/dlock-dev/dlock/etcdlock: etcd leases and revisions.
//   - github.com/dlock-dev/dlock/zklock: ZooKeeper ephemeral sequential
//     nodes.
//   - github.com/dlock-dev/dlock/sqlitelock: a file shared by the processes
//     of one host (the CLI's embedded store).
//   - github.com/dlock-dev/dlock/memlock: in memory, for examples and tests.
//
// Every backend passes the conformance suite in
// github.com/dlock-dev/dlock/locktest against its real server.
//
// An [Observer] (Options.Observer) is told of acquisitions, releases,
// renewals and losses; github.com/dlock-dev/dlock/dlockotel records them as
// OpenTelemetry metrics and spans.
//
// Holding a *Lock does not mean holding the lock: a lease can be lost (the
// process paused, the store unreachable). Watch [Lock.Done], use the context
// from [Lock.Context] or [Locker.Do], and pass [Lock.Fence] to the resources
// you guard so they can refuse a stale holder (package
// github.com/dlock-dev/dlock/fence does it for SQL databases).
package dlock

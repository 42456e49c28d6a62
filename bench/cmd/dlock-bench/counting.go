package main

import (
	"context"
	"database/sql/driver"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
)

// countingConnector wraps a driver.Connector and counts the statements its
// connections send (Exec and Query calls the driver runs, and prepares), so
// that the many-locks run can report statements per renewal period for one
// pool, whatever else talks to the server.
type countingConnector struct {
	driver.Connector
	n *atomic.Int64
}

func (c countingConnector) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := c.Connector.Connect(ctx)
	if err != nil {
		return nil, err
	}
	return &countingConn{conn, c.n}, nil
}

// countingConn forwards every optional interface the MySQL driver's
// connection implements, so that database/sql behaves exactly as without it.
type countingConn struct {
	driver.Conn
	n *atomic.Int64
}

func (c *countingConn) count(err error) {
	if err != driver.ErrSkip {
		c.n.Add(1)
	}
}

func (c *countingConn) ExecContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Result, error) {
	r, err := c.Conn.(driver.ExecerContext).ExecContext(ctx, q, args)
	c.count(err)
	return r, err
}

func (c *countingConn) QueryContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Rows, error) {
	r, err := c.Conn.(driver.QueryerContext).QueryContext(ctx, q, args)
	c.count(err)
	return r, err
}

func (c *countingConn) PrepareContext(ctx context.Context, q string) (driver.Stmt, error) {
	c.n.Add(1)
	return c.Conn.(driver.ConnPrepareContext).PrepareContext(ctx, q)
}

func (c *countingConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	c.n.Add(1)
	return c.Conn.(driver.ConnBeginTx).BeginTx(ctx, opts)
}

func (c *countingConn) Ping(ctx context.Context) error {
	c.n.Add(1)
	return c.Conn.(driver.Pinger).Ping(ctx)
}

func (c *countingConn) ResetSession(ctx context.Context) error {
	return c.Conn.(driver.SessionResetter).ResetSession(ctx)
}

func (c *countingConn) IsValid() bool { return c.Conn.(driver.Validator).IsValid() }

func (c *countingConn) CheckNamedValue(v *driver.NamedValue) error {
	return c.Conn.(driver.NamedValueChecker).CheckNamedValue(v)
}

// pgCounter is a pgx tracer that counts the statements (Query, QueryRow and
// Exec calls, and each statement of a pipeline) a pool's connections send.
// Pings the pool sends on its own are below the tracer and not counted.
type pgCounter struct{ n *atomic.Int64 }

func (t pgCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	t.n.Add(1)
	return ctx
}

func (pgCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// A pipeline (pgx.Batch: the lease strategy's renewals) counts each of its
// statements: pgx does not trace them as queries.
func (pgCounter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (t pgCounter) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) { t.n.Add(1) }

func (pgCounter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// redisCounter is a go-redis hook that counts the commands a client sends
// and its round trips: a pipeline is one round trip however many commands
// it carries.
type redisCounter struct{ cmds, trips *atomic.Int64 }

func (redisCounter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h redisCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.cmds.Add(1)
		h.trips.Add(1)
		return next(ctx, cmd)
	}
}

func (h redisCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.cmds.Add(int64(len(cmds)))
		h.trips.Add(1)
		return next(ctx, cmds)
	}
}

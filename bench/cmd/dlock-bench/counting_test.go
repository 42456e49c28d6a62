package main

import (
	"context"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// TestPGCounterCountsPipelines: every statement a pool sends counts, those
// of a pipeline (pgx.Batch, how the lease strategy renews) included.
func TestPGCounterCountsPipelines(t *testing.T) {
	dsn := os.Getenv("DLOCK_PG_DSN")
	if dsn == "" {
		dsn = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	}
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	n := new(atomic.Int64)
	cfg.ConnConfig.Tracer = pgCounter{n}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	p, err := pgxpool.NewWithConfig(ctx, cfg)
	if err == nil {
		err = p.Ping(ctx)
	}
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("no PostgreSQL at %s: %v", dsn, err)
		}
		t.Skipf("no PostgreSQL at %s: %v", dsn, err)
	}
	defer p.Close()
	if _, err := p.Exec(ctx, "SELECT 1"); err != nil {
		t.Fatal(err)
	}
	var b pgx.Batch
	b.Queue("SELECT 1")
	b.Queue("SELECT 2")
	if err := p.SendBatch(ctx, &b).Close(); err != nil {
		t.Fatal(err)
	}
	if got := n.Load(); got != 3 {
		t.Errorf("counted %d statements, want 3 (one Exec, a pipeline of two)", got)
	}
}

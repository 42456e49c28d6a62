package pglock_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/pglock"
	"github.com/jackc/pgx/v5/pgxpool"
)

// TestFenceDurableAfterCrash runs a server whose default is
// synchronous_commit=off (commits acknowledged before their WAL is flushed),
// crashes it between grants (SIGKILL of a backend: the postmaster ends every
// session and recovers from the WAL on disk), and checks that no fencing
// token is ever handed out twice: each grant must be a durable commit
// whatever the server's default. Grants alternate between the modes, and
// each crash comes right after a shared grant, before anything else commits.
func TestFenceDurableAfterCrash(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a PostgreSQL server")
	}
	srv := startOwnServer(t, "synchronous_commit = off\nwal_writer_delay = 10000ms\nwal_writer_flush_after = 0\n")
	pool := srv.pool(t, 0)
	for name, newBackend := range map[string]func(*pgxpool.Pool, *pglock.Options) (dlock.Backend, error){
		"lease":    func(p *pgxpool.Pool, o *pglock.Options) (dlock.Backend, error) { return pglock.New(p, o) },
		"advisory": func(p *pgxpool.Pool, o *pglock.Options) (dlock.Backend, error) { return pglock.NewAdvisory(p, o) },
	} {
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			table := "durable_" + name
			b, err := newBackend(pool, &pglock.Options{Table: table})
			if err != nil {
				t.Fatal(err)
			}
			defer b.(interface{ Close() error }).Close()
			// The pool's connections may have died in an earlier crash.
			for try := 0; ; try++ {
				if err = b.(interface{ Migrate(context.Context) error }).Migrate(ctx); err == nil || try == 20 {
					break
				}
				time.Sleep(100 * time.Millisecond)
			}
			if err != nil {
				t.Fatal(err)
			}
			l := dlock.New(b, nil)
			defer l.Close(ctx)
			seen := map[uint64]int{}
			for round := range 4 {
				var pending *dlock.Lock
				for i := range 5 {
					var lk *dlock.Lock
					for try := 0; ; try++ { // the first calls after a crash may meet dead connections
						actx, acancel := context.WithTimeout(ctx, 20*time.Second)
						opts := []dlock.AcquireOption{dlock.WithTTL(5 * time.Second)}
						if i == 4 { // a release that meets a dead connection leaves it to its TTL
							opts[0] = dlock.WithTTL(time.Second)
						}
						if i%2 == 0 { // shared grants run other statements
							opts = append(opts, dlock.Shared())
						}
						lk, err = l.Acquire(actx, "k", opts...)
						acancel()
						if err == nil || try == 20 || errors.Is(err, dlock.ErrNotAcquired) {
							break
						}
						time.Sleep(100 * time.Millisecond)
					}
					if err != nil {
						t.Fatalf("round %d grant %d: %v", round, i, err)
					}
					f := lk.Fence()
					if r, dup := seen[f]; dup {
						t.Fatalf("fence %d handed out twice: in round %d and again in round %d (after a crash): a grant was not durable", f, r, round)
					}
					seen[f] = round
					if i == 4 { // the crash comes right after this grant
						pending = lk
						break
					}
					if err := lk.Release(ctx); err != nil {
						t.Fatalf("release: %v", err)
					}
				}
				srv.crashPooled(ctx, pool)
				for try := 0; try < 20; try++ { // the first calls after a crash may meet dead connections
					if err := pending.Release(ctx); err == nil || errors.Is(err, dlock.ErrNotHeld) {
						break // (a grant lost with the crash is not held)
					}
					time.Sleep(100 * time.Millisecond)
				}
			}
			t.Logf("%d grants, fences distinct across 4 crashes", len(seen))
		})
	}
}

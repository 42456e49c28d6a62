package dlock_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/memlock"
)

// slowStore is a store 2 ms away. An acquisition of a key under "late/" is
// a statement sent already: it lands 10 ms later whatever its caller does,
// and closes landed.
type slowStore struct {
	*memlock.Backend
	landed chan struct{}
}

func (s slowStore) Acquire(ctx context.Context, req dlock.Request) (dlock.Result, error) {
	if strings.HasPrefix(req.Key, "late/") {
		time.Sleep(10 * time.Millisecond)
		defer close(s.landed)
		return s.Backend.Acquire(context.Background(), req)
	}
	select {
	case <-time.After(2 * time.Millisecond):
	case <-ctx.Done():
		return dlock.Result{}, ctx.Err()
	}
	return s.Backend.Acquire(context.Background(), req)
}

func (s slowStore) Release(ctx context.Context, key string, tok dlock.Token) error {
	select {
	case <-time.After(2 * time.Millisecond):
	case <-ctx.Done():
		return ctx.Err()
	}
	return s.Backend.Release(context.Background(), key, tok)
}

// TestLateGrantReleasedAheadOfABacklog: a grant that lands after its caller
// left is released within moments, even behind a backlog of acquisitions
// of unknown outcome that a burst of cut calls left to resolve.
func TestLateGrantReleasedAheadOfABacklog(t *testing.T) {
	ctx := context.Background()
	mem := memlock.New()
	store := slowStore{mem, make(chan struct{})}
	l := dlock.New(store, nil)
	defer l.Close(ctx)
	other := dlock.New(mem, nil)
	defer other.Close(ctx)
	hold, err := other.Acquire(ctx, "busy")
	if err != nil {
		t.Fatal(err)
	}
	defer hold.Release(ctx)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				actx, cancel := context.WithTimeout(ctx, time.Millisecond)
				_, _ = l.Acquire(actx, "busy")
				cancel()
			}
		})
	}
	time.Sleep(2 * time.Second)
	close(stop)
	wg.Wait()
	actx, cancel := context.WithTimeout(ctx, 2*time.Millisecond)
	_, err = l.Acquire(actx, "late/k")
	cancel()
	if err == nil {
		t.Fatal("the late acquisition returned in time")
	}
	<-store.landed
	landed := time.Now()
	for {
		ls, err := mem.List(ctx, "late/")
		if err != nil {
			t.Fatal(err)
		}
		if len(ls) == 0 {
			return
		}
		if time.Since(landed) > 2*time.Second {
			t.Fatalf("rule: a grant that lands after its caller left is released at once; it still holds the key %s later", time.Since(landed).Round(time.Millisecond))
		}
		time.Sleep(time.Millisecond)
	}
}

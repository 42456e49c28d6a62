package torture

import (
	"context"
	"testing"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/memlock"
)

// onlyBackend hides every optional interface of a backend.
type onlyBackend struct{ dlock.Backend }

func TestTimedBackendKeepsWaiter(t *testing.T) {
	mem := memlock.New()
	if _, ok := dlock.Backend(mem).(dlock.Waiter); !ok {
		t.Skip("memlock is not a Waiter: nothing to keep")
	}
	tb := newTimedBackend(mem, nil, 1<<62, nil)
	w, ok := tb.(dlock.Waiter)
	if !ok {
		t.Fatal("the timing wrapper hid the backend's Waiter: the Locker would poll")
	}
	res, err := w.AcquireWait(context.Background(), dlock.Request{Key: "k", Token: dlock.NewToken(), TTL: dlock.MinTTL})
	if err != nil || !res.Acquired {
		t.Fatalf("AcquireWait through the wrapper: %+v %v", res, err)
	}
	if _, ok := newTimedBackend(onlyBackend{mem}, nil, 1<<62, nil).(dlock.Waiter); ok {
		t.Error("a backend without a Waiter got one from the wrapper")
	}
}

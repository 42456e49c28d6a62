package etcdlock_test

import (
	"errors"
	"math"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
)

// TestTTLBeyondEtcdsLimitIsInvalid: a TTL longer than etcd's largest lease
// (9e9 s) is bad input: ErrInvalidOption at once, not a store failure
// reported as "no answer within 1s" after seconds of retries.
func TestTTLBeyondEtcdsLimitIsInvalid(t *testing.T) {
	l := locktest.NewLocker(t, newBackend(t, endpoints(t)))
	start := time.Now()
	_, err := l.TryAcquire(ctxT(t, 20*time.Second), locktest.UniqueKey(t.Name()), dlock.WithTTL(math.MaxInt64))
	if !errors.Is(err, dlock.ErrInvalidOption) {
		t.Errorf("TryAcquire with ttl %s: %v (after %s), want ErrInvalidOption", time.Duration(math.MaxInt64), err, time.Since(start).Round(time.Millisecond))
	}
}

package etcdlock_test

import (
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
)

func TestAdvConcurrentFirstLimitsNeverCoexist(t *testing.T) {
	eps := endpoints(t)
	bs := make([]dlock.Backend, 6)
	for i := range bs {
		bs[i] = newBackend(t, eps)
	}
	advConcurrentFirstLimits(t, bs)
}

func TestAdvWriterGivesUp(t *testing.T) {
	eps := endpoints(t)
	advWriterGivesUp(t, newBackend(t, eps), newBackend(t, eps), newBackend(t, eps))
}

func TestAdvCrashedReader(t *testing.T) {
	eps := endpoints(t)
	advCrashedReader(t, newBackend(t, eps), newBackend(t, eps))
}

func TestAdvBusyMix(t *testing.T) {
	eps := endpoints(t)
	advBusyMix(t, newBackend(t, eps), newBackend(t, eps), true)
}

func TestAdvWriterWaitsLong(t *testing.T) {
	eps := endpoints(t)
	advWriterWaitsLong(t, newBackend(t, eps), newBackend(t, eps), newBackend(t, eps))
}

func TestAdvWriterWokenByLastReader(t *testing.T) {
	eps := endpoints(t)
	advWriterWokenByLastReader(t, newBackend(t, eps), newBackend(t, eps), 300*time.Millisecond)
}

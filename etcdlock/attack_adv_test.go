package etcdlock_test

import (
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
)

func TestAdvConcurrentFirstLimitsNeverCoexist(t *testing.T) {
	eps := endpoints(t)
	bs := make([]dlock.Backend, 6)
	for i := range bs {
		bs[i] = newBackend(t, eps)
	}
	locktest.LimitsAgreeUnderRace(t, bs)
}

func TestAdvWriterGivesUp(t *testing.T) {
	eps := endpoints(t)
	locktest.WriterThatGivesUp(t, newBackend(t, eps), newBackend(t, eps), newBackend(t, eps))
}

func TestAdvCrashedReader(t *testing.T) {
	eps := endpoints(t)
	locktest.CrashedReader(t, newBackend(t, eps), newBackend(t, eps))
}

func TestAdvBusyMix(t *testing.T) {
	eps := endpoints(t)
	locktest.BusyMix(t, newBackend(t, eps), newBackend(t, eps), true)
}

func TestAdvWriterWaitsLong(t *testing.T) {
	eps := endpoints(t)
	locktest.WriterWaitsLong(t, newBackend(t, eps), newBackend(t, eps), newBackend(t, eps))
}

func TestAdvWriterWokenByLastReader(t *testing.T) {
	eps := endpoints(t)
	locktest.WriterWokenByLastReader(t, newBackend(t, eps), newBackend(t, eps), 300*time.Millisecond)
}

package memlock_test

import (
	"testing"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/memlock"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// shared is one in-memory store that every "client" in the suite talks to.
func TestConformance(t *testing.T) {
	store := memlock.New()
	locktest.Run(t, func(*testing.T) dlock.Backend { return store }, locktest.InProcess())
}

package pglock_test

import (
	"testing"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/pglock"
)

func TestStrategiesRefuseEachOthersKeys(t *testing.T) {
	needServer(t)
	locktest.OneStrategyPerKey(t, map[string]func(t *testing.T) dlock.Backend{
		"lease":    func(t *testing.T) dlock.Backend { return newLease(t, nil) },
		"advisory": func(t *testing.T) dlock.Backend { return newAdvisory(t, nil) },
	}, pglock.ErrOtherStrategy)
}

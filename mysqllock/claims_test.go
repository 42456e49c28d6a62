package mysqllock_test

import (
	"testing"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/mysqllock"
)

func TestStrategiesRefuseEachOthersKeys(t *testing.T) {
	needServer(t)
	locktest.OneStrategyPerKey(t, map[string]func(t *testing.T) dlock.Backend{
		"lease":   func(t *testing.T) dlock.Backend { return newBackend(t, "") },
		"getlock": func(t *testing.T) dlock.Backend { return newGetLock(t, "") },
		"rowlock": func(t *testing.T) dlock.Backend { return newRowLock(t, "") },
	}, mysqllock.ErrOtherStrategy)
}

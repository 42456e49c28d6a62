package mysqllock_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/mysqllock"
)

func TestAdvConcurrentFirstLimitsNeverCoexist(t *testing.T) {
	bs := make([]dlock.Backend, 6)
	for i := range bs {
		bs[i] = newBackend(t, "")
	}
	locktest.LimitsAgreeUnderRace(t, bs)
}

func TestAdvWriterGivesUp(t *testing.T) {
	locktest.WriterThatGivesUp(t, newBackend(t, ""), newBackend(t, ""), newBackend(t, ""))
}

func TestAdvCrashedReader(t *testing.T) {
	locktest.CrashedReader(t, newBackend(t, ""), newBackend(t, ""))
}

// Tiny pools: SetMaxOpenConns(1) (without doorbells) and (2).
func TestAdvBusyMixTinyPools(t *testing.T) {
	for _, n := range []int{1, 2} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			newBackend(t, "") // migrated
			mk := func() dlock.Backend {
				db := open(t, "")
				db.SetMaxOpenConns(n)
				// A pool of 1 cannot spare a doorbell session (New says so).
				b, err := mysqllock.New(db, &mysqllock.Options{Table: testTable, NoDoorbell: n == 1})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { b.Close() })
				return b
			}
			locktest.BusyMix(t, mk(), mk(), true)
		})
	}
}

func TestAdvWriterWaitsLong(t *testing.T) {
	locktest.WriterWaitsLong(t, newBackend(t, ""), newBackend(t, ""), newBackend(t, ""))
}

func TestAdvWriterWokenByLastReader(t *testing.T) {
	locktest.WriterWokenByLastReader(t, newBackend(t, ""), newBackend(t, ""), 300*time.Millisecond)
}

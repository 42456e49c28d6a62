package redislock

import (
	"testing"
	"time"
)

// A holder whose lease has less than a millisecond left (PTTL 0) is not a
// holder of unknown lease: a waiter must look again within a millisecond or
// two, not after unknownLeaseWait.
func TestParseHolderLeaseEndingNow(t *testing.T) {
	now := time.Now()
	for _, tc := range []struct {
		pttl     int64
		min, max time.Duration
	}{
		{1500, 1500 * time.Millisecond, 1500 * time.Millisecond},
		{0, 1, time.Millisecond},
		{-1, 0, 0}, // no expiry: unknown
	} {
		_, got := parseHolder("k", []any{tc.pttl, "", "", "", "", ""}, now)
		if got < tc.min || got > tc.max {
			t.Errorf("rule: PTTL %d ms is a remaining lease in [%s, %s]; got %s", tc.pttl, tc.min, tc.max, got)
		}
	}
}

package redislock

import (
	"strings"
	"testing"

	"github.com/dlock-dev/dlock"
)

// TestHandedToReadsOnlyHandoffs: handedTo finds the token of a handoff's
// announcement and refuses anything else without panicking.
func TestHandedToReadsOnlyHandoffs(t *testing.T) {
	tok := dlock.NewToken()
	hexTok := tok.String()
	msg := "handed:3 17 1 5:30000" + "32:" + hexTok + "0:1:71:0" + "16:1732000000000000" + "1:01:0"
	if got, ok := handedTo(msg); !ok || got != tok {
		t.Fatalf("handedTo(%q) = %v, %v; want %v", msg, got, ok, tok)
	}
	if h, ok := parseHandoff(msg); !ok || h.attempt != 3 || h.fence != 7 {
		t.Errorf("parseHandoff = %+v, %v; want attempt 3, fence 7", h, ok)
	}
	for _, bad := range []string{
		"released 17 0 ",
		"handed:3 17 2 " + msg[len("handed:3 17 1 "):],
		"handed:3 17 1 5:30000" + "64:" + strings.Repeat("ab", 32),
		"handed:3 17 1 5:30000" + "32:" + strings.Repeat("zz", 16),
		"handed:3 17 1 9:30000",
		"handed:3 17 1 -1:",
		"handed:",
		"",
	} {
		if _, ok := handedTo(bad); ok {
			t.Errorf("handedTo(%q) accepted it", bad)
		}
	}
}

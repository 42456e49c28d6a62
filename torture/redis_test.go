package torture

import (
	"strings"
	"testing"
)

func TestParseMonitorLine(t *testing.T) {
	ts, src, args, err := parseMonitorLine(`1763900000.000123 [0 lua] "hset" "p:{a\"b\\c\x01}" "metadata" ""`)
	if err != nil || ts != 1763900000000123 || src != "lua" || len(args) != 4 || args[1] != "p:{a\"b\\c\x01}" || args[3] != "" {
		t.Fatalf("got %d %q %q %v", ts, src, args, err)
	}
	if _, src, _, err := parseMonitorLine(`1763900000.5 [0 127.0.0.1:5555] "PING"`); err == nil {
		t.Errorf("a time without 6 digits parsed (source %q)", src)
	}
	if _, _, _, err := parseMonitorLine(`1763900000.000001 [0 127.0.0.1:5555] "PING`); err == nil {
		t.Error("an unterminated argument parsed")
	}
}

func TestRedisHistory(t *testing.T) {
	const tok1, tok2 = "000102030405060708090a0b0c0d0e0f", "f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff"
	feed := strings.Split(`OK
1000.000100 [0 127.0.0.1:1] "EVALSHA" "x" "2" "p:{k%7B1}" "p:{k%7B1}:fence"
1000.000101 [0 lua] "hmget" "p:{k%7B1}" "token"
1000.000102 [0 lua] "incr" "p:{k%7B1}:fence"
1000.000103 [0 lua] "hset" "p:{k%7B1}" "token" "`+tok1+`" "owner" "" "fence" "7" "metadata" "" "acquired_us" "1000000101"
1000.000104 [0 lua] "pexpire" "p:{k%7B1}" "1000"
1000.399900 [0 127.0.0.1:1] "evalsha" "y" "1" "p:{k%7B1}"
1000.400000 [0 lua] "hget" "p:{k%7B1}" "token"
1000.400001 [0 lua] "pexpire" "p:{k%7B1}" "1000"
1000.450000 [0 127.0.0.1:2] "PING"
1000.450100 [0 lua] "pexpire" "p:{k%7B1}" "1000"
1000.500000 [0 lua] "del" "p:{k%7B1}"
1000.500001 [0 lua] "spublish" "p:{k%7B1}:released" "released"
1000.600000 [0 lua] "del" "p:{k%7B1}"
1000.700000 [0 lua] "hset" "q:{other}" "token" "`+tok2+`" "fence" "1" "acquired_us" "1000700000"
1000.800000 [0 lua] "hset" "p:{k%7B1}" "token" "`+tok2+`" "owner" "" "fence" "8" "metadata" "" "acquired_us" "1000800000"
1000.800001 [0 lua] "pexpire" "p:{k%7B1}" "1000"`, "\n")
	got, err := redisHistory(feed, "p:")
	if err != nil {
		t.Fatal(err)
	}
	want := []LeaseEvent{
		{Key: "k{1", Fence: 7, AtUs: 1000000101, ExpUs: 1001001000},
		// The script's PEXPIRE counts from the call (Redis 7.0's script
		// time snapshot), not from its own line a millisecond later.
		{Key: "k{1", Fence: 7, AtUs: 1000399900, ExpUs: 1001400000},
		// No script call before it (another client's command between):
		// its own line's time.
		{Key: "k{1", Fence: 7, AtUs: 1000450100, ExpUs: 1001451000},
		{Key: "k{1", Fence: 7, AtUs: 1000500000, ExpUs: 1001451000, Release: true},
		{Key: "k{1", Fence: 8, AtUs: 1000800000, ExpUs: 1001801000},
	}
	if len(got) != len(want) {
		t.Fatalf("got %d events, want %d: %+v", len(got), len(want), got)
	}
	for i, w := range want {
		g := got[i]
		if g.Key != w.Key || g.Fence != w.Fence || g.AtUs != w.AtUs || g.ExpUs != w.ExpUs || g.Release != w.Release {
			t.Errorf("event %d: got %+v, want %+v", i, g, w)
		}
	}
	if got[0].Token[1] != 1 || got[4].Token[0] != 0xf0 || got[3].Token != got[0].Token {
		t.Errorf("tokens: %x %x %x", got[0].Token, got[3].Token, got[4].Token)
	}
	// A grant whose PEXPIRE the feed lacks is an error, not a lease without end.
	if _, err := redisHistory(feed[:5], "p:"); err == nil {
		t.Error("a grant without PEXPIRE gave no error")
	}
}

// A restart of the server (the feed's RESTART line) ends every live lease at
// the kill, as lost: a Redis without persistence forgets them. A lease that
// expired before the kill ended then (the long run's first restart run
// reported such a lease as revived).
func TestRedisHistoryRestart(t *testing.T) {
	const tok = "000102030405060708090a0b0c0d0e0f"
	feed := strings.Split(`1000.000103 [0 lua] "hset" "p:{a}" "token" "`+tok+`" "fence" "7" "acquired_us" "1000000101"
1000.000104 [0 lua] "pexpire" "p:{a}" "1000"
1000.100000 [0 lua] "hset" "p:{b}" "token" "`+tok+`" "fence" "3" "acquired_us" "1000100000"
1000.100001 [0 lua] "pexpire" "p:{b}" "1000"
1000.200000 [0 lua] "del" "p:{b}"
1000.200100 [0 lua] "hset" "p:{c}" "token" "`+tok+`" "fence" "4" "acquired_us" "1000200100"
1000.200101 [0 lua] "pexpire" "p:{c}" "50"
RESTART 1000300000
1000.400000 [0 lua] "pexpire" "p:{a}" "1000"
1000.500000 [0 lua] "del" "p:{a}"
1000.600000 [0 lua] "hset" "p:{a}" "token" "`+tok+`" "fence" "1000600000" "acquired_us" "1000600000"
1000.600001 [0 lua] "pexpire" "p:{a}" "1000"`, "\n")
	got, err := redisHistory(feed, "p:")
	if err != nil {
		t.Fatal(err)
	}
	want := []LeaseEvent{
		{Key: "a", Fence: 7, AtUs: 1000000101, ExpUs: 1001001000},
		{Key: "b", Fence: 3, AtUs: 1000100000, ExpUs: 1001101000},
		{Key: "b", Fence: 3, AtUs: 1000200000, ExpUs: 1001101000, Release: true},
		{Key: "c", Fence: 4, AtUs: 1000200100, ExpUs: 1000251000}, // expired before the kill: no loss
		{Key: "a", Fence: 7, AtUs: 1000300000, ExpUs: 1001001000, Release: true, Lost: true},
		{Key: "a", Fence: 1000600000, AtUs: 1000600000, ExpUs: 1001601000},
	}
	if len(got) != len(want) {
		t.Fatalf("got %d events, want %d: %+v", len(got), len(want), got)
	}
	for i, w := range want {
		g := got[i]
		if g.Key != w.Key || g.Fence != w.Fence || g.AtUs != w.AtUs || g.ExpUs != w.ExpUs || g.Release != w.Release || g.Lost != w.Lost {
			t.Errorf("event %d: got %+v, want %+v", i, g, w)
		}
	}
	if _, err := redisHistory([]string{"RESTART x"}, "p:"); err == nil {
		t.Error("a bad RESTART line gave no error")
	}
}

package dlock

import (
	"errors"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

// Fuzz targets for the validation of keys, owners and metadata. CI runs each
// for a bounded time:
//
//	go test -run '^$' -fuzz '^FuzzValidateKey$' -fuzztime 10s .

func FuzzValidateKey(f *testing.F) {
	for _, s := range []string{"", "k", "cron:nightly-report", "a\x00b", "\xff", "é", strings.Repeat("x", MaxKeyLen),
		strings.Repeat("x", MaxKeyLen+1), strings.Repeat("é", 128), "line\nbreak", "%q\"'`"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, key string) {
		err := ValidateKey(key)
		valid := len(key) >= 1 && len(key) <= MaxKeyLen && utf8.ValidString(key) && !strings.Contains(key, "\x00")
		switch {
		case valid && err != nil:
			t.Fatalf("ValidateKey(%q) = %v, want nil", key, err)
		case !valid && !errors.Is(err, ErrInvalidKey):
			t.Fatalf("ValidateKey(%q) = %v, want ErrInvalidKey", key, err)
		case err != nil && strings.ContainsAny(err.Error(), "\n\r"):
			t.Fatalf("ValidateKey(%q): the error is not one line: %q", key, err)
		}
	})
}

// FuzzAcquireOptions checks the validation of an acquisition's key, owner,
// metadata and TTL before any I/O.
func FuzzAcquireOptions(f *testing.F) {
	f.Add("k", "", "host=a pid=1", int64(DefaultTTL))
	f.Add("k", "alice", "", int64(MinTTL))
	f.Add("k", "a\x00", "m", int64(time.Second))
	f.Add("k", strings.Repeat("o", MaxOwnerLen+1), "m", int64(time.Minute))
	f.Add("k", "o", strings.Repeat("m", MaxMetadataLen+1), int64(time.Minute))
	f.Add("k", "\xfe", "\xff", int64(10*time.Millisecond))
	f.Add("", "o", "m", int64(-1))
	f.Fuzz(func(t *testing.T, key, owner, meta string, ttl int64) {
		l := &Locker{ttl: DefaultTTL, meta: "m"}
		_, err := l.config(key, []AcquireOption{WithOwner(owner), WithMetadata(meta), WithTTL(time.Duration(ttl))})
		text := func(s string, max int) bool {
			return len(s) <= max && utf8.ValidString(s) && !strings.Contains(s, "\x00")
		}
		keyOK := ValidateKey(key) == nil
		d := time.Duration(ttl)
		optsOK := d >= MinTTL && 2*l.marginFor(d) < d && text(owner, MaxOwnerLen) && text(meta, MaxMetadataLen)
		switch {
		case keyOK && optsOK && err != nil:
			t.Fatalf("config(%q, owner %q, metadata %q, ttl %s) = %v, want nil", key, owner, meta, d, err)
		case !keyOK && !errors.Is(err, ErrInvalidKey):
			t.Fatalf("config(%q, …) = %v, want ErrInvalidKey", key, err)
		case keyOK && !optsOK && !errors.Is(err, ErrInvalidOption):
			t.Fatalf("config(%q, owner %q, metadata %q, ttl %s) = %v, want ErrInvalidOption", key, owner, meta, d, err)
		case err != nil && strings.ContainsAny(err.Error(), "\n\r"):
			t.Fatalf("the error is not one line: %q", err)
		}
	})
}

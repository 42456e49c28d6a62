// Package keylist builds the answers of dlock.KeyLister for stores that keep
// a row per key after release and read the key's holders separately.
package keylist

import (
	"time"

	"github.com/dlock-dev/dlock"
)

// Row is what a store's row says of a key.
type Row struct {
	// Last describes the row's last holder; its Key is the key's.
	Last dlock.LockInfo
	// Held reports that the row's lease (or its holders') has not ended.
	Held bool
	// LastKnown reports that Last was the key's last holder (not an older
	// one that the row kept while holders kept elsewhere came after it).
	LastKnown bool
	// Expired reports that the last lease ran out rather than being
	// released.
	Expired bool
	// Ended is how long ago (negative) the last lease ended, by the store's
	// clock, unless EndUnknown.
	Ended      time.Duration
	EndUnknown bool
}

// Info is row's KeyInfo, without holders, read at the local time now. Its
// Fence is Last.Fence, the row's counter.
func (r Row) Info(now time.Time) dlock.KeyInfo {
	k := dlock.KeyInfo{Key: r.Last.Key, Fence: r.Last.Fence}
	if !r.Held {
		k.Expired = r.Expired
		if !r.EndUnknown {
			k.FreedAt = now.Add(r.Ended)
		}
		if r.LastKnown {
			last := r.Last
			k.Last = &last
		}
	}
	return k
}

// MergeHolders fills in the Holders of keys from holders, both ordered by
// key, and returns keys. A key that has holders is held: its Last, FreedAt
// and Expired are cleared, and its Fence is at least theirs. Holders of keys
// not in keys (granted after the keys were read) are left out.
func MergeHolders(keys []dlock.KeyInfo, holders []dlock.LockInfo) []dlock.KeyInfo {
	i := 0
	for _, h := range holders {
		for i < len(keys) && keys[i].Key < h.Key {
			i++
		}
		if i == len(keys) || keys[i].Key != h.Key {
			continue
		}
		k := &keys[i]
		k.Holders = append(k.Holders, h)
		k.Last, k.FreedAt, k.Expired = nil, time.Time{}, false
		k.Fence = max(k.Fence, h.Fence)
	}
	return keys
}

// Torn reports whether a key whose row said it was held (held[i], for
// keys[i]) has no holders once merged: its lease ended between the two
// reads, and the listing shows it neither held nor with its last holder.
func Torn(held []bool, keys []dlock.KeyInfo) bool {
	for i, h := range held {
		if h && i < len(keys) && len(keys[i].Holders) == 0 {
			return true
		}
	}
	return false
}

// Retry calls list (one listing by two reads, and whether it is Torn) until
// it is not torn, at most three times, and returns the last listing: a key
// whose lease ends between the reads is read again rather than shown
// without holders and without its last holder.
func Retry(list func() ([]dlock.KeyInfo, bool, error)) ([]dlock.KeyInfo, error) {
	for attempt := 1; ; attempt++ {
		keys, torn, err := list()
		if err != nil || !torn || attempt == 3 {
			return keys, err
		}
	}
}

package zklock

import "time"

// Escape and Unescape expose the key mapping to the tests.
var (
	Escape   = keyEscape
	Unescape = keyUnescape
)

// Dir returns the znode of key's queue.
func (b *Backend) Dir(key string) string { return b.dir(key) }

// StallParked keeps the parked nodes of key queued however late the next
// AcquireWait comes and whatever happens ahead of them, as if the Backend's
// process had stalled: their timers and watches stop.
func (b *Backend) StallParked(key string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, p := range b.parked[key] {
		p.timer.Stop()
		if p.unwatch != nil {
			p.unwatch()
		}
	}
}

// SetParkTimeout changes how long a waiting node is parked between two
// AcquireWait calls.
func (b *Backend) SetParkTimeout(d time.Duration) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.parkFor = d
}

// SetJournalKeep changes how many entries of a key's journal this
// Backend's writes keep.
func (b *Backend) SetJournalKeep(n int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.journalKeep = n
}

// SetJournalAge changes how long this Backend keeps the journal entries it
// wrote.
func (b *Backend) SetJournalAge(d time.Duration) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.journalAge = d
}

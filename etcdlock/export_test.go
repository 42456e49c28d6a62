package etcdlock

import "time"

// SetParkTimeout changes how long an entry parked between two AcquireWait
// calls is kept for the next call.
func (b *Backend) SetParkTimeout(d time.Duration) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.parkFor = d
}

// WatchFrom is Watch from revision rev instead of the current one.
var WatchFrom = (*Backend).watchFrom

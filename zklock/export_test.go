package zklock

// Escape and Unescape expose the key mapping to the tests.
var (
	Escape   = keyEscape
	Unescape = keyUnescape
)

// Dir returns the znode of key's queue.
func (b *Backend) Dir(key string) string { return b.dir(key) }

// StopParkTimers keeps the parked nodes of key queued however late the next
// AcquireWait comes, as if that call had been sent before their timers fired.
func (b *Backend) StopParkTimers(key string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, p := range b.parked[key] {
		p.timer.Stop()
	}
}

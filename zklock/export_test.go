package zklock

// Escape and Unescape expose the key mapping to the tests.
var (
	Escape   = keyEscape
	Unescape = keyUnescape
)

// Dir returns the znode of key's queue.
func (b *Backend) Dir(key string) string { return b.dir(key) }

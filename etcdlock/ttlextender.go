package etcdlock

import "github.com/dlock-dev/dlock"

var _ dlock.TTLExtender = (*Backend)(nil)

// ExtendsToAnyTTL implements dlock.TTLExtender: an Extend to a TTL other
// than the one an entry was granted with puts the entry on a new etcd lease
// of that TTL (in whole seconds, raised to etcd's minimum), keeping its key
// and fence, so the lease outlives the client by the TTL asked for.
func (b *Backend) ExtendsToAnyTTL() {}

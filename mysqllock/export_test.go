package mysqllock

// ReleaseQuery exposes the lease release statement (arguments: key, token),
// for a test that runs it inside a transaction of its own.
func ReleaseQuery(b *Backend) string { return b.q.release }

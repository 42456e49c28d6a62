// Package fence makes a SQL database refuse writes from a stale lock holder.
//
// A dlock lock can be lost while its holder still works (a process pause, a
// partition): the next holder may then write at the same time. The fencing
// number of each acquisition ([dlock.Lock.Fence]) is larger than every
// earlier one of its key. A [Table] records, per resource, the newest fence
// that has written to it, and [Table.Check], run inside the writer's own
// transaction, refuses an older one with [ErrStaleFence]. Because the check
// and the guarded writes commit or roll back together, and the check's row
// lock orders the transactions of one resource, no transaction with an
// older fence can commit after one with a newer fence has committed.
//
//	fences := fence.Table{Dialect: fence.MySQL}
//	if err := fences.Migrate(ctx, db); err != nil { ... }
//	err := fences.DoTx(ctx, locker, db, "invoice:42", func(ctx context.Context, tx *sql.Tx) error {
//		_, err := tx.ExecContext(ctx, "UPDATE invoices SET state = 'paid' WHERE id = 42")
//		return err
//	})
//
// The guarantee holds only for data in the same database, written in the
// same transaction as the check; see docs/fencing.md.
package fence

// Package ctxend tells whether a context has ended, counting a deadline
// that has passed before its timer fired: a statement bounded by its own
// timer for the same instant may fail first, and the caller must then see
// the context's end, not the statement's error.
package ctxend

import (
	"context"
	"time"
)

// Err is ctx.Err(), or context.DeadlineExceeded if ctx's deadline has
// passed and its timer has not fired yet; nil while ctx is live.
func Err(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if d, ok := ctx.Deadline(); ok && !time.Now().Before(d) {
		return context.DeadlineExceeded
	}
	return nil
}

package redislock

import (
	"context"
	"fmt"

	"github.com/dlock-dev/dlock"
)

var _ dlock.Watcher = (*Redlock)(nil)

// Watch implements dlock.Watcher: it watches key on every server (Backend.Watch)
// and signals after a change any of them reports. A grant reaches a
// majority, so the watches of any len(servers) − quorum + 1 servers see every
// grant and release on at least one of them: Watch fails unless that many
// subscribe, and the channel is closed (the caller reads again and watches
// anew) when so many of them have ended that fewer are left.
func (r *Redlock) Watch(ctx context.Context, key string) (<-chan struct{}, error) {
	need := len(r.nodes) - r.quorum + 1
	wctx, cancel := context.WithCancel(ctx)
	chans := make([]<-chan struct{}, len(r.nodes))
	errs := make([]error, len(r.nodes))
	r.each(wctx, r.timeout, func(bctx context.Context, i int, b *Backend) {
		// Subscribing is bounded by the request timeout, the watch itself
		// by ctx: a watch that subscribes late is not used, and ends with
		// ctx.
		type watched struct {
			ch  <-chan struct{}
			err error
		}
		done := make(chan watched, 1)
		go func() {
			ch, err := b.Watch(wctx, key)
			done <- watched{ch, err}
		}()
		select {
		case w := <-done:
			chans[i], errs[i] = w.ch, w.err
		case <-bctx.Done():
			errs[i] = bctx.Err()
		}
	})
	var live []<-chan struct{}
	var failed []error
	for i, ch := range chans {
		if errs[i] != nil {
			failed = append(failed, r.nodeErr(i, errs[i]))
			continue
		}
		live = append(live, ch)
	}
	if len(live) < need {
		cancel()
		return nil, fmt.Errorf("redislock: redlock: watch %q: %d of %d servers watched, %d needed: %w", key, len(live), len(r.nodes), need, dlock.Join(failed...))
	}
	context.AfterFunc(ctx, cancel)
	ping := make(chan struct{}, 1)
	ended := make(chan struct{}, len(live))
	for _, ch := range live {
		go func() {
			for range ch {
				select {
				case ping <- struct{}{}:
				default:
				}
			}
			ended <- struct{}{}
		}()
	}
	out := make(chan struct{}, 1)
	go func() {
		defer close(out)
		defer cancel()
		for left := len(live); left >= need; {
			select {
			case <-ping:
				select {
				case out <- struct{}{}:
				default:
				}
			case <-ended:
				left--
			}
		}
	}()
	return out, nil
}

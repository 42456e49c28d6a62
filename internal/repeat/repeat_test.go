package repeat

import (
	"sync/atomic"
	"testing"
	"time"
)

// Until calls f at once and keeps calling it, at growing intervals, until
// done is closed; with done closed already, it never calls f.
func TestUntil(t *testing.T) {
	var n atomic.Int32
	done := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		Until(done, time.Millisecond, 4*time.Millisecond, func() { n.Add(1) })
		close(stopped)
	}()
	for n.Load() < 4 {
		time.Sleep(time.Millisecond)
	}
	close(done)
	<-stopped
	calls := n.Load()
	time.Sleep(20 * time.Millisecond)
	if n.Load() != calls {
		t.Errorf("f was called after Until returned")
	}
	Until(done, time.Millisecond, time.Millisecond, func() { t.Error("f was called with done closed") })
}

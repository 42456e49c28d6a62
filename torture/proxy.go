package torture

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/rs/zerolog"
)

// faultProxies is an embedded toxiproxy with one proxy per worker slot in
// front of the store, so that a network fault can hit one holder alone.
type faultProxies struct {
	srv   *toxiproxy.ApiServer
	ps    []*toxiproxy.Proxy
	addrs []string // each proxy's address, read once: toxiproxy rewrites Proxy.Listen at every Start

	mu   sync.Mutex
	cuts map[int]bool // slots cut by a holder fault
	down bool         // every slot is cut for a server restart (takeAway)
	gen  int          // proxies made to replace wedged ones
}

// stopBound bounds a proxy's Stop. toxiproxy's Stop can wedge for good
// when a link's toxic is blocked sending to a sink that is gone (the link
// is then never closed; Shopify/toxiproxy#558): its listener is closed by
// then, so the slot gets a new proxy on the same address.
const stopBound = 5 * time.Second

// stopLocked stops slot's proxy, replacing it if Stop wedges. fp.mu is held.
func (fp *faultProxies) stopLocked(slot int) {
	p := fp.ps[slot]
	done := make(chan struct{})
	go func() {
		p.Stop()
		close(done)
	}()
	t := time.NewTimer(stopBound)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		fp.gen++
		fp.ps[slot] = toxiproxy.NewProxy(fp.srv, fmt.Sprintf("slot%d-%d", slot, fp.gen), fp.addrs[slot], p.Upstream)
	}
}

// proxy returns slot's current proxy.
func (fp *faultProxies) proxy(slot int) *toxiproxy.Proxy {
	fp.mu.Lock()
	defer fp.mu.Unlock()
	return fp.ps[slot]
}

// newFaultProxies starts n proxies, slot i's to upstreams[i % len]; listen
// gives slot i's listening host (nil: loopback).
func newFaultProxies(n int, upstreams []string, listen func(slot int) string) (*faultProxies, error) {
	fp := &faultProxies{srv: toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())}
	for i := range n {
		host := "127.0.0.1"
		if listen != nil {
			host = listen(i)
		}
		p := toxiproxy.NewProxy(fp.srv, fmt.Sprintf("slot%d", i), net.JoinHostPort(host, "0"), upstreams[i%len(upstreams)])
		if err := p.Start(); err != nil {
			fp.close()
			return nil, fmt.Errorf("start proxy: %w", err)
		}
		fp.ps, fp.addrs = append(fp.ps, p), append(fp.addrs, p.Listen)
	}
	return fp, nil
}

// addr returns the address a slot's worker connects to.
func (fp *faultProxies) addr(slot int) string { return fp.addrs[slot] }

// addToxic adds a toxic to both directions of a slot's proxy.
func (fp *faultProxies) addToxic(slot int, name, typ, attrs string) error {
	for _, dir := range []string{"upstream", "downstream"} {
		js := fmt.Sprintf(`{"name":%q,"type":%q,"stream":%q,"attributes":%s}`, name+"_"+dir, typ, dir, attrs)
		if _, err := fp.proxy(slot).Toxics.AddToxicJson(strings.NewReader(js)); err != nil {
			return err
		}
	}
	return nil
}

// removeToxic removes a toxic from both directions of a slot's proxy. A
// removal waits for the toxic's links, and can wedge as Stop can (a link
// blocked on a sink that is gone): after stopBound the slot gets a new
// proxy on the same address, without the toxic.
func (fp *faultProxies) removeToxic(slot int, name string) {
	p := fp.proxy(slot)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for _, dir := range []string{"upstream", "downstream"} {
			_ = p.Toxics.RemoveToxic(context.Background(), name+"_"+dir)
		}
	}()
	t := time.NewTimer(stopBound)
	defer t.Stop()
	select {
	case <-done:
		return
	case <-t.C:
	}
	fp.mu.Lock()
	defer fp.mu.Unlock()
	if fp.ps[slot] != p {
		return // replaced meanwhile
	}
	fp.stopLocked(slot)
	if fp.ps[slot] == p { // stopped, but its toxics are still locked
		fp.gen++
		fp.ps[slot] = toxiproxy.NewProxy(fp.srv, fmt.Sprintf("slot%d-%d", slot, fp.gen), fp.addrs[slot], p.Upstream)
	}
	if !fp.cuts[slot] && !fp.down {
		_ = fp.start(slot)
	}
}

// cut closes every connection of a slot and refuses new ones until mend.
func (fp *faultProxies) cut(slot int) {
	fp.mu.Lock()
	defer fp.mu.Unlock()
	if fp.cuts == nil {
		fp.cuts = map[int]bool{}
	}
	fp.cuts[slot] = true
	fp.stopLocked(slot)
}

// mend listens again on the slot's address (after cut), unless the store is
// taken away from every slot (then giveBack does).
func (fp *faultProxies) mend(slot int) error {
	fp.mu.Lock()
	defer fp.mu.Unlock()
	delete(fp.cuts, slot)
	if fp.down {
		return nil
	}
	return fp.start(slot)
}

func (fp *faultProxies) start(slot int) error {
	if err := fp.ps[slot].Start(); err != nil && err != toxiproxy.ErrProxyAlreadyStarted {
		return err
	}
	return nil
}

// takeAway cuts every slot (a server restart): no worker's request reaches
// the store until giveBack.
func (fp *faultProxies) takeAway() {
	fp.mu.Lock()
	defer fp.mu.Unlock()
	fp.down = true
	for i := range fp.ps {
		fp.stopLocked(i)
	}
}

// giveBack undoes takeAway, except for slots a holder fault still cuts.
func (fp *faultProxies) giveBack() error {
	fp.mu.Lock()
	defer fp.mu.Unlock()
	fp.down = false
	var errs []error
	for i := range fp.ps {
		if !fp.cuts[i] {
			errs = append(errs, fp.start(i))
		}
	}
	return errors.Join(errs...)
}

func (fp *faultProxies) close() {
	fp.mu.Lock()
	defer fp.mu.Unlock()
	for i := range fp.ps {
		fp.stopLocked(i)
	}
}

package torture

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"

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
}

// newFaultProxies starts n proxies to upstream; listen gives slot i's
// listening host (nil: loopback).
func newFaultProxies(n int, upstream string, listen func(slot int) string) (*faultProxies, error) {
	fp := &faultProxies{srv: toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())}
	for i := range n {
		host := "127.0.0.1"
		if listen != nil {
			host = listen(i)
		}
		p := toxiproxy.NewProxy(fp.srv, fmt.Sprintf("slot%d", i), net.JoinHostPort(host, "0"), upstream)
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
		if _, err := fp.ps[slot].Toxics.AddToxicJson(strings.NewReader(js)); err != nil {
			return err
		}
	}
	return nil
}

func (fp *faultProxies) removeToxic(slot int, name string) {
	for _, dir := range []string{"upstream", "downstream"} {
		_ = fp.ps[slot].Toxics.RemoveToxic(context.Background(), name+"_"+dir)
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
	fp.ps[slot].Stop()
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
	for _, p := range fp.ps {
		p.Stop()
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
	for _, p := range fp.ps {
		p.Stop()
	}
}

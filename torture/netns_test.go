package torture

import (
	"net/netip"
	"testing"
)

func TestNamespaceNaming(t *testing.T) {
	pfx := netip.MustParsePrefix("10.0.0.0/8")
	seen := map[string]bool{}
	for _, id := range []int{0, 1, 16383} {
		ns := &namespaces{id: id, slots: 64}
		for s := range 64 {
			h, p := ns.hostIP(s), ns.peerIP(s)
			if !pfx.Contains(h) || !pfx.Contains(p) || netip.PrefixFrom(h, 30).Masked() != netip.PrefixFrom(p, 30).Masked() {
				t.Fatalf("id %d slot %d: %s and %s are not one /30 of 10/8", id, s, h, p)
			}
			for _, n := range []string{ns.hostIf(s), ns.peerIf(s)} {
				if len(n) > 15 { // IFNAMSIZ - 1
					t.Errorf("interface name %q is too long", n)
				}
			}
			for _, k := range []string{h.String(), ns.hostIf(s), ns.peerIf(s), ns.name(s)} {
				if seen[k] {
					t.Errorf("id %d slot %d: %s used twice", id, s, k)
				}
				seen[k] = true
			}
		}
	}
}

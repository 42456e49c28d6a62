package torture

import (
	"bytes"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
)

// namespaces gives each worker slot a network namespace of its own, joined
// to the harness's by a veth pair with a /30 of 10.0.0.0/8, so that a
// partition can be made by the kernel: an nftables table in the worker's
// namespace that drops its packets to and from the store's proxy
// (FaultPartition). Nothing else can reach a worker: its namespace's
// loopback is down, and the harness listens for it (store and resource
// proxies) on the host end of its veth only.
//
// It needs root (CAP_NET_ADMIN), ip (iproute2) and nft (nftables). Names
// and addresses derive from the harness's pid, so that concurrent harnesses
// on one machine do not collide.
type namespaces struct {
	id    int // the harness's pid, mod 16384
	slots int
}

// netnsAvailable reports why namespaces cannot be made here (nil: they can).
func netnsAvailable() error {
	if os.Geteuid() != 0 {
		return errors.New("network namespaces need root")
	}
	for _, bin := range []string{"ip", "nft"} {
		if _, err := exec.LookPath(bin); err != nil {
			return fmt.Errorf("%s not found (apt-get install iproute2 nftables): %w", bin, err)
		}
	}
	return nil
}

// newNamespaces creates a namespace and veth pair per slot (removing
// leftovers of a crashed harness with the same names first).
func newNamespaces(slots int) (*namespaces, error) {
	if err := netnsAvailable(); err != nil {
		return nil, err
	}
	ns := &namespaces{id: os.Getpid() % 16384, slots: slots}
	for s := range slots {
		ns.remove(s)
		name, host, peer := ns.name(s), ns.hostIf(s), ns.peerIf(s)
		h, p := ns.hostIP(s), ns.peerIP(s)
		for _, args := range [][]string{
			{"netns", "add", name},
			{"link", "add", host, "type", "veth", "peer", "name", peer},
			{"link", "set", peer, "netns", name},
			{"addr", "add", h.String() + "/30", "dev", host},
			{"link", "set", host, "up"},
			{"-n", name, "addr", "add", p.String() + "/30", "dev", peer},
			{"-n", name, "link", "set", peer, "up"},
		} {
			if err := runCmd("ip", nil, args...); err != nil {
				ns.close()
				return nil, err
			}
		}
	}
	return ns, nil
}

func (ns *namespaces) name(slot int) string { return fmt.Sprintf("dlock-t%d-%d", ns.id, slot) }
func (ns *namespaces) hostIf(slot int) string {
	return "dth" + strconv.FormatInt(int64(ns.block(slot)), 36)
}
func (ns *namespaces) peerIf(slot int) string {
	return "dtn" + strconv.FormatInt(int64(ns.block(slot)), 36)
}

// block numbers the slot's /30 within 10.0.0.0/8 (2^20 of them).
func (ns *namespaces) block(slot int) int { return ns.id<<6 | slot }

func (ns *namespaces) addr(slot, host int) netip.Addr {
	v := uint32(10)<<24 | uint32(ns.block(slot))<<2 | uint32(host)
	return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
}

// hostIP is the harness's end of the slot's veth (its proxies listen there);
// peerIP is the worker's.
func (ns *namespaces) hostIP(slot int) netip.Addr { return ns.addr(slot, 1) }
func (ns *namespaces) peerIP(slot int) netip.Addr { return ns.addr(slot, 2) }

// command wraps a worker's command line so that it runs in the slot's
// namespace (`ip netns exec` execs it: the pid is the worker's).
func (ns *namespaces) command(slot int, exe string, args ...string) *exec.Cmd {
	return exec.Command("ip", append([]string{"netns", "exec", ns.name(slot), exe}, args...)...)
}

// partitionTable is the nftables table of a partition.
const partitionTable = "dlock_partition"

// partition drops, in the slot's namespace, every packet to or from the
// harness's port (the slot's store proxy) until heal. Connections stay open
// on both sides; TCP retransmits into the void.
func (ns *namespaces) partition(slot int, port uint16) error {
	h := ns.hostIP(slot).String()
	script := fmt.Sprintf(`table inet %[1]s {
  chain out { type filter hook output priority 0; policy accept; ip daddr %[2]s tcp dport %[3]d drop; }
  chain in { type filter hook input priority 0; policy accept; ip saddr %[2]s tcp sport %[3]d drop; }
}
`, partitionTable, h, port)
	return runCmd("ip", []byte(script), "netns", "exec", ns.name(slot), "nft", "-f", "-")
}

// heal removes the slot's partition.
func (ns *namespaces) heal(slot int) error {
	return runCmd("ip", nil, "netns", "exec", ns.name(slot), "nft", "delete", "table", "inet", partitionTable)
}

// remove deletes the slot's namespace (and with it the veth pair).
func (ns *namespaces) remove(slot int) {
	_ = runCmd("ip", nil, "link", "del", ns.hostIf(slot))
	_ = runCmd("ip", nil, "netns", "del", ns.name(slot))
}

func (ns *namespaces) close() {
	for s := range ns.slots {
		ns.remove(s)
	}
}

// runCmd runs a command with stdin, and returns its stderr in the error.
func runCmd(bin string, stdin []byte, args ...string) error {
	cmd := exec.Command(bin, args...)
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s %v: %w: %s", bin, args, err, bytes.TrimSpace(stderr.Bytes()))
	}
	return nil
}

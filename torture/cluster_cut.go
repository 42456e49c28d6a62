package torture

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// Cutting one member of an ensemble off from its peers on loopback, where
// every member's connections come from 127.0.0.1: each member runs as a
// user of its own (cutCred), so that nftables can tell its packets apart
// (meta skuid). A cut, in a table of the harness's own in the host's
// network namespace, drops
//   - every packet the member sends but those of its client port (its
//     peer connections, whoever opened them), marking their connections,
//   - every packet to its peer ports (the others opening connections to it),
//   - every packet of a marked connection (the others' side of the peer
//     connections it had opened),
//
// so that its clients still reach it while the ensemble does not. Nothing
// else on the machine is touched: the rules match the member's user, its
// ports and the marks they set.
//
// A cluster is told apart from every other one running at the same time,
// in this harness or another, by its id: the first port it took, which no
// other running cluster holds. Its members' users, their connections'
// marks and the cuts' tables are all made from it, so that the cut of one
// cluster's member never touches a member of another (an etcd and a
// ZooKeeper ensemble of one test run fail over side by side).

// cutMark marks the connections of a cut member: "d" in the top byte, then
// the cluster's id and the member (cutSlot).
const cutMark = 0x64000000

// cutSlot is member i of cluster id (a port) as a small number: 4 per port.
func cutSlot(id, i int) int { return id<<2 | i }

// cutCred is the user and group that member i of cluster id runs as:
// unused ids, apart for every cluster and member.
func cutCred(id, i int) *syscall.Credential {
	u := uint32(2_000_000 + cutSlot(id, i))
	return &syscall.Credential{Uid: u, Gid: u}
}

// cutAvailable reports why cuts cannot be made here (nil: they can). It
// removes the cuts that harnesses which died left behind: their port rules
// would drop the traffic of whatever uses those ports next.
func cutAvailable() error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("%w: cutting a member off needs root (nftables, members run as users of their own)", ErrNoServer)
	}
	if _, err := exec.LookPath("nft"); err != nil {
		return fmt.Errorf("%w: nft (Debian: nftables): %v", ErrNoServer, err)
	}
	out, err := exec.Command("nft", "list", "tables", "inet").Output()
	if err != nil {
		return fmt.Errorf("%w: nft list tables: %v", ErrNoServer, err)
	}
	for _, f := range strings.Fields(string(out)) {
		var pid int
		if n, _ := fmt.Sscanf(f, "dlock-cut-%d", &pid); n == 1 && syscall.Kill(pid, 0) == syscall.ESRCH {
			_ = runCmd("nft", nil, "delete", "table", "inet", f)
		}
	}
	return nil
}

// chownTree gives dir and everything in it to cred's user.
func chownTree(dir string, cred *syscall.Credential) error {
	return filepath.Walk(dir, func(p string, _ os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		return os.Lchown(p, int(cred.Uid), int(cred.Gid))
	})
}

// memberCut is the cut of one member, until heal.
type memberCut struct{ table string }

// cutMember cuts member i of cluster id (running as cutCred(id, i)) off
// from its peers: it keeps clientPort, loses peerPorts (see above).
func cutMember(id, i, clientPort int, peerPorts []int) (*memberCut, error) {
	c := &memberCut{table: fmt.Sprintf("dlock-cut-%d-%d-%d", os.Getpid(), id, i)}
	ports := make([]string, len(peerPorts))
	for k, p := range peerPorts {
		ports[k] = strconv.Itoa(p)
	}
	mark := fmt.Sprintf("%#x", cutMark|cutSlot(id, i))
	rules := fmt.Sprintf(`table inet %s {
  chain out {
    type filter hook output priority 0;
    meta skuid %d tcp sport != %d ct mark set %s drop
    tcp dport { %s } drop
  }
  chain in {
    type filter hook input priority 0;
    ct mark %s drop
  }
}
`, c.table, cutCred(id, i).Uid, clientPort, mark, strings.Join(ports, ", "), mark)
	if err := runCmd("nft", []byte(rules), "-f", "-"); err != nil {
		return nil, fmt.Errorf("cut member %d: %w", i, err)
	}
	return c, nil
}

// heal removes the cut.
func (c *memberCut) heal() error {
	if c == nil {
		return nil
	}
	if err := runCmd("nft", nil, "delete", "table", "inet", c.table); err != nil {
		return errors.Join(fmt.Errorf("heal %s", c.table), err)
	}
	return nil
}

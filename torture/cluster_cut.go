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

// cutMark marks the connections of a cut member ("dlk" and the member).
const cutMark = 0x646c6b00

// cutCred is the user and group that member i of a cluster of this
// harness runs as: unused ids, apart for concurrent harnesses.
func cutCred(i int) *syscall.Credential {
	id := uint32(2_000_000 + (os.Getpid()%100_000)*4 + i)
	return &syscall.Credential{Uid: id, Gid: id}
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
		var pid, i int
		if n, _ := fmt.Sscanf(f, "dlock-cut-%d-%d", &pid, &i); n == 2 && syscall.Kill(pid, 0) == syscall.ESRCH {
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

// cutMember cuts member i (running as cutCred(i)) off from its peers: it
// keeps clientPort, loses peerPorts (see above).
func cutMember(i, clientPort int, peerPorts []int) (*memberCut, error) {
	c := &memberCut{table: fmt.Sprintf("dlock-cut-%d-%d", os.Getpid(), i)}
	ports := make([]string, len(peerPorts))
	for k, p := range peerPorts {
		ports[k] = strconv.Itoa(p)
	}
	mark := fmt.Sprintf("%#x", cutMark+i)
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
`, c.table, cutCred(i).Uid, clientPort, mark, strings.Join(ports, ", "), mark)
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

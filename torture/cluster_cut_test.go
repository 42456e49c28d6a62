package torture

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"
)

// TestCutsOfClustersApart cuts member 1 of one cluster off from its peers
// and connects to a listener from a process running as member 1 of another
// cluster, then as the cut member. The rules: the cut of one cluster never
// touches a member of another running beside it (TestFailoverQuorum runs an
// etcd and a ZooKeeper ensemble side by side, both cut), and it does cut its
// own member.
func TestCutsOfClustersApart(t *testing.T) {
	if err := cutAvailable(); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("cuts are required (CI=true): %v", err)
		}
		t.Skipf("SKIPPING: %v", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	ports := make([]int, 4)
	for i := range ports {
		if ports[i], err = freePort(); err != nil {
			t.Fatal(err)
		}
	}
	cut, clientPort, peerPort, other := ports[0], ports[1], ports[2], ports[3]
	c, err := cutMember(cut, 1, clientPort, []int{peerPort})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := c.heal(); err != nil {
			t.Error(err)
		}
	}()
	dial := func(cred *syscall.Credential) error {
		ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, "bash", "-c", fmt.Sprintf("exec 3<>/dev/tcp/127.0.0.1/%d", ln.Addr().(*net.TCPAddr).Port))
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
		out, err := cmd.CombinedOutput()
		if err != nil {
			return fmt.Errorf("%w: %s", err, out)
		}
		return nil
	}
	if err := dial(cutCred(other, 1)); err != nil {
		t.Errorf("member 1 of another cluster could not connect while member 1 of cluster %d was cut: %v", cut, err)
	}
	if err := dial(cutCred(cut, 1)); err == nil {
		t.Errorf("the cut member connected to a port other than its client port")
	}
}

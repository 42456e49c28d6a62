package torture

import (
	"os"
	"slices"
	"testing"
)

func TestCredential(t *testing.T) {
	c, err := credential("Name:\tpostgres\nUid:\t108\t108\t108\t108\nGid:\t115\t115\t115\t115\nGroups:\t115 116 \n")
	if err != nil {
		t.Fatal(err)
	}
	if c.Uid != 108 || c.Gid != 115 || !slices.Equal(c.Groups, []uint32{115, 116}) {
		t.Errorf("credential = %+v, want uid 108, gid 115, groups [115 116]", c)
	}
	if _, err := credential("Name:\tx\nGroups:\t\n"); err == nil {
		t.Error("a status without Uid and Gid was accepted")
	}
	self, err := readServerProc(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if self.ppid != os.Getppid() || gone(os.Getpid()) {
		t.Errorf("own /proc/<pid>/stat: ppid %d (want %d), gone %v", self.ppid, os.Getppid(), gone(os.Getpid()))
	}
	if self.cred.Uid != uint32(os.Getuid()) || self.cred.Gid != uint32(os.Getgid()) {
		t.Errorf("own credential %+v, want uid %d gid %d", self.cred, os.Getuid(), os.Getgid())
	}
}

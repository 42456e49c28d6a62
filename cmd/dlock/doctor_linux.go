package main

import (
	"golang.org/x/sys/unix"
)

// networkFS names the network filesystem that holds dir, or returns "".
// FUSE counts: sshfs and other remote filesystems use it.
func networkFS(dir string) string {
	var st unix.Statfs_t
	if unix.Statfs(dir, &st) != nil {
		return ""
	}
	switch uint32(st.Type) {
	case unix.NFS_SUPER_MAGIC:
		return "nfs"
	case unix.SMB_SUPER_MAGIC, 0xFF534D42, 0xFE534D42: // smb, cifs, smb2
		return "smb/cifs"
	case unix.V9FS_MAGIC:
		return "9p"
	case unix.AFS_SUPER_MAGIC, 0x6B414653: // afs, kafs
		return "afs"
	case 0x00C36400: // ceph
		return "ceph"
	case unix.FUSE_SUPER_MAGIC:
		return "fuse (sshfs, glusterfs, …)"
	}
	return ""
}

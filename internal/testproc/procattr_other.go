//go:build !linux

package testproc

import "syscall"

// procAttr is nil where the kernel cannot tie a child's life to the test's:
// only the cleanups stop the servers.
func procAttr() *syscall.SysProcAttr { return nil }

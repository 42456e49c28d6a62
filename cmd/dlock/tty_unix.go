//go:build unix

package main

import (
	"syscall"
	"unsafe"
)

// foregroundTTY reports whether stdin is a terminal whose foreground process
// group is dlock's: someone runs dlock at a shell prompt, not in the
// background.
func foregroundTTY() bool {
	var pgrp int32 // pid_t
	_, _, errno := syscall.Syscall(syscall.SYS_IOCTL, 0, syscall.TIOCGPGRP, uintptr(unsafe.Pointer(&pgrp)))
	return errno == 0 && int(pgrp) == syscall.Getpgrp()
}

package testproc

import "syscall"

// procAttr makes the kernel kill a started server when the test process
// dies, even by a timeout panic or a signal that skips the cleanups.
func procAttr() *syscall.SysProcAttr { return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL} }

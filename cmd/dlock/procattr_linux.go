package main

import "syscall"

// childAttr has the kernel kill the command if dlock dies, so that it never
// runs without the lock, and with newGroup puts it in its own process group,
// so that signals reach the whole job.
func childAttr(newGroup bool) *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: newGroup, Pdeathsig: syscall.SIGKILL}
}

package main

import "syscall"

// childAttr puts the command in its own process group, so that signals reach
// the whole job, and has the kernel kill it if dlock dies, so that it never
// runs without the lock.
func childAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}

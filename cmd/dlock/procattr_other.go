//go:build unix && !linux

package main

import "syscall"

// childAttr with newGroup puts the command in its own process group, so that
// signals reach the whole job. Outside Linux there is no parent-death signal:
// if dlock is killed with SIGKILL the command keeps running (without the
// lock).
func childAttr(newGroup bool) *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: newGroup}
}

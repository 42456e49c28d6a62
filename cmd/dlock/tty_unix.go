//go:build unix

package main

import "golang.org/x/sys/unix"

// foregroundTTY reports whether stdin is a terminal whose foreground process
// group is dlock's: someone runs dlock at a shell prompt, not in the
// background.
func foregroundTTY() bool {
	pgrp, err := unix.IoctlGetInt(0, unix.TIOCGPGRP)
	return err == nil && pgrp == unix.Getpgrp()
}

// stdinTerminal reports whether stdin is a terminal.
func stdinTerminal() bool {
	_, err := unix.IoctlGetInt(0, unix.TIOCGPGRP)
	return err == nil
}

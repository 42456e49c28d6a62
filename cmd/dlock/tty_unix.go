//go:build unix

package main

import "golang.org/x/sys/unix"

// foregroundTTY reports whether stdin is a terminal whose foreground process
// group is dlock's: someone runs dlock at a shell prompt, not in the
// background.
func foregroundTTY() bool { return foregroundOn(0) }

// stdinTerminal reports whether stdin is a terminal.
func stdinTerminal() bool {
	_, err := unix.IoctlGetInt(0, unix.TIOCGPGRP)
	return err == nil
}

// foregroundOn reports whether fd is a terminal whose foreground process
// group is dlock's.
func foregroundOn(fd int) bool {
	pgrp, err := unix.IoctlGetInt(fd, unix.TIOCGPGRP)
	return err == nil && pgrp == unix.Getpgrp()
}

// termWidth returns the width of the terminal fd in columns, or 0.
func termWidth(fd int) int {
	ws, err := unix.IoctlGetWinsize(fd, unix.TIOCGWINSZ)
	if err != nil {
		return 0
	}
	return int(ws.Col)
}

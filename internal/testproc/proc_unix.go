//go:build unix

package testproc

import "syscall"

// Stop freezes the current process, if there is one, with SIGSTOP: to its
// peers and clients it is partitioned away, its sockets open but silent.
func (p *Proc) Stop() error { return p.signal(syscall.SIGSTOP, true) }

// Cont resumes a process frozen by Stop with SIGCONT.
func (p *Proc) Cont() error { return p.signal(syscall.SIGCONT, false) }

func (p *Proc) signal(sig syscall.Signal, stopped bool) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return nil
	}
	if err := p.cmd.Process.Signal(sig); err != nil {
		return err
	}
	p.stopped = stopped
	return nil
}

package torture

import (
	"bufio"
	"net"
	"testing"
	"time"
)

// echoServer answers each line with name and the line.
func echoServer(t *testing.T, name string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				sc := bufio.NewScanner(c)
				for sc.Scan() {
					if _, err := c.Write([]byte(name + " " + sc.Text() + "\n")); err != nil {
						return
					}
				}
			}()
		}
	}()
	return ln.Addr().String()
}

func ask(t *testing.T, c net.Conn, line string) (string, error) {
	t.Helper()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write([]byte(line + "\n")); err != nil {
		return "", err
	}
	return bufio.NewReader(c).ReadString('\n')
}

// The Front forwards to its upstream; a switch drops the connections to
// the old one, and the next ones reach the new one, on the same address.
func TestFrontSwitch(t *testing.T) {
	a, b := echoServer(t, "a"), echoServer(t, "b")
	f, err := NewFront(a)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	addr := f.Addr()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if got, err := ask(t, c, "x"); got != "a x\n" || err != nil {
		t.Fatalf("before the switch: %q, %v", got, err)
	}
	if err := f.Switch(b); err != nil {
		t.Fatal(err)
	}
	if got, err := ask(t, c, "y"); err == nil {
		t.Errorf("a connection to the old upstream answered after the switch: %q", got)
	}
	if f.Addr() != addr || f.Upstream() != b {
		t.Errorf("after the switch: address %s upstream %s; want %s and %s", f.Addr(), f.Upstream(), addr, b)
	}
	c2, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	if got, err := ask(t, c2, "z"); got != "b z\n" || err != nil {
		t.Fatalf("after the switch: %q, %v", got, err)
	}
}

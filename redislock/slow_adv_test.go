package redislock_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/redis/go-redis/v9"
)

// delayProxy forwards TCP connections to target, holding every chunk the
// server sends for delay: a store that answers, slowly.
func delayProxy(t *testing.T, target string, delay time.Duration) string {
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
			s, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			t.Cleanup(func() { c.Close(); s.Close() })
			go io.Copy(s, c)
			go func() {
				buf := make([]byte, 64<<10)
				for {
					n, err := s.Read(buf)
					if n > 0 {
						time.Sleep(delay)
						if _, werr := c.Write(buf[:n]); werr != nil {
							return
						}
					}
					if err != nil {
						c.Close()
						return
					}
				}
			}()
		}
	}()
	return ln.Addr().String()
}

// TestSlowStoreIsNotNotAcquired: a store whose answers take longer than a
// short lease's safe part grants the key too late to be used. The key is
// free (nobody else holds it): the caller must get an error that says the
// store is too slow, not ErrNotAcquired, which a cron job (dlock run -n)
// reads as "another copy runs" and skips for good.
func TestSlowStoreIsNotNotAcquired(t *testing.T) {
	srv := startServer(t)
	proxy := delayProxy(t, srv.addr(), 900*time.Millisecond)
	c := redis.NewClient(&redis.Options{Addr: proxy, ReadTimeout: 10 * time.Second, WriteTimeout: 10 * time.Second})
	t.Cleanup(func() { c.Close() })
	l := locktest.NewLocker(t, newBackend(t, c, nil))
	k := locktest.UniqueKey(t.Name())
	_, err := l.TryAcquire(ctxT(t, 20*time.Second), k, dlock.WithTTL(time.Second))
	t.Logf("TryAcquire through a store answering in 0.9 s, ttl 1 s: %v", err)
	var he *dlock.HeldError
	if errors.As(err, &he) || errors.Is(err, dlock.ErrNotAcquired) {
		t.Errorf("a free key on a slow store reported as held by someone (holder %+v): %v", he.Holder, err)
	}
	// Nobody holds it: a client with a fast connection takes it at once.
	other := locktest.NewLocker(t, newBackend(t, srv.client(t), nil))
	olk, err := other.TryAcquire(ctxT(t, 10*time.Second), k, dlock.WithTTL(time.Second))
	if err != nil {
		t.Fatalf("the key was not free: %v", err)
	}
	olk.Release(ctxT(t, 5*time.Second))
}

// TestCloseWithDeadlineOnSlowStoreFreesAll: Close with a deadline that
// covers a few round trips (a shutdown budget) frees every key the Locker
// holds, not only those whose turn came before the deadline: releases go
// one after the other, and what is left when the deadline ends stays held
// for its TTL.
func TestCloseWithDeadlineOnSlowStoreFreesAll(t *testing.T) {
	srv := startServer(t)
	proxy := delayProxy(t, srv.addr(), 20*time.Millisecond)
	c := redis.NewClient(&redis.Options{Addr: proxy})
	t.Cleanup(func() { c.Close() })
	l := dlock.New(newBackend(t, c, nil), nil)
	base := locktest.UniqueKey(t.Name())
	const n = 20
	for i := range n {
		if _, err := l.TryAcquire(ctxT(t, 10*time.Second), fmt.Sprintf("%s/%d", base, i), dlock.WithTTL(30*time.Second)); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond) // 10 round trips
	defer cancel()
	t.Logf("Close: %v", l.Close(ctx))
	time.Sleep(time.Second) // anything still under way lands
	other := locktest.NewLocker(t, newBackend(t, srv.client(t), nil))
	held := 0
	for i := range n {
		lk, err := other.TryAcquire(ctxT(t, 10*time.Second), fmt.Sprintf("%s/%d", base, i), dlock.WithTTL(time.Second))
		if err != nil {
			held++
			continue
		}
		lk.Release(ctxT(t, 5*time.Second))
	}
	if held > 0 {
		t.Errorf("%d of %d keys still held (for their 30 s TTL) after Close with a 200 ms deadline on a store 20 ms away", held, n)
	}
}

package main

import (
	"fmt"
	"net/url"
	"strings"
	"time"

	"github.com/dlock-dev/dlock/etcdlock"
	"github.com/dlock-dev/dlock/zklock"
	"github.com/go-zookeeper/zk"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// endpoints splits a URL's host part, "h1:p1,h2:p2", adding port to hosts
// without one.
func endpoints(u *url.URL, port string) ([]string, error) {
	var out []string
	for _, h := range strings.Split(u.Host, ",") {
		if h == "" {
			return nil, usageError("no server in %s", redacted(u))
		}
		if !strings.Contains(h, ":") {
			h += ":" + port
		}
		out = append(out, h)
	}
	return out, nil
}

// openEtcd opens etcd://host:2379[,host2:2379…][?prefix=/dlock/].
func openEtcd(u *url.URL) (*store, error) {
	q := u.Query()
	for k := range q {
		if k != "prefix" {
			return nil, usageError("unknown parameter %q in %s (known: prefix)", k, redacted(u))
		}
	}
	eps, err := endpoints(u, "2379")
	if err != nil {
		return nil, err
	}
	cfg := clientv3.Config{Endpoints: eps, DialTimeout: 5 * time.Second, Logger: zap.NewNop()}
	if u.User != nil {
		cfg.Username = u.User.Username()
		cfg.Password, _ = u.User.Password()
	}
	c, err := clientv3.New(cfg)
	if err != nil {
		return nil, failure(fmt.Errorf("%s: %w", redacted(u), err))
	}
	b, err := etcdlock.New(c, &etcdlock.Options{Prefix: q.Get("prefix")})
	if err != nil {
		c.Close()
		return nil, usageError("%w", err)
	}
	closeAll := func() error { b.Close(); return c.Close() } // the Backend waits for its clean-up, then the client goes
	return &store{name: redacted(u), backend: b, migrate: noMigrate, schema: "-- etcd needs no schema.", close: closeAll}, nil
}

// openZooKeeper opens zk://host:2181[,host2:2181…][?root=/dlock&session=30s].
// Lock TTLs may not exceed the session timeout.
func openZooKeeper(u *url.URL) (*store, error) {
	q := u.Query()
	session := 30 * time.Second
	for k := range q {
		switch k {
		case "root":
		case "session":
			d, err := time.ParseDuration(q.Get(k))
			if err != nil || d <= 0 {
				return nil, usageError("bad session timeout %q in %s", q.Get(k), redacted(u))
			}
			session = d
		default:
			return nil, usageError("unknown parameter %q in %s (known: root, session)", k, redacted(u))
		}
	}
	servers, err := endpoints(u, "2181")
	if err != nil {
		return nil, err
	}
	c, _, err := zk.Connect(servers, session, zk.WithLogInfo(false), zk.WithLogger(quietZK{}))
	if err != nil {
		return nil, failure(fmt.Errorf("%s: %w", redacted(u), err))
	}
	b, err := zklock.New(c, &zklock.Options{SessionTimeout: session, Root: q.Get("root")})
	if err != nil {
		c.Close()
		return nil, usageError("%w", err)
	}
	closeConn := func() error { c.Close(); return nil }
	return &store{name: redacted(u), backend: b, migrate: noMigrate, schema: "-- ZooKeeper needs no schema.", close: closeConn}, nil
}

// quietZK drops the ZooKeeper client's connection chatter.
type quietZK struct{}

func (quietZK) Printf(string, ...any) {}

package main

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/dlock-dev/dlock/etcdlock"
	"github.com/dlock-dev/dlock/zklock"
	"github.com/go-zookeeper/zk"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// endpoints splits a URL's host part, "h1:p1,h2:p2", adding port to hosts
// without one.
func endpoints(spec *storeSpec, port string) []string {
	var out []string
	for _, h := range strings.Split(spec.u.Host, ",") {
		if !strings.Contains(h, ":") {
			h += ":" + port
		}
		out = append(out, h)
	}
	return out
}

// openEtcd opens etcd://host:2379[,host2:2379…][?prefix=/dlock/].
func openEtcd(spec *storeSpec, log *slog.Logger) (*store, error) {
	cfg := clientv3.Config{Endpoints: endpoints(spec, "2379"), DialTimeout: 5 * time.Second, Logger: zapLogger(log)}
	if spec.u.User != nil {
		cfg.Username = spec.u.User.Username()
		cfg.Password, _ = spec.u.User.Password()
	}
	c, err := clientv3.New(cfg)
	if err != nil {
		return nil, failure(fmt.Errorf("%s: %s", spec.name, spec.scrub(err.Error())))
	}
	b, err := etcdlock.New(c, &etcdlock.Options{Prefix: spec.params.Get("prefix")})
	if err != nil {
		c.Close()
		return nil, usageError("%w", err)
	}
	closeAll := func() error { b.Close(); return c.Close() } // the Backend waits for its clean-up, then the client goes
	ping := func(ctx context.Context) error {
		_, err := c.Get(ctx, "dlock-ping", clientv3.WithCountOnly())
		return err
	}
	return &store{name: spec.name, backend: b, migrate: ping, schema: "-- etcd needs no schema.",
		doctor: etcdDoctor(cfg.Endpoints, false), close: closeAll}, nil
}

// openZooKeeper opens zk://host:2181[,host2:2181…][?root=/dlock&session=30s].
// Lock TTLs may not exceed the session timeout.
func openZooKeeper(spec *storeSpec, log *slog.Logger) (*store, error) {
	session := 30 * time.Second
	if v := spec.params.Get("session"); v != "" {
		session, _ = time.ParseDuration(v) // checked by parseStore
	}
	c, _, err := zk.Connect(endpoints(spec, "2181"), session, zk.WithLogger(zkLogger{log}))
	if err != nil {
		return nil, failure(fmt.Errorf("%s: %s", spec.name, spec.scrub(err.Error())))
	}
	b, err := zklock.New(c, &zklock.Options{SessionTimeout: session, Root: spec.params.Get("root")})
	if err != nil {
		c.Close()
		return nil, usageError("%w", err)
	}
	closeConn := func() error { c.Close(); return nil }
	ping := func(context.Context) error {
		_, _, err := c.Exists("/")
		return err
	}
	return &store{name: spec.name, backend: b, migrate: ping, schema: "-- ZooKeeper needs no schema.",
		doctor: zkDoctor(c), close: closeConn}, nil
}

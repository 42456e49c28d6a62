package torture

import (
	"context"
	"errors"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/zklock"
	"github.com/go-zookeeper/zk"
)

// zkLease is zklock on the ZooKeeper at Env.ZKAddr.
var zkLease = &Adapter{
	Name:      "zk-lease",
	Networked: true,
	Upstream:  addrUpstream("ZK", func(env *Env) string { return env.ZKAddr }),
	Prepare: func(ctx context.Context, env *Env) (string, error) {
		return "", errors.New("TODO")
	},
	Open: func(ctx context.Context, a OpenArgs) (dlock.Backend, func() error, error) {
		conn, _, err := zk.Connect([]string{a.Addr}, 10*time.Second)
		if err != nil {
			return nil, nil, err
		}
		b, err := zklock.New(conn, &zklock.Options{SessionTimeout: 10 * time.Second, Root: a.Store})
		if err != nil {
			conn.Close()
			return nil, nil, err
		}
		return b, func() error { conn.Close(); return nil }, nil
	},
}

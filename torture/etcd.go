package torture

import (
	"context"
	"errors"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/etcdlock"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// etcdLease is etcdlock on the etcd at Env.EtcdAddr.
var etcdLease = &Adapter{
	Name:      "etcd-lease",
	Networked: true,
	Upstream:  addrUpstream("Etcd", func(env *Env) string { return env.EtcdAddr }),
	Prepare: func(ctx context.Context, env *Env) (string, error) {
		return "", errors.New("TODO")
	},
	Open: func(ctx context.Context, a OpenArgs) (dlock.Backend, func() error, error) {
		cli, err := clientv3.New(clientv3.Config{Endpoints: []string{a.Addr}})
		if err != nil {
			return nil, nil, err
		}
		b, err := etcdlock.New(cli, nil)
		if err != nil {
			cli.Close()
			return nil, nil, err
		}
		return b, cli.Close, nil
	},
}

package torture

import (
	"context"
	"errors"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/redislock"
	"github.com/redis/go-redis/v9"
)

// redisLease is redislock on the Redis at Env.RedisAddr.
var redisLease = &Adapter{
	Name:      "redis-lease",
	Networked: true,
	Upstream:  addrUpstream("Redis", func(env *Env) string { return env.RedisAddr }),
	Prepare: func(ctx context.Context, env *Env) (string, error) {
		return "", errors.New("TODO")
	},
	Open: func(ctx context.Context, a OpenArgs) (dlock.Backend, func() error, error) {
		rdb := redis.NewClient(&redis.Options{Addr: a.Addr})
		b, err := redislock.New(rdb, &redislock.Options{Prefix: a.Store})
		if err != nil {
			rdb.Close()
			return nil, nil, err
		}
		return b, rdb.Close, nil
	},
}

module github.com/dlock-dev/dlock/zklock

go 1.26.0

replace github.com/dlock-dev/dlock => ../

require (
	github.com/dlock-dev/dlock v0.0.0-00010101000000-000000000000
	github.com/go-zookeeper/zk v1.0.4
	go.uber.org/goleak v1.3.0
)

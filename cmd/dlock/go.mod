module github.com/dlock-dev/dlock/cmd/dlock

go 1.26.0

require (
	github.com/dlock-dev/dlock v0.0.0
	github.com/dlock-dev/dlock/mysqllock v0.0.0
	github.com/dlock-dev/dlock/redislock v0.0.0
	github.com/dlock-dev/dlock/sqlitelock v0.0.0
)

require (
	filippo.io/edwards25519 v1.2.0 // indirect
	github.com/go-sql-driver/mysql v1.10.1 // indirect
	github.com/inconshreveable/mousetrap v1.1.0 // indirect
	github.com/spf13/cobra v1.10.2 // indirect
	github.com/spf13/pflag v1.0.9 // indirect
)

replace (
	github.com/dlock-dev/dlock => ../../
	github.com/dlock-dev/dlock/mysqllock => ../../mysqllock
	github.com/dlock-dev/dlock/redislock => ../../redislock
	github.com/dlock-dev/dlock/sqlitelock => ../../sqlitelock
)

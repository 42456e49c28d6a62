module github.com/dlock-dev/dlock/mysqllock

go 1.26.0

require (
	github.com/dlock-dev/dlock v0.1.0
	github.com/go-sql-driver/mysql v1.10.1
	go.uber.org/goleak v1.3.0
)

require filippo.io/edwards25519 v1.2.0 // indirect

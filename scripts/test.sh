#!/usr/bin/env bash
# Runs every check and test of every module: gofmt, go vet, staticcheck and
# go test -race (which replays every fuzz target's corpus; scripts/fuzz.sh
# fuzzes), including the fault harness's short run (torture) and
# internal/release's TestInstallAsAUser, which installs the modules from a file
# module proxy made from the tree as a user would (third-party modules come
# from the module cache or $GOPROXY). It starts
# the servers the tests need on loopback (MariaDB, PostgreSQL), installing
# them from Debian if absent, and installs redis-server, etcd and ZooKeeper,
# whose tests start their own servers. With CI=true a server that cannot be started
# is a failure, never a skip.
#
#   bash scripts/test.sh            # everything
#   bash scripts/test.sh -run Foo   # extra arguments go to `go test`
set -euo pipefail
cd "$(dirname "$0")/.."

STATICCHECK_VERSION=v0.8.2 # staticcheck 2026.2.2
export DLOCK_MYSQL_DSN="${DLOCK_MYSQL_DSN:-root@tcp(127.0.0.1:3306)/test}"

log() { printf '== %s\n' "$*" >&2; }
die() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

mysql_ok() { mysqladmin --connect-timeout=2 -h127.0.0.1 -P3306 -uroot ping >/dev/null 2>&1; }

start_mariadb() {
  if mysql_ok; then return 0; fi
  if [ ! -x /usr/sbin/mariadbd ]; then
    log "installing mariadb-server from Debian"
    as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mariadb-server >/dev/null
  fi
  log "starting MariaDB on 127.0.0.1:3306"
  as_root start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd -- --bind-address=127.0.0.1
  for _ in $(seq 60); do
    mysqladmin --connect-timeout=1 -uroot ping >/dev/null 2>&1 && break
    sleep 1
  done
  # A fresh Debian install lets root in only over the Unix socket: allow the
  # passwordless loopback login the tests use, and create their database.
  if ! mysql_ok; then
    as_root mariadb -uroot -e "ALTER USER root@localhost IDENTIFIED VIA mysql_native_password USING PASSWORD('') OR unix_socket" 2>/dev/null || true
  fi
  as_root mariadb -uroot -e "CREATE DATABASE IF NOT EXISTS test" 2>/dev/null || true
  mysql_ok
}

# The Galera tests start Galera MariaDB servers of their own (one node, and
# a three-node cluster whose joiners take their state by rsync).
if [ ! -f /usr/lib/galera/libgalera_smm.so ] || ! command -v rsync >/dev/null 2>&1; then
  log "installing galera-4 and rsync from Debian"
  as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq galera-4 rsync >/dev/null || true
fi

if ! start_mariadb; then
  if [ "${CI:-}" = true ]; then die "MariaDB is required and could not be started"; fi
  log "WARNING: no MariaDB; the MySQL tests will be skipped"
fi

# The Redis tests start their own redis-server processes on loopback; they
# need the binaries (redis-cli builds their cluster).
if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
  log "installing redis-server from Debian"
  as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools >/dev/null || true
fi
if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
  if [ "${CI:-}" = true ]; then die "redis-server and redis-cli are required"; fi
  log "WARNING: no redis-server; the Redis tests will be skipped"
fi

# PostgreSQL: the pglock tests use the server on 127.0.0.1:5432 (trust auth,
# database test), started here if it is not running.
pg_ok() { pg_isready -q -h 127.0.0.1 -p 5432 -t 2 >/dev/null 2>&1; }
start_postgres() {
  if pg_ok; then return 0; fi
  if ! command -v pg_ctlcluster >/dev/null 2>&1 || [ -z "$(ls /etc/postgresql 2>/dev/null)" ]; then
    log "installing postgresql from Debian"
    as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null || return 1
  fi
  local v
  v=$(ls /etc/postgresql | sort -V | tail -1)
  log "starting PostgreSQL $v on 127.0.0.1:5432"
  as_root pg_ctlcluster --skip-systemctl-redirect "$v" main start || true
  for _ in $(seq 60); do pg_ok && break; sleep 1; done
  # A fresh cluster allows only peer logins: trust loopback, as the tests
  # expect, and create their database.
  if pg_ok && ! psql -h 127.0.0.1 -U postgres -d test -c 'SELECT 1' >/dev/null 2>&1; then
    local hba="/etc/postgresql/$v/main/pg_hba.conf"
    if ! grep -q '^host all all 127.0.0.1/32 trust' "$hba"; then
      as_root sed -i '1i host all all 127.0.0.1/32 trust' "$hba"
      as_root pg_ctlcluster --skip-systemctl-redirect "$v" main reload || true
    fi
    as_root su postgres -c "createdb test" 2>/dev/null || true
  fi
  pg_ok
}
if ! start_postgres; then
  if [ "${CI:-}" = true ]; then die "PostgreSQL is required and could not be started"; fi
  log "WARNING: no PostgreSQL; the PostgreSQL tests will be skipped"
fi

# etcd and ZooKeeper: their tests start their own servers on loopback ports
# and need the binaries.
if ! command -v etcd >/dev/null 2>&1 || [ ! -x /usr/share/zookeeper/bin/zkServer.sh ]; then
  log "installing etcd-server and zookeeper from Debian"
  as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server zookeeper >/dev/null || true
fi
if ! command -v etcd >/dev/null 2>&1; then
  if [ "${CI:-}" = true ]; then die "etcd is required (apt-get install etcd-server)"; fi
  log "WARNING: no etcd; the etcd tests will be skipped"
fi
if [ ! -x /usr/share/zookeeper/bin/zkServer.sh ]; then
  if [ "${CI:-}" = true ]; then die "ZooKeeper is required (apt-get install zookeeper)"; fi
  log "WARNING: no ZooKeeper; the ZooKeeper tests will be skipped"
fi

# The fault harness partitions workers with network namespaces and
# nftables (as root).
if ! command -v nft >/dev/null 2>&1 || ! command -v ip >/dev/null 2>&1; then
  log "installing nftables and iproute2 from Debian"
  as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables iproute2 >/dev/null || true
fi

command -v staticcheck >/dev/null 2>&1 || [ -x "$(go env GOPATH)/bin/staticcheck" ] ||
  GOFLAGS= go install "honnef.co/go/tools/cmd/staticcheck@${STATICCHECK_VERSION}"
STATICCHECK="$(command -v staticcheck || echo "$(go env GOPATH)/bin/staticcheck")"

unformatted=$(gofmt -l .)
[ -z "$unformatted" ] || die "gofmt needed on: $unformatted"

status=0
for dir in $(go list -m -f '{{.Dir}}'); do
  log "module $(basename "$dir")"
  # Chained with &&: set -e does not apply inside a subshell whose status
  # is tested with ||, so a failing vet or staticcheck would pass unseen.
  (
    cd "$dir" &&
      go vet ./... &&
      "$STATICCHECK" ./... &&
      go test -race -count=1 -timeout 20m "$@" ./...
  ) || status=1
done
[ "$status" = 0 ] || die "some module failed"
log "all checks passed"

#!/usr/bin/env bash
# The fault harness's long run (torture/README.md): all nine strategies, TTL
# 1 s, kernel partitions, clocks off by ±2 %, and every client fault (caller
# deadlines on acquire and release, store pools of 1–3 connections, panics in
# Do; each worker holds up to two locks at once on its one Locker). It uses the MariaDB,
# PostgreSQL and Redis that scripts/test.sh starts (127.0.0.1:3306, :5432,
# :6379), and starts an etcd (50 ms heartbeat, 500 ms election timeout, so
# that 1 s leases exist) on 127.0.0.1:23790 and a ZooKeeper (200 ms tick,
# fsync off) on 127.0.0.1:21810 for the run, stopping them at the end. Run
# as root (partitions need network namespaces and nftables).
#
#   bash scripts/long-run.sh                       # 6 min per strategy + 1 min control: ~65 min
#   bash scripts/long-run.sh -duration 3m -control 20s   # flags are the harness's; later ones win
#   bash scripts/long-run.sh -client-faults none         # without client faults (as the runs of 11-23 and 11-25)
#
# The report goes to torture-out/<time>/ (summary.md, summary.json).
set -euo pipefail
cd "$(dirname "$0")/.."

# What the run needs from Debian, installed when missing (a fresh machine).
need=()
command -v nft >/dev/null 2>&1 || need+=(nftables)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
[ -e /usr/share/java/zookeeper.jar ] || need+=(zookeeper)
if ((${#need[@]})); then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

work=$(mktemp -d /tmp/dlock-long-run.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

etcd --name longrun --data-dir "$work/etcd" \
  --listen-client-urls http://127.0.0.1:23790 --advertise-client-urls http://127.0.0.1:23790 \
  --listen-peer-urls http://127.0.0.1:23800 --initial-advertise-peer-urls http://127.0.0.1:23800 \
  --initial-cluster longrun=http://127.0.0.1:23800 --initial-cluster-state new \
  --heartbeat-interval 50 --election-timeout 500 --log-level warn >"$work/etcd.log" 2>&1 &
pids+=($!)

jars=(zookeeper zookeeper-jute slf4j-api slf4j-nop netty-handler netty-transport netty-common
  netty-buffer netty-resolver netty-codec netty-transport-native-epoll
  netty-transport-native-unix-common commons-io commons-cli metrics-core snappy-java)
cp=$(printf '/usr/share/java/%s.jar:' "${jars[@]}")
mkdir -p "$work/zk"
cat >"$work/zoo.cfg" <<EOF
tickTime=200
initLimit=20
syncLimit=5
dataDir=$work/zk
clientPort=21810
clientPortAddress=127.0.0.1
admin.enableServer=false
4lw.commands.whitelist=srvr,ruok,wchp,wchc,cons
minSessionTimeout=1000
maxSessionTimeout=60000
EOF
java -Xmx256m -XX:+UseSerialGC -Dzookeeper.forceSync=no -Dzookeeper.admin.enableServer=false \
  -cp "${cp%:}" org.apache.zookeeper.server.quorum.QuorumPeerMain "$work/zoo.cfg" >"$work/zk.log" 2>&1 &
pids+=($!)

for _ in $(seq 60); do
  curl -fsS http://127.0.0.1:23790/health 2>/dev/null | grep -q '"health":"true"' &&
    echo srvr | timeout 1 bash -c 'exec 3<>/dev/tcp/127.0.0.1/21810; cat >&3; cat <&3' 2>/dev/null | grep -q Mode && break
  sleep 1
done

go run ./torture/cmd/dlock-torture -netns -duration 6m -control 1m -workers 12 -keys 24 \
  -long-frac 0.03 -fault-every 1s -seed 7 -clock-skew 0.02 -client-faults all \
  -etcd 127.0.0.1:23790 -zk 127.0.0.1:21810 -zk-data-dir "$work/zk" "$@"

#!/usr/bin/env bash
# The fault harness's failover runs (docs/faults.md, "Failovers"): for each
# replicated store, the harness starts a cluster of its own on loopback
# (ports and data directories of its own, under the output directory or a
# temporary one), runs the store's strategies on it for 2 minutes with every
# holder and client fault, and fails it over every 15 s. The asynchronous
# configurations are positive controls: they are expected to fail. Needs
# the MariaDB (the resource) that scripts/test.sh starts, and the Debian
# packages of each store (installed when missing). Run as root (PostgreSQL's
# servers run as the postgres user; Galera's joiners as nobody).
#
#   bash scripts/failover-runs.sh                    # every kind: about 45 min
#   bash scripts/failover-runs.sh pg-sync etcd-3     # some kinds
#   FLAGS='-duration 30s' bash scripts/failover-runs.sh zk-3   # other harness flags
#
# Reports go to torture-out/failover-<time>/<kind>/ (summary.md, summary.json).
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
[ -e /usr/share/java/zookeeper.jar ] || need+=(zookeeper)
[ -e /usr/lib/galera/libgalera_smm.so ] || need+=(galera-4)
command -v rsync >/dev/null 2>&1 || need+=(rsync)
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
if ((${#need[@]})); then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

kinds=("$@")
if ((${#kinds[@]} == 0)); then
  kinds=(etcd-3 etcd-3-pause etcd-3-cut zk-3 zk-3-pause zk-3-cut galera-3 galera-3-isolate pg-sync pg-async mariadb-semisync mariadb-async
    redis-minreplicas redis-async)
fi
out="torture-out/failover-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$out"
status=0
for k in "${kinds[@]}"; do
  tag="fo${k//-/}"
  # shellcheck disable=SC2086 # FLAGS is a list of flags
  go run ./torture/cmd/dlock-torture -failover "$k" -duration 2m -failover-every 15s -control 0 \
    -seed 1128 -tag "${tag:0:16}" -out "$out/$k" ${FLAGS:-} >"$out/$k.md" || status=1
  echo "== $k: $(head -1 "$out/$k.md")"
done
exit "$status"

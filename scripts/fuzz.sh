#!/usr/bin/env bash
# Runs each fuzz target for a while (default 60s each; the first argument
# overrides, e.g. `bash scripts/fuzz.sh 10m`). A failing input is written to
# the target's testdata/fuzz directory: commit it with the fix, and every
# later `go test` (hence scripts/test.sh) replays it. scripts/test.sh runs
# the seed corpora only, so that its outcome does not depend on luck.
set -euo pipefail
cd "$(dirname "$0")/.."
fuzztime="${1:-60s}"
status=0
for target in .:FuzzValidateKey .:FuzzAcquireOptions cmd/dlock:FuzzParseStore cmd/dlock:FuzzParseStoreRaw cmd/dlock:FuzzArgs; do
  printf '== fuzz %s for %s\n' "${target#*:}" "$fuzztime" >&2
  (cd "${target%%:*}" && go test -run '^$' -fuzz "^${target#*:}\$" -fuzztime "$fuzztime" .) || status=1
done
exit "$status"

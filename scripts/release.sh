#!/usr/bin/env bash
# Prepares release VERSION of every module users install, locally: it never
# pushes.
#
#   bash scripts/release.sh v0.1.0
#
# 1. Checks that the tree is clean, that CHANGELOG.md has a "## VERSION"
#    section and that none of the tags exists yet.
# 2. Sets every go.mod's requirements on its siblings to VERSION (no replace
#    directives) and go.work's replaces to VERSION, with
#    internal/release/cmd/dlock-release.
# 3. Checks gofmt, and go build and go vet in every module of the workspace;
#    then TestInstallAsAUser installs the modules from a file module proxy
#    made from the tree, as users will (`go get …/mysqllock@VERSION`, `go
#    install …/cmd/dlock@VERSION`, GOWORK=off).
# 4. Commits the go.mod/go.work changes, if any, as "release: VERSION".
# 5. Creates one annotated tag per published module, named as the go command
#    expects in a multi-module repository: VERSION for the root module,
#    DIR/VERSION for the module in DIR (mysqllock/v0.1.0, cmd/dlock/v0.1.0, …).
#
# It prints the `git push` command that publishes the release.
set -euo pipefail
cd "$(dirname "$0")/.."

die() { printf 'release: %s\n' "$*" >&2; exit 1; }
log() { printf '== %s\n' "$*" >&2; }

[ $# = 1 ] || die "usage: scripts/release.sh VERSION (e.g. v0.1.0)"
VERSION=$1
[[ $VERSION =~ ^v[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?$ ]] || die "VERSION must look like v1.2.3, got '$VERSION'"

[ -z "$(git status --porcelain)" ] || die "the working tree has uncommitted or untracked changes; commit or stash them first"
grep -q "^## \[\?${VERSION//./\\.}\]\?\( \|$\)" CHANGELOG.md || die "CHANGELOG.md has no '## $VERSION' section"

release_tool() { go run ./internal/release/cmd/dlock-release "$@"; }

mapfile -t modules < <(release_tool modules)
tags=()
for dir in "${modules[@]}"; do
  if [ "$dir" = . ]; then tag=$VERSION; else tag=$dir/$VERSION; fi
  git rev-parse -q --verify "refs/tags/$tag" >/dev/null && die "tag $tag exists already"
  tags+=("$tag")
done

log "setting every module's requirements on its siblings to $VERSION"
release_tool set-version "$VERSION"

log "checking gofmt, go build and go vet in every module"
unformatted=$(gofmt -l .)
[ -z "$unformatted" ] || die "gofmt needed on: $unformatted"
for dir in $(go list -m -f '{{.Dir}}'); do
  (cd "$dir" && go build ./... && go vet ./...) || die "module $dir does not build or vet"
done

log "installing from a module proxy made from the tree, as a user would"
(cd internal/release && go test -count=1 -run '^(TestInstallAsAUser|TestTreeIsReleasable|TestEveryModuleIsListed)$' .) ||
  die "the install test failed"

if [ -n "$(git status --porcelain)" ]; then
  log "committing the requirements"
  git add -u -- go.work go.work.sum '*go.mod' '*go.sum'
  [ -z "$(git status --porcelain)" ] || die "set-version changed files other than go.mod, go.sum and go.work: $(git status --porcelain)"
  git commit -q -m "release: $VERSION" -m "Every module requires its siblings at $VERSION."
fi

for tag in "${tags[@]}"; do
  git tag -a "$tag" -m "dlock $tag"
  log "tagged $tag"
done
printf '\nTagged %s. Nothing was pushed; to publish:\n  git push origin HEAD %s\n' \
  "$(git rev-parse --short HEAD)" "${tags[*]}"

#!/usr/bin/env bash
# Builds the pinned helm (go.mod: helm.sh/helm/v4) from the Go module proxy into a
# cache outside the clone, keyed by its version, so only the first run on a machine
# pays for the build. Debian 12 packages no helm; the chart in deploy/helm/castellan
# is linted, rendered and checked with this one (tests/helm.rs, make manifests).
# Prints the path of the helm binary on stdout; progress goes to stderr.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
version="$(awk '{ for (i = 1; i < NF; i++) if ($i == "helm.sh/helm/v4") { print $(i + 1); exit } }' "$here/go.mod")"
[[ -n $version ]] || { echo "build.sh: no helm.sh/helm/v4 version in $here/go.mod" >&2; exit 1; }
cache_root="${CASTELLAN_CACHE:-/var/cache/castellan}"
out="$cache_root/helm-$version"

if [[ -x "$out/helm" ]]; then
  echo "$out/helm"
  exit 0
fi

if ! command -v go >/dev/null && [[ -x /usr/local/go/bin/go ]]; then PATH="/usr/local/go/bin:$PATH"; fi
command -v go >/dev/null || { echo "build.sh: the Go toolchain is required (go not on PATH)" >&2; exit 1; }
mkdir -p "$out"
tmp="$(mktemp -d "$out/../build-helm.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

cd "$here"
echo "building helm $version into $out (first run only; a few minutes on 2 cores)" >&2
# The version the way helm's own Makefile stamps a release (`helm version` shows it).
ldflags="-s -w -X helm.sh/helm/v4/internal/version.version=$version -X helm.sh/helm/v4/internal/version.gitTreeState=clean"
if ! CGO_ENABLED=0 go build -mod=readonly -trimpath -ldflags "$ldflags" -o "$tmp/helm" helm.sh/helm/v4/cmd/helm; then
  echo "build.sh: building helm $version failed (see the go output above)" >&2
  exit 1
fi
"$tmp/helm" version --short >&2 || { echo "build.sh: the built helm does not run" >&2; exit 1; }
mv "$tmp/helm" "$out/helm"
echo "$out/helm"

#!/usr/bin/env bash
# Builds the pinned minimal OpenTelemetry Collector (main.go: OTLP receiver, file and
# debug exporters) from the Go module proxy into a cache outside the clone, keyed by
# the collector release, so only the first run on a machine pays for the build.
# Prints the path of the otelcol binary on stdout; progress goes to stderr.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
version="$(awk '$1 == "go.opentelemetry.io/collector/otelcol" { print $2; exit }' "$here/go.mod")"
[[ -n $version ]] || { echo "build.sh: no go.opentelemetry.io/collector/otelcol version in $here/go.mod" >&2; exit 1; }
cache_root="${CASTELLAN_CACHE:-/var/cache/castellan}"
out="$cache_root/otelcol-$version"

if [[ -x "$out/otelcol" ]]; then
  echo "$out/otelcol"
  exit 0
fi

if ! command -v go >/dev/null && [[ -x /usr/local/go/bin/go ]]; then PATH="/usr/local/go/bin:$PATH"; fi
command -v go >/dev/null || { echo "build.sh: the Go toolchain is required (go not on PATH)" >&2; exit 1; }
mkdir -p "$out"
tmp="$(mktemp -d "$out/../build-otelcol.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

cd "$here"
echo "building otelcol $version into $out (first run only; a few minutes on 2 cores)" >&2
if ! CGO_ENABLED=0 go build -mod=readonly -trimpath -ldflags "-s -w" -o "$tmp/otelcol" .; then
  echo "build.sh: building the OpenTelemetry Collector $version failed (see the go output above)" >&2
  exit 1
fi
"$tmp/otelcol" --version >&2 || { echo "build.sh: the built otelcol does not run" >&2; exit 1; }
mv "$tmp/otelcol" "$out/otelcol"
echo "$out/otelcol"

#!/usr/bin/env bash
# Builds the pinned S3-compatible server for the local cluster (s3s-fs: a real S3 server
# over a directory, from the Rust registry) into a cache outside the clone, keyed by its
# version, so only the first run on a machine pays for the build. docs/operations.md
# says why this server and not Garage or MinIO.
# Prints the path of the s3s-fs binary on stdout; progress goes to stderr.
set -euo pipefail

# 0.14.1 is the newest release whose rust-version (1.92) this machine's Rust meets;
# 0.15 and later need 1.96.
version=0.14.1
cache_root="${CASTELLAN_CACHE:-/var/cache/castellan}"
out="$cache_root/s3s-fs-$version"

if [[ -x "$out/s3s-fs" ]]; then
  echo "$out/s3s-fs"
  exit 0
fi

command -v cargo >/dev/null || { echo "build.sh: cargo is required (not on PATH)" >&2; exit 1; }
mkdir -p "$out"
tmp="$(mktemp -d "$out/../build-s3s-fs.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

echo "building s3s-fs $version into $out (first run only; 4 to 7 minutes on 2 cores)" >&2
# --locked: the crate's own Cargo.lock, so every machine builds the same dependencies.
# Its own target directory (removed afterwards) keeps the workspace's target untouched,
# and the build runs outside the clone so that no workspace setting applies to it.
# The binary lands in a temporary root and is moved into place only once it runs, so a
# half-finished build never looks cached.
if ! (cd "$tmp" && CARGO_TARGET_DIR="$tmp/target" nice cargo install --quiet --locked \
  --version "$version" --features binary --root "$tmp/root" s3s-fs); then
  echo "build.sh: building s3s-fs $version failed (see the cargo output above)" >&2
  exit 1
fi
"$tmp/root/bin/s3s-fs" --version >&2 || { echo "build.sh: the built s3s-fs does not run" >&2; exit 1; }
mv "$tmp/root/bin/s3s-fs" "$out/s3s-fs"
echo "$out/s3s-fs"

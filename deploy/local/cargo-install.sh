#!/usr/bin/env bash
# Builds a pinned binary crate from the Rust registry into a cache outside the clone,
# keyed by its version, so only the first run on a machine pays for the build, and
# prints the binary's path on stdout (progress on stderr). Used by deploy/s3/build.sh
# (the S3 server) and deploy/deny/build.sh (cargo-deny).
#
#   cargo-install.sh CRATE VERSION MINUTES [cargo install options…]
#
# MINUTES is only what the first build is announced to take.
set -euo pipefail

crate="$1" version="$2" minutes="$3"
shift 3
cache_root="${CASTELLAN_CACHE:-/var/cache/castellan}"
out="$cache_root/$crate-$version"

if [[ -x "$out/$crate" ]]; then
  echo "$out/$crate"
  exit 0
fi

command -v cargo >/dev/null || { echo "cargo-install: cargo is required (not on PATH)" >&2; exit 1; }
mkdir -p "$out"
tmp="$(mktemp -d "$out/../build-$crate.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

echo "building $crate $version into $out (first run only; $minutes minutes on 2 cores)" >&2
# --locked: the crate's own Cargo.lock, so every machine builds the same dependencies.
# Its own target directory (removed afterwards) keeps the workspace's target untouched,
# and the build runs outside the clone so that no workspace setting applies to it.
# The binary lands in a temporary root and is moved into place only once it runs, so a
# half-finished build never looks cached.
if ! (cd "$tmp" && CARGO_TARGET_DIR="$tmp/target" nice cargo install --quiet --locked \
  --version "$version" --root "$tmp/root" "$@" "$crate"); then
  echo "cargo-install: building $crate $version failed (see the cargo output above)" >&2
  exit 1
fi
"$tmp/root/bin/$crate" --version >&2 || { echo "cargo-install: the built $crate does not run" >&2; exit 1; }
mv "$tmp/root/bin/$crate" "$out/$crate"
echo "$out/$crate"

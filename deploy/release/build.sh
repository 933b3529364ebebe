#!/usr/bin/env bash
# The release build of the castellan binaries (castellan, castellan-operator,
# castellan-agent): what `make images` puts in the images and the benchmarks measure.
# glibc is linked in statically (crt-static): as shared libraries, libc, libm and the
# loader were 1.6 to 2.1 MiB of every process' resident memory, most of it code that
# Castellan never calls. Name lookups still work: glibc 2.36 has the `files` and `dns`
# sources of nsswitch.conf inside its static libc (the images' nsswitch.conf names
# those two only); any other source would be loaded as a shared library of the same
# glibc at run time.
#
# crt-static must not reach the proc-macros and build scripts, which are shared
# libraries or run on the build machine, so the build names its target explicitly:
# the binaries go to $CARGO_TARGET_DIR/<host triple>/release, not .../release.
#
# Usage: build.sh [--dir] [cargo build arguments]. Prints the directory the binaries
# are in on stdout; cargo's output goes to stderr. With --dir it only prints it.
set -euo pipefail

host="$(rustc -vV | sed -n 's/^host: //p')"
[[ -n $host ]] || { echo "release/build.sh: rustc -vV names no host triple" >&2; exit 1; }
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-${CASTELLAN_CACHE:-/var/cache/castellan}/target}"
dir="$CARGO_TARGET_DIR/$host/release"
if [[ ${1:-} == --dir ]]; then
  echo "$dir"
  exit 0
fi
cd "$(dirname "$0")/../.."
RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+crt-static" \
  cargo build --release --target "$host" -p castellan --bins "$@" >&2
echo "$dir"

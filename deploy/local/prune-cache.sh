#!/usr/bin/env bash
# Keeps the build cache (CARGO_TARGET_DIR) from filling the disk. Cargo never removes
# what it built: every edit leaves another incremental session per test binary, and a
# second clone (CI's) builds its own copies beside ours. Measured here: 66 GiB after a
# few weeks, which filled the disk in the middle of a `make test`. Incremental state is
# only a speed-up, so it is what goes first; the dependency builds stay.
#   CASTELLAN_CACHE_LIMIT_GB  target size above which incremental state is removed (40)
#   CASTELLAN_MIN_FREE_GB     free space below which it is removed whatever the size (20)
set -euo pipefail

target=${CARGO_TARGET_DIR:?CARGO_TARGET_DIR is not set}
[[ -d $target ]] || exit 0
limit_gb=${CASTELLAN_CACHE_LIMIT_GB:-40}
min_free_gb=${CASTELLAN_MIN_FREE_GB:-20}

size_gb=$(( $(du -sxk "$target" | cut -f1) / 1024 / 1024 ))
free_gb=$(( $(df -Pk "$target" | awk 'NR == 2 {print $4}') / 1024 / 1024 ))
if (( size_gb <= limit_gb && free_gb >= min_free_gb )); then
  exit 0
fi
echo "prune-cache: $target holds ${size_gb} GiB, ${free_gb} GiB free: removing incremental build state" >&2
rm -rf "$target"/*/incremental
if (( $(du -sxk "$target" | cut -f1) / 1024 / 1024 > limit_gb )); then
  # Still too big: stale dependency builds from old lock files; a full rebuild is
  # cheaper than a full disk.
  echo "prune-cache: still above ${limit_gb} GiB: removing the whole build cache" >&2
  rm -rf "$target"
fi

#!/usr/bin/env bash
# Lays the offline RustSec advisory database out where cargo-deny reads it, and prints
# that root (deny.toml's db-path, $CASTELLAN_CACHE/advisory-dbs).
#
# The database cannot be fetched here: the steering repository ships a snapshot
# (../shared/advisory-db beside the clone, a plain tree with SNAPSHOT.md naming its
# upstream commit and date). cargo-deny opens a database only as a git checkout, in a
# directory named after the database's URL (`advisory-db-` and the XxHash64, seed
# 0xca80de71, of https://github.com/rustsec/advisory-db, as its url_to_db_path), and
# judges its age by the checkout's HEAD commit: so the snapshot is committed there with
# the snapshot's own date, never today's, and a stale snapshot shows as stale.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
source_dir="${CASTELLAN_ADVISORY_DB:-$repo/../shared/advisory-db}"
root="${CASTELLAN_CACHE:-/var/cache/castellan}/advisory-dbs"
db="$root/advisory-db-3157b0e258782691"

[[ -f "$source_dir/SNAPSHOT.md" ]] || {
  echo "advisory-db: no advisory database snapshot at $source_dir (set CASTELLAN_ADVISORY_DB to one)" >&2
  exit 1
}
command -v git >/dev/null || { echo "advisory-db: git is required (not on PATH)" >&2; exit 1; }
commit="$(grep -oE '\b[0-9a-f]{40}\b' "$source_dir/SNAPSHOT.md" | head -1)"
date="$(grep -oE '\b[0-9]{4}-[0-9]{2}-[0-9]{2}\b' "$source_dir/SNAPSHOT.md" | head -1)"
[[ -n "$commit" && -n "$date" ]] || {
  echo "advisory-db: $source_dir/SNAPSHOT.md names no upstream commit and date" >&2
  exit 1
}

if [[ "$(cat "$db/.castellan-snapshot" 2>/dev/null)" != "$commit" ]]; then
  echo "advisory-db: laying out snapshot $commit of $date in $db" >&2
  rm -rf "$db"
  mkdir -p "$root"
  tmp="$(mktemp -d "$root/.snapshot.XXXXXX")"
  trap 'rm -rf "$tmp"' EXIT
  cp -R "$source_dir/." "$tmp/"
  # A commit of the snapshot as it is, dated as the snapshot.
  (
    cd "$tmp"
    export GIT_AUTHOR_NAME=castellan GIT_AUTHOR_EMAIL=castellan@localhost \
      GIT_COMMITTER_NAME=castellan GIT_COMMITTER_EMAIL=castellan@localhost \
      GIT_AUTHOR_DATE="${date}T00:00:00Z" GIT_COMMITTER_DATE="${date}T00:00:00Z"
    git init --quiet --initial-branch=main
    git add --all
    git commit --quiet --no-gpg-sign -m "RustSec advisory-db snapshot $commit ($date)"
  )
  echo "$commit" > "$tmp/.castellan-snapshot"
  mv "$tmp" "$db"
  trap - EXIT
fi
echo "$root"

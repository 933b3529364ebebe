#!/usr/bin/env bash
# The mmdebstrap hooks below are shell text that mmdebstrap runs, "$1" its new root:
# shellcheck disable=SC2016
# Builds Castellan's container images as OCI archives, without a container daemon:
#
#   castellan   ghcr.io/castellan-io/castellan:<version>       operator, node agent, and the
#                                                              instance manager with PostgreSQL 15
#                                                              (the image today's operator gives
#                                                              database pods)
#   pg15        ghcr.io/castellan-io/castellan:<version>-pg15  instance image, PostgreSQL 15
#   pg18        ghcr.io/castellan-io/castellan:<version>-pg18  instance image, PostgreSQL 18
#
# Usage: deploy/images/build.sh [--base-only] [castellan|pg15|pg18 ...]   (default: all)
#
# Each image has two layers. The first is a Debian root filesystem made by mmdebstrap
# from Debian's packages (bookworm for castellan and pg15; forky, Debian's testing, for
# pg18: the only suite served here with postgresql-18, built with OpenSSL and the whole
# tool set). It depends only on this directory and the archive, so it is built once and
# kept under $CASTELLAN_CACHE/images/base/ (--base-only builds just these, so that a
# caller can make them while the binary compiles). The second layer is the castellan
# binary at /usr/local/bin/castellan (its debug info stripped), and in the castellan
# image also castellan-operator and castellan-agent from beside it (the roles' own
# binaries, which `castellan operator|agent` execute: src/lib.rs, Role); the image
# config sets the entrypoint, user, PATH and labels. umoci (Debian's package) writes the OCI layout.
#
# Reproducible: every timestamp is SOURCE_DATE_EPOCH (default: the time of the last
# commit that touched this directory), mmdebstrap makes the same tarball from the same
# package versions, and the tars are written sorted with fixed owners. The package
# versions that went in are in <name>.packages beside each archive and in the image's
# /var/lib/dpkg/status, the main ones in its labels. A package that cannot be installed
# or a program the processes run that is missing fails the build.
#
# Input:  CASTELLAN_BINARY (default: the release build, deploy/release/build.sh --dir),
#         CASTELLAN_CACHE (/var/cache/castellan), CASTELLAN_DEBIAN_MIRROR,
#         CASTELLAN_DEBIAN_SECURITY_MIRROR, SOURCE_DATE_EPOCH.
# Output: $CASTELLAN_IMAGES_OUT (default $CASTELLAN_CACHE/images/<profile of the binary>)
#         holds <name>.oci.tar, <name>.digest (the manifest's), <name>.ref (the image
#         name) and <name>.packages; the archives' paths are printed on stdout, one a
#         line, progress goes to stderr. An archive whose inputs (base layer, binary,
#         this script) are unchanged is not rebuilt.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache_root="${CASTELLAN_CACHE:-/var/cache/castellan}"
binary="${CASTELLAN_BINARY:-$("$here/../release/build.sh" --dir)/castellan}"
mirror="${CASTELLAN_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
security_mirror="${CASTELLAN_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
base_root="$cache_root/images/base"
apt_cache="$cache_root/images/apt"

fail() { echo "images: $*" >&2; exit 1; }
# Work directories, removed however the script ends.
scratch=()
trap 'rm -rf "${scratch[@]}"' EXIT

base_only=0
names=()
for arg in "$@"; do
  case "$arg" in
    --base-only) base_only=1 ;;
    castellan | pg15 | pg18) names+=("$arg") ;;
    *) fail "unknown argument '$arg' (expected --base-only, castellan, pg15 or pg18)" ;;
  esac
done
((${#names[@]})) || names=(castellan pg15 pg18)

for tool in mmdebstrap umoci objcopy readelf sha256sum flock; do
  command -v "$tool" >/dev/null || fail "$tool is required and not on PATH (deploy/local/deps.sh installs it)"
done
[[ $(id -u) == 0 ]] || fail "mmdebstrap needs root here (it builds in root mode, chowning files to their owners)"

if [[ -z ${SOURCE_DATE_EPOCH:-} ]]; then
  SOURCE_DATE_EPOCH="$(git -C "$here" log -1 --format=%ct -- . 2>/dev/null || true)"
  [[ -n $SOURCE_DATE_EPOCH ]] || fail "set SOURCE_DATE_EPOCH (no git history for $here to take it from)"
fi
export SOURCE_DATE_EPOCH
created="$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)"

bookworm_sources=(
  "deb $mirror bookworm main"
  "deb $mirror bookworm-updates main"
  "deb $security_mirror bookworm-security main"
)
# Every image: the binary's own libraries (glibc and libgcc_s: assemble checks its
# NEEDED entries against the layer) and the CA bundle for S3 and OTLP.
common_packages=(libc6 libgcc-s1 ca-certificates)
# What src/instance runs (Binaries::run and the postmaster), and pg_upgrade for majors.
postgres_programs=(postgres initdb pg_ctl pg_isready pg_basebackup pg_receivewal pg_controldata pg_rewind pg_upgrade psql)

# Sets the recipe of image $1: suite, sources, packages, programs that must be on PATH,
# PATH, image config.
recipe() {
  apt_options=()
  case "$1" in
    castellan)
      suite=bookworm sources=("${bookworm_sources[@]}")
      # What src/agent runs: btrfs and mkfs.btrfs, wipefs/blkid/lsblk/nsenter
      # (util-linux), mount/umount, mkdir. And PostgreSQL 15 on PATH: today's operator
      # starts every database pod from this image at its own tag
      # (src/operator/build.rs IMAGE, CASTELLAN_IMAGE_TAG), as deploy/node/images.yaml
      # mirrors for the local cluster.
      packages=("${common_packages[@]}" btrfs-progs util-linux mount postgresql-15)
      programs=(btrfs mkfs.btrfs wipefs blkid lsblk nsenter mount umount mkdir "${postgres_programs[@]}")
      path=/usr/lib/postgresql/15/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
      # Root by default: the agent (privileged) needs it; the operator's Deployment
      # sets runAsUser 65532, database pods 26.
      user=0:0 cmd=() title="Castellan operator, node agent and instance manager with PostgreSQL 15" postgres_package=postgresql-15
      ;;
    pg15)
      suite=bookworm sources=("${bookworm_sources[@]}")
      packages=("${common_packages[@]}" postgresql-15)
      programs=("${postgres_programs[@]}")
      path=/usr/lib/postgresql/15/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
      user=26:26 cmd=(instance) title="Castellan instance manager with PostgreSQL 15" postgres_package=postgresql-15
      ;;
    pg18)
      # Debian's testing as the archive serves it here: its Release file stopped
      # being refreshed (Valid-Until passed), so that check is off; the signature is
      # still verified.
      suite=forky sources=("deb $mirror forky main")
      apt_options=(--aptopt='Acquire::Check-Valid-Until "false"')
      packages=("${common_packages[@]}" postgresql-18)
      programs=("${postgres_programs[@]}")
      path=/usr/lib/postgresql/18/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
      user=26:26 cmd=(instance) title="Castellan instance manager with PostgreSQL 18" postgres_package=postgresql-18
      ;;
  esac
}

# The base layer's key: everything it is made from that this side can see (the code
# of the two functions that make it, not the rest of this file: changing how images
# are assembled does not rebuild their Debian layers).
base_key() {
  recipe "$1"
  {
    declare -f recipe build_base
    cat "$here/users.sh"
    printf '%s\n' "$1" "$suite" "${sources[@]}" "${packages[@]}" "${programs[@]}" "$SOURCE_DATE_EPOCH"
  } | sha256sum | cut -c1-16
}

# Builds (once) the OCI layout holding image $1's Debian layer, tagged `base`; sets
# base_dir to it.
build_base() {
  local name="$1" key tmp
  key="$(base_key "$name")"
  base_dir="$base_root/$name-$key"
  if [[ -f $base_dir/done ]]; then return; fi
  recipe "$name"
  mkdir -p "$base_root" "$apt_cache/$suite"
  tmp="$(mktemp -d "$base_root/build-$name.XXXXXX")"
  scratch+=("$tmp")
  echo "images: building the $suite layer of $name (${packages[*]})" >&2
  # The essential variant plus the packages: no apt, no init. The apt cache is kept
  # between builds (mmdebstrap's documented sync-in/sync-out), so that only the first
  # build downloads. Documentation is left out, copyright files kept. The clusters
  # that postgresql-common creates on install are removed: the data directory is a
  # volume the instance manager initialises. So is the "snakeoil" key pair ssl-cert
  # generates on install: random (the one difference between two builds), a private
  # key shared by every container, and unused (certificates come from Secrets).
  if ! mmdebstrap --quiet --variant=essential --include="$(IFS=,; echo "${packages[*]}")" \
    "${apt_options[@]}" \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --skip=download/empty \
    --setup-hook='mkdir -p "$1"/var/cache/apt/archives' \
    --setup-hook="sync-in '$apt_cache/$suite' /var/cache/apt/archives" \
    --essential-hook="$here/users.sh" \
    --customize-hook="sync-out /var/cache/apt/archives '$apt_cache/$suite'" \
    --customize-hook='rm -rf "$1"/var/lib/postgresql/*/main "$1"/etc/postgresql/*/main' \
    --customize-hook='rm -f "$1"/etc/ssl/certs/ssl-cert-snakeoil.pem "$1"/etc/ssl/private/ssl-cert-snakeoil.key' \
    --customize-hook="chroot \"\$1\" env PATH='$path' sh -c 'for p; do command -v \"\$p\" >/dev/null || { echo \"missing program: \$p\" >&2; exit 1; }; done' programs ${programs[*]}" \
    --customize-hook="chroot \"\$1\" dpkg-query -W -f '\${Package}\t\${Version}\n' >'$tmp/packages'" \
    --customize-hook="cd \"\$1\" && find . -path ./proc -prune -o -print >'$tmp/files'" \
    "$suite" "$tmp/rootfs.tar" "${sources[@]}" >&2; then
    fail "mmdebstrap could not build the $suite layer of $name (packages: ${packages[*]}); see above"
  fi
  umoci init --layout "$tmp/oci"
  umoci new --image "$tmp/oci:base"
  umoci raw add-layer --image "$tmp/oci:base" --history.created="$created" \
    --history.created_by="mmdebstrap --variant=essential $suite ${packages[*]}" "$tmp/rootfs.tar"
  rm "$tmp/rootfs.tar"
  touch "$tmp/done"
  rm -rf "$base_dir"
  mv "$tmp" "$base_dir"
  # Layers of this image from older recipes are never used again.
  find "$base_root" -maxdepth 1 -name "$name-*" ! -path "$base_dir" -exec rm -rf {} +
}

# Makes image $1's archive from its base layout and the binary, unless it is current.
assemble() {
  local name="$1" base="$2" out="$3" version="$4" tag ref key work soname postgres_version program
  recipe "$name"
  case "$name" in castellan) tag="$version" ;; *) tag="$version-$name" ;; esac
  ref="ghcr.io/castellan-io/castellan:$tag"
  local programs=("$binary")
  if [[ $name == castellan ]]; then
    for program in castellan-operator castellan-agent; do
      [[ -x $(dirname "$binary")/$program ]] || fail "$name: no $program beside $binary (cargo build builds it with castellan)"
      programs+=("$(dirname "$binary")/$program")
    done
  fi
  key="$({ echo "$base" "$tag"; sha256sum "${programs[@]}"; cat "$here/build.sh"; } | sha256sum | cut -c1-16)"
  if [[ -f $out/$name.oci.tar && $(cat "$out/$name.key" 2>/dev/null) == "$key" ]]; then
    echo "$out/$name.oci.tar"
    return
  fi
  # Every library the binaries need must be in the Debian layer.
  for soname in $(for program in "${programs[@]}"; do readelf -d "$program"; done | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | sort -u); do
    grep -q "/$soname\$" "$base/files" || fail "$name: the binaries need $soname, which no package of the $suite layer provides"
  done
  postgres_version=""
  if [[ -n $postgres_package ]]; then
    postgres_version="$(awk -v p="$postgres_package" '$1 == p { print $2 }' "$base/packages")"
    [[ -n $postgres_version ]] || fail "$name: $postgres_package is not in the $suite layer"
  fi
  work="$(mktemp -d "$out/assemble-$name.XXXXXX")"
  scratch+=("$work")
  # Blobs are content-addressed and never rewritten: hard links save copying them.
  mkdir "$work/oci" "$work/layer"
  cp "$base/oci/index.json" "$base/oci/oci-layout" "$work/oci/"
  cp -al "$base/oci/blobs" "$work/oci/blobs"
  install -d -m 0755 "$work/layer/usr" "$work/layer/usr/local" "$work/layer/usr/local/bin"
  objcopy --strip-debug "$binary" "$work/layer/usr/local/bin/castellan"
  for program in "${programs[@]:1}"; do
    objcopy --strip-debug "$program" "$work/layer/usr/local/bin/$(basename "$program")"
  done
  chmod 0755 "$work/layer/usr/local/bin/"*
  reproducible_tar -C "$work/layer" -cf "$work/castellan.tar" usr
  umoci raw add-layer --image "$work/oci:base" --tag "$tag" --history.created="$created" \
    --history.created_by="castellan $version at /usr/local/bin/castellan" "$work/castellan.tar"
  umoci rm --image "$work/oci:base"
  local config=(
    --created="$created" --author="Castellan" --os=linux --architecture=amd64
    --config.entrypoint=/usr/local/bin/castellan --config.user="$user"
    --config.env="PATH=$path" --config.workingdir=/
    --config.label="org.opencontainers.image.title=$title"
    --config.label="org.opencontainers.image.version=$tag"
    --config.label="org.opencontainers.image.created=$created"
    --config.label="io.castellan.debian.suite=$suite"
  )
  for c in "${cmd[@]}"; do config+=(--config.cmd="$c"); done
  [[ -z $postgres_version ]] || config+=(--config.label="io.castellan.postgresql.version=$postgres_version")
  umoci config --image "$work/oci:$tag" --no-history "${config[@]}"
  umoci gc --layout "$work/oci"
  reproducible_tar -C "$work/oci" -cf "$work/image.tar" oci-layout index.json blobs
  mv "$work/image.tar" "$out/$name.oci.tar"
  grep -o '"digest":"sha256:[0-9a-f]*"' "$work/oci/index.json" | cut -d'"' -f4 >"$out/$name.digest"
  echo "$ref" >"$out/$name.ref"
  cp "$base/packages" "$out/$name.packages"
  echo "$key" >"$out/$name.key"
  echo "images: $ref ($(cat "$out/$name.digest"), $(du -m "$out/$name.oci.tar" | cut -f1) MB) in $out/$name.oci.tar" >&2
  echo "$out/$name.oci.tar"
}

# tar with nothing of the machine or the moment in it (reproducible-builds.org's recipe).
reproducible_tar() {
  tar --sort=name --mtime="@$SOURCE_DATE_EPOCH" --clamp-mtime --owner=0 --group=0 --numeric-owner \
    --format=posix --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime "$@"
}

mkdir -p "$cache_root/images"
# One build at a time per cache: make images and make test may run side by side.
exec 9>"$cache_root/images/.lock"
flock 9

bases=()
for name in "${names[@]}"; do
  build_base "$name"
  bases+=("$base_dir")
done
((base_only)) && exit 0

[[ -x $binary ]] || fail "no castellan binary at $binary (deploy/release/build.sh, or set CASTELLAN_BINARY)"
version="$("$binary" version | awk '{ print $2 }')"
[[ -n $version ]] || fail "$binary version printed no version"
out="${CASTELLAN_IMAGES_OUT:-$cache_root/images/$(basename "$(dirname "$binary")")}"
mkdir -p "$out"
for i in "${!names[@]}"; do assemble "${names[$i]}" "${bases[$i]}" "$out" "$version"; done

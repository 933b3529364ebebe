#!/usr/bin/env bash
# Builds the pinned local control plane (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl) from the Go module proxy into a cache outside the clone,
# keyed by version, so only the first run on a machine pays for the build.
# Prints the directory holding the binaries on stdout; progress goes to stderr.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
k8s_version="$(awk '$1 == "k8s.io/kubernetes" { print $2; exit }' "$here/go.mod")"
etcd_version="$(awk '$1 == "go.etcd.io/etcd/server/v3" { print $2; exit }' "$here/go.mod")"
cache_root="${CASTELLAN_CACHE:-/var/cache/castellan}"
out="$cache_root/controlplane-$k8s_version-etcd-$etcd_version/bin"

binaries=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl)
complete=1
for b in "${binaries[@]}"; do [[ -x "$out/$b" ]] || complete=0; done
if [[ $complete == 1 ]]; then
  echo "$out"
  exit 0
fi

command -v go >/dev/null || { echo "build.sh: the Go toolchain is required (go not on PATH)" >&2; exit 1; }
mkdir -p "$out"
tmp="$(mktemp -d "$out/../build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

minor="${k8s_version#v1.}"; minor="${minor%%.*}"
ldflags="-s -w \
 -X k8s.io/component-base/version.gitVersion=$k8s_version \
 -X k8s.io/component-base/version.gitMajor=1 \
 -X k8s.io/component-base/version.gitMinor=$minor \
 -X k8s.io/component-base/version.gitTreeState=clean \
 -X k8s.io/client-go/pkg/version.gitVersion=$k8s_version \
 -X k8s.io/client-go/pkg/version.gitMajor=1 \
 -X k8s.io/client-go/pkg/version.gitMinor=$minor"

cd "$here"
build() { # name package
  echo "building $1 ($2) into $out" >&2
  CGO_ENABLED=0 go build -mod=mod -trimpath -ldflags "$ldflags" -o "$tmp/$1" "$2"
}
build etcd go.etcd.io/etcd/server/v3
build kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver
build kube-controller-manager k8s.io/kubernetes/cmd/kube-controller-manager
build kube-scheduler k8s.io/kubernetes/cmd/kube-scheduler
build kubectl k8s.io/kubernetes/cmd/kubectl
mv "$tmp"/* "$out/"
echo "$out"

#!/usr/bin/env bash
# The example `make up` leaves running: Castellan's operator deployed from
# deploy/operator/operator.yaml, local volumes for the database instances (one
# directory-backed PersistentVolume per node, owned by the postgres user), and a
# three-instance PostgreSQL cluster (deploy/examples/local-cluster.yaml) in the
# `default` namespace.
#
#   example.sh up     deploy it and wait until the cluster is Ready
#   example.sh down   remove it (the volumes' directories go with the state directory)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
dev="${CASTELLAN_DEV_DIR:-$repo/.dev}"
k=("$dev/bin/kubectl" --kubeconfig "$dev/kubeconfig")
volumes="$dev/volumes"
class=castellan-dev-local

log() { echo "example: $*" >&2; }
die() { echo "example: error: $*" >&2; exit 1; }

uid="$(id -u postgres)" || die "the postgres user is missing (deploy/local/deps.sh installs PostgreSQL)"
gid="$(id -g postgres)"

up() {
  # The same manifest a real cluster uses, but the instance image's postgres user is
  # this machine's (substituted before applying, so only one operator ever runs).
  sed -e "/CASTELLAN_POSTGRES_UID/s/value: \"26\"/value: \"$uid\"/" \
      -e "/CASTELLAN_POSTGRES_GID/s/value: \"26\"/value: \"$gid\"/" \
      "$repo/deploy/operator/operator.yaml" | "${k[@]}" apply -f - >/dev/null
  local manifests="apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: $class}
provisioner: kubernetes.io/no-provisioner
volumeBindingMode: WaitForFirstConsumer
"
  local node
  for node in $("${k[@]}" get nodes -o jsonpath='{.items[*].metadata.name}'); do
    mkdir -p "$volumes/$node"
    chown "$uid:$gid" "$volumes/$node"
    chmod 700 "$volumes/$node"
    manifests+="---
apiVersion: v1
kind: PersistentVolume
metadata:
  name: $class-$node
  labels: {castellan.io/dev-volume: \"true\"}
spec:
  capacity: {storage: 2Gi}
  accessModes: [ReadWriteOnce]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: $class
  local: {path: $volumes/$node}
  nodeAffinity:
    required:
      nodeSelectorTerms:
      - matchExpressions: [{key: kubernetes.io/hostname, operator: In, values: [$node]}]
"
  done
  echo "$manifests" | "${k[@]}" apply -f - >/dev/null
  "${k[@]}" apply -n default -f "$repo/deploy/examples/local-cluster.yaml" >/dev/null
  log "waiting for DatabaseCluster default/example to be Ready"
  local deadline=$((SECONDS + 300))
  until [[ "$("${k[@]}" get dbc example -o jsonpath='{.status.phase}' 2>/dev/null)" == Ready ]]; do
    (( SECONDS < deadline )) || die "the example cluster was not Ready within 300s: $("${k[@]}" get dbc,pods -o wide 2>&1)"
    sleep 2
  done
  log "ready: $("${k[@]}" get dbc example --no-headers)"
}

down() {
  "${k[@]}" delete -n default -f "$repo/deploy/examples/local-cluster.yaml" --ignore-not-found --wait=true --timeout=60s >/dev/null 2>&1 || true
  "${k[@]}" delete pv -l castellan.io/dev-volume=true --ignore-not-found >/dev/null 2>&1 || true
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac

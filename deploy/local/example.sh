#!/usr/bin/env bash
# The example `make up` leaves running, built the way a user builds it in a real
# cluster: Castellan's operator (deploy/operator/operator.yaml), a disk on every node, a
# StoragePool over those disks whose StorageClass is the cluster's default
# (deploy/examples/local-pool.yaml), and a three-instance PostgreSQL cluster on it
# (deploy/examples/local-cluster.yaml) in the `default` namespace. Needs the node agent
# (agent.sh up) first.
#
#   example.sh up     deploy it and wait until the cluster is Ready (again: no change)
#   example.sh down   remove the cluster and the pool (the disks stay attached; nodes.sh
#                     down detaches them, and cluster.sh down removes their files)
#
# Disks: a sparse file <state>/disks/<node>/local.img per node
# (CASTELLAN_DISK_SIZE, default 10G: room for a few clusters of 1Gi instances; only what
# is written takes space on the host), attached as a loop device. The node's agent sees
# only loop devices over files in its own directory (agent.sh), so each disk is its node's.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
dev="${CASTELLAN_DEV_DIR:-$repo/.dev}"
disk_size="${CASTELLAN_DISK_SIZE:-10G}"
k=("$dev/bin/kubectl" --kubeconfig "$dev/kubeconfig")
pool=local
class=castellan-local

log() { echo "example: $*" >&2; }
die() { echo "example: error: $*" >&2; exit 1; }

uid="$(id -u postgres)" || die "the postgres user is missing (deploy/local/deps.sh installs PostgreSQL)"
gid="$(id -g postgres)"

nodes() { "${k[@]}" get nodes -l node.castellan.io/process-backed=true -o jsonpath='{.items[*].metadata.name}'; }

# One disk per node, attached once: a second `up` finds the file and its loop device.
# An existing file is never recreated or resized (it may hold the pool).
disks() {
  local node file
  for node in $(nodes); do
    mkdir -p "$dev/disks/$node"
    file="$dev/disks/$node/local.img"
    [[ -f "$file" ]] || truncate --size "$disk_size" "$file"
    if [[ -z "$(losetup --associated "$file")" ]]; then
      losetup --find --show "$file" >/dev/null || die "attaching $file to a loop device failed"
    fi
  done
}

# `until` with a deadline, saying what was last seen when it gives up.
wait_until() { # what seconds command...
  local what="$1" seconds="$2"; shift 2
  local deadline=$((SECONDS + seconds))
  until "$@"; do
    (( SECONDS < deadline )) || die "$what within ${seconds}s: $(show)"
    sleep 1
  done
}

show() { "${k[@]}" get storagepool,storageclass,dbc,pvc,pods -o wide 2>&1 || true; }

pool_ready() {
  local wanted
  wanted="$(nodes | wc -w)"
  [[ "$("${k[@]}" get storagepool "$pool" -o jsonpath='{.status.phase}/{.status.readyNodes}' 2>/dev/null)" == "Ready/$wanted" ]]
}

class_is_default() {
  [[ "$("${k[@]}" get storageclass "$class" \
    -o jsonpath='{.metadata.annotations.storageclass\.kubernetes\.io/is-default-class}' 2>/dev/null)" == true ]]
}

cluster_ready() {
  [[ "$("${k[@]}" get dbc example -n default -o jsonpath='{.status.phase}' 2>/dev/null)" == Ready ]]
}

up() {
  # The same manifest a real cluster uses, but the instance image's postgres user is
  # this machine's (substituted before applying, so only one operator ever runs).
  sed -e "/CASTELLAN_POSTGRES_UID/s/value: \"26\"/value: \"$uid\"/" \
      -e "/CASTELLAN_POSTGRES_GID/s/value: \"26\"/value: \"$gid\"/" \
      "$repo/deploy/operator/operator.yaml" | "${k[@]}" apply -f - >/dev/null
  "${k[@]}" apply -f "$repo/deploy/operator/policies.yaml" >/dev/null
  disks
  "${k[@]}" apply -f "$repo/deploy/examples/local-pool.yaml" >/dev/null
  log "waiting for StoragePool $pool to be Ready on every node"
  wait_until "StoragePool $pool was not Ready" 120 pool_ready
  # Claims made before the default class exists would wait for the volume controller
  # to fill it in later; apply the cluster once it is there.
  wait_until "StorageClass $class is not the default" 60 class_is_default
  "${k[@]}" apply -n default -f "$repo/deploy/examples/local-cluster.yaml" >/dev/null
  log "waiting for DatabaseCluster default/example to be Ready"
  wait_until "the example cluster was not Ready" 300 cluster_ready
  log "ready: $("${k[@]}" get dbc example -n default --no-headers)"
}

no_pool_volumes() {
  [[ -z "$("${k[@]}" get pv -l "castellan.io/pool=$pool" -o name 2>/dev/null)" ]]
}

down() {
  "${k[@]}" delete -n default -f "$repo/deploy/examples/local-cluster.yaml" --ignore-not-found \
    --wait=true --timeout=60s >/dev/null
  # The claims go with the cluster (owner references); the pool waits for their volumes.
  wait_until "the example's volumes were not released" 120 no_pool_volumes
  "${k[@]}" delete -f "$repo/deploy/examples/local-pool.yaml" --ignore-not-found \
    --wait=true --timeout=120s >/dev/null
  log "example cluster and pool $pool deleted"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Castellan's node agent on the local cluster: the DaemonSet of deploy/agent/agent.yaml,
# as a real cluster runs it, with two development settings.
#
#   agent.sh up     annotate each node with its own disk directory, apply, wait Ready
#   agent.sh down   delete the DaemonSet (pools stay mounted; nodes.sh down releases them)
#
# - Disks: the dev nodes share one host and its loop devices, so node N's agent only
#   sees loop devices whose backing file is under $dev/disks/node-N/ (the Node annotation
#   castellan.io/device-allow, read by the agent when it starts).
# - Only nodes labelled node.castellan.io/process-backed=true run it (not the Node
#   objects tests register without a machine behind them).
# - Pools are mounted under $dev/pools instead of /var/lib/castellan/pools, so that
#   several local clusters on one machine do not mount over each other and
#   `nodes.sh down` knows what to release.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
dev="${CASTELLAN_DEV_DIR:-$repo/.dev}"
k=("$dev/bin/kubectl" --kubeconfig "$dev/kubeconfig")

log() { echo "agent: $*" >&2; }
die() { echo "agent: error: $*" >&2; exit 1; }

up() {
  local node
  # Tests run side by side and each makes sure the agent is up: one at a time, or two
  # `kubectl apply`s both create the namespace and one fails with AlreadyExists.
  exec 9>"$dev/agent.lock"
  flock 9
  for node in $("${k[@]}" get nodes -o jsonpath='{.items[*].metadata.name}'); do
    mkdir -p "$dev/disks/$node"
    "${k[@]}" annotate --overwrite node "$node" "castellan.io/device-allow=^$dev/disks/$node/" >/dev/null
  done
  mkdir -p "$dev/pools"
  # Only on the process-backed nodes: tests register Node objects of their own (with no
  # machine behind them), whose agent pods would stay Pending and stall the rollout.
  sed -e "s#/var/lib/castellan/pools#$dev/pools#g" \
      -e 's#^      hostPID: true$#      hostPID: true\n      nodeSelector: {node.castellan.io/process-backed: "true"}#' \
      "$repo/deploy/agent/agent.yaml" \
    | "${k[@]}" apply -f - >/dev/null
  # What RBAC cannot say: each agent writes only its own node's objects.
  "${k[@]}" apply -f "$repo/deploy/agent/policies.yaml" >/dev/null
  "${k[@]}" -n castellan-system rollout status daemonset/castellan-agent --timeout=120s >&2 \
    || die "the agent DaemonSet did not become ready"
  log "agent running on every node (pools under $dev/pools, disks under $dev/disks/<node>/)"
}

down() {
  "${k[@]}" -n castellan-system delete daemonset castellan-agent --ignore-not-found >/dev/null
  log "agent DaemonSet deleted"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac

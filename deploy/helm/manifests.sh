#!/usr/bin/env bash
# Renders the chart (deploy/helm/castellan) with its default values, as release
# `castellan` in `castellan-system` with the Namespace included, into the plain
# manifests a user applies without helm:
#
#   deploy/operator/operator.yaml   Namespace, the operator's RBAC and Deployment
#   deploy/operator/policies.yaml   the operator's admission policies
#   deploy/agent/agent.yaml         Namespace, the agent's RBAC and DaemonSet
#   deploy/agent/policies.yaml      the agent's admission policies
#
#   manifests.sh HELM [OUT_DIR]     OUT_DIR (default: the repository) gets the same
#                                   layout; tests/helm.rs renders into a temporary
#                                   directory and fails when the files differ.
#
# `make manifests` runs it with the pinned helm (deploy/helm/build.sh).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
helm="${1:?usage: manifests.sh HELM [OUT_DIR]}"
out="${2:-$repo}"
chart="$repo/deploy/helm/castellan"
[[ -x "$helm" ]] || { echo "manifests.sh: $helm is not an executable helm (deploy/helm/build.sh builds one)" >&2; exit 1; }

render() { # target description templates...
  local target="$1" what="$2"; shift 2
  local shown=() t
  for t in "$@"; do shown+=(--show-only "templates/$t"); done
  mkdir -p "$(dirname "$out/$target")"
  {
    echo "# $what"
    echo "#"
    echo "# Generated from the Helm chart deploy/helm/castellan with its default values"
    echo "# (release castellan, namespace castellan-system) by \`make manifests\`: edit the"
    echo "# chart, not this file; tests/helm.rs fails when it is stale."
    "$helm" template castellan "$chart" --namespace castellan-system \
      --set createNamespace=true "${shown[@]}" \
      || { echo "manifests.sh: helm template of ${*} failed" >&2; exit 1; }
  } > "$out/$target.tmp"
  mv "$out/$target.tmp" "$out/$target"
}

render deploy/operator/operator.yaml \
  "Castellan's operator: namespace, service account, RBAC, image catalog, Deployment (CRDs: crds/ first)." \
  namespace.yaml operator-rbac.yaml image-catalog.yaml operator.yaml
render deploy/operator/policies.yaml \
  "Admission policies that hold the operator to what is its own (docs/security.md)." \
  operator-policies.yaml
render deploy/agent/agent.yaml \
  "Castellan's node agent: namespace, service account, RBAC, DaemonSet (CRDs: crds/ first)." \
  namespace.yaml agent-rbac.yaml agent.yaml
render deploy/agent/policies.yaml \
  "Admission policies that hold each node's agent to its own node (docs/security.md)." \
  agent-policies.yaml

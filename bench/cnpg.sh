#!/usr/bin/env bash
# CloudNativePG's operator (the peer we compare against) on the local development
# cluster, so that a benchmark can measure its memory and latency beside Castellan's.
#
#   bench/cnpg.sh build                        build its manager (v1.27.0) once, cached
#   bench/cnpg.sh start NAMESPACE              run it watching NAMESPACE; prints its pid
#   bench/cnpg.sh apply NAME NAMESPACE CLASS   a one-instance Cluster, 1Gi of CLASS
#   bench/cnpg.sh stop                         stop it; remove its CRDs, webhooks, namespace
#
# What is compared: the operator's own work for Cluster objects — admission (its
# defaulting and validating webhooks run, through the API server, as in a real install),
# the objects it creates for a Cluster and its resident memory (/proc/PID/status).
# What is not: its instance pods cannot run on our process-backed nodes (they expect its
# container image's layout: /controller, the instance manager copied in by an init
# container), so its Clusters never get a running PostgreSQL and stay in "Setting up
# primary" (initdb Job and claim Pending); what it does for running instances (polling
# each one's status endpoint, failover) is not measured. Compare with Castellan clusters
# whose pods do not run either (a control plane without nodes: pods Pending).
# The manager runs as a host process (no cgroup limits; built with the local Go, not its
# release's), as root with the admin kubeconfig (no RBAC of its own); a kubelet-like step
# of this script copies its webhook certificate to where its pod would have the Secret
# mounted, and the API server calls its webhooks on loopback, without a Service proxy hop.
#
# Environment: CASTELLAN_DEV_DIR (the local cluster's state: kubeconfig, bin/kubectl,
# logs/, pids/), CASTELLAN_CACHE (default /var/cache/castellan: the build and Go caches).
set -euo pipefail

version=1.27.0
module=github.com/cloudnative-pg/cloudnative-pg
cache="${CASTELLAN_CACHE:-/var/cache/castellan}"
out="$cache/cnpg-$version"
# Its install's namespace and names (config/default/kustomization.yaml: namePrefix cnpg-);
# the manager looks these up by name when it sets up its PKI.
operator_ns=cnpg-system
webhook_service=cnpg-webhook-service
webhook_secret=cnpg-webhook-cert
# Its pod has that Secret at /run/secrets/cnpg.io/webhook (fixed in the manager) and
# its namespace at /run/secrets/kubernetes.io/serviceaccount/namespace (where leader
# election looks): a private mount namespace binds a directory of ours over /run/secrets.
pod_secrets=/run/secrets

log() { echo "cnpg: $*" >&2; }
die() { echo "cnpg: error: $*" >&2; exit 1; }

cluster_env() {
  dev="${CASTELLAN_DEV_DIR:?CASTELLAN_DEV_DIR is not set (the state directory of the local cluster)}"
  [[ -f "$dev/kubeconfig" && -x "$dev/bin/kubectl" ]] || die "no local cluster in $dev (deploy/local/cluster.sh up)"
  k=("$dev/bin/kubectl" --kubeconfig "$dev/kubeconfig")
  pid_file="$dev/pids/cnpg"
  log_file="$dev/logs/cnpg.log"
  secrets="$dev/cnpg/secrets"
  certs="$secrets/cnpg.io/webhook"
  mkdir -p "$dev/pids" "$dev/logs"
}

built() {
  [[ -x "$out/manager" && -f "$out/webhook/manifests.yaml" && -f "$out/default-monitoring.yaml" ]] &&
    compgen -G "$out/crds/*.yaml" >/dev/null
}

# The manager from the module at exactly this version, built as its main module (its own
# go.mod and go.sum, as its release is), stamped as its release build stamps it. The
# layout is its image's: it hashes operator/manager_<arch> (relative to its working
# directory) for every Cluster's status and fails that reconcile step without it.
build() {
  if built; then echo "$out/manager"; return 0; fi
  if ! command -v go >/dev/null && [[ -x /usr/local/go/bin/go ]]; then PATH="/usr/local/go/bin:$PATH"; fi
  command -v go >/dev/null || die "the Go toolchain is required (go not on PATH)"
  export GOMODCACHE="$cache/go/mod" GOCACHE="$cache/go/build" GOTOOLCHAIN=local CGO_ENABLED=0
  mkdir -p "$cache"
  tmp="$(mktemp -d "$cache/build-cnpg.XXXXXX")" && chmod 755 "$tmp"
  trap 'rm -rf "$tmp"' EXIT

  # The proxy serves this version though not the module's version list: ask for it exactly.
  (cd "$tmp" && go mod download "$module@v$version") || die "downloading $module@v$version failed"
  local src commit date arch
  read -r src commit date < <(cd "$tmp" && go list -m -f '{{.Dir}} {{.Origin.Hash}} {{.Time.Format "2006-01-02T15:04:05Z"}}' "$module@v$version")
  [[ -d "$src/cmd/manager" && -n "$commit" ]] || die "no cmd/manager in $src"

  arch="$(go env GOARCH)"
  log "building its manager v$version into $out (first run only; 2-5 minutes on 2 cores)"
  local pkg="$module/pkg/versions"
  (cd "$src" && go build -mod=readonly -trimpath \
    -ldflags "-s -w -X $pkg.buildVersion=$version -X $pkg.buildCommit=$commit -X $pkg.buildDate=$date" \
    -o "$tmp/operator/manager_$arch" ./cmd/manager) || die "building $module/cmd/manager failed (see above)"
  ln -s "operator/manager_$arch" "$tmp/manager"

  mkdir -p "$tmp/crds" "$tmp/webhook"
  cp "$src"/config/crd/bases/*.yaml "$tmp/crds/"
  cp "$src/config/webhook/manifests.yaml" "$tmp/webhook/"
  # The monitoring queries its install ships; it copies them into each Cluster's namespace.
  cp "$src/config/manager/default-monitoring.yaml" "$tmp/"
  chmod -R u+w "$tmp"
  "$tmp/manager" version >&2 || die "the built manager does not run"
  rm -rf "$out"
  mv "$tmp" "$out"
  built || die "the build left $out incomplete"
  echo "$out/manager"
}

# Whether the pid file names our manager (pids wrap: never signal another process).
running_pid() {
  local pid
  pid="$(cat "$pid_file" 2>/dev/null)" || return 1
  [[ "$pid" =~ ^[0-9]+$ && "$(readlink "/proc/$pid/exe" 2>/dev/null)" == "$out"/operator/manager_* ]] || return 1
  echo "$pid"
}

# A port in 20000-25999 that nothing listens on: below the ephemeral range and the
# NodePort range, and clear of the local clusters' port bases (16000, 26000, … + 0-999).
free_port() {
  local used port
  used=" $(ss -Hltn | awk '{ sub(/.*:/, "", $4); printf "%s ", $4 }')"
  for port in $(shuf -i 20000-25999 -n 200); do
    [[ "$used" == *" $port "* ]] || { echo "$port"; return 0; }
  done
  die "no free port in 20000-25999"
}

operator_objects() { # webhook-port
  # The API server reaches a Service-referenced webhook at the Service's address with
  # TLS ServerName <service>.<namespace>.svc — the name the manager's own PKI puts in
  # its certificate (and whose caBundle it injects into both configurations). An
  # ExternalName Service resolves to the host process (the API server runs on this
  # host's loopback too); the references gain its port.
  sed -E -e "s/^(\s*)namespace: system$/\1namespace: $operator_ns\n\1port: $1/" \
    -e "s/^(\s*)name: webhook-service$/\1name: $webhook_service/" \
    -e 's/^  name: (mutating|validating)-webhook-configuration$/  name: cnpg-\1-webhook-configuration/' \
    "$out/webhook/manifests.yaml"
  sed -E 's/^  name: default-monitoring$/  name: cnpg-default-monitoring/' "$out/default-monitoring.yaml"
  cat <<EOF
---
apiVersion: v1
kind: Service
metadata: {name: $webhook_service, namespace: $operator_ns}
spec: {type: ExternalName, externalName: 127.0.0.1}
---
# Owner of its PKI Secrets (found by this label); nothing runs from it.
apiVersion: apps/v1
kind: Deployment
metadata:
  name: cnpg-controller-manager
  namespace: $operator_ns
  labels: {app.kubernetes.io/name: cloudnative-pg}
spec:
  replicas: 0
  selector: {matchLabels: {app.kubernetes.io/name: cloudnative-pg}}
  template:
    metadata: {labels: {app.kubernetes.io/name: cloudnative-pg}}
    spec:
      containers: [{name: manager, image: "ghcr.io/cloudnative-pg/cloudnative-pg:$version"}]
EOF
}

# What the kubelet does for its pod: the webhook Secret's keys as files in the cert dir.
mount_secret() {
  # shellcheck disable=SC2016 # a Go template, not shell
  local template='{{range $k, $v := .data}}{{$k}} {{$v}}{{"\n"}}{{end}}' key value
  while read -r key value; do
    echo "$value" | base64 -d >"$certs/.$key" && mv "$certs/.$key" "$certs/$key"
  done < <("${k[@]}" -n "$operator_ns" get secret "$webhook_secret" -o go-template="$template")
  [[ -s "$certs/tls.crt" && -s "$certs/tls.key" ]]
}

probe_cluster() { # namespace
  cat <<EOF
apiVersion: postgresql.cnpg.io/v1
kind: Cluster
metadata: {name: cnpg-readiness-probe, namespace: $1}
spec: {instances: 1, storage: {size: 1Gi}}
EOF
}

start() { # namespace
  local ns="$1" pid webhook_port metrics_port mounted=0 deadline
  cluster_env
  build >/dev/null
  if pid="$(running_pid)"; then die "already running (pid $pid); bench/cnpg.sh stop first"; fi
  "${k[@]}" get namespace "$ns" >/dev/null || die "namespace $ns does not exist"

  "${k[@]}" apply --server-side --force-conflicts --field-manager cnpg-bench -f "$out/crds/" >/dev/null
  "${k[@]}" wait --for condition=Established --timeout 60s -f "$out/crds/" >/dev/null
  "${k[@]}" create namespace "$operator_ns" --dry-run=client -o yaml | "${k[@]}" apply -f - >/dev/null
  webhook_port="$(free_port)"
  metrics_port="$(free_port)"
  [[ "$metrics_port" != "$webhook_port" ]] || metrics_port="$(free_port)"
  operator_objects "$webhook_port" | "${k[@]}" apply -n "$operator_ns" --server-side --force-conflicts --field-manager cnpg-bench -f - >/dev/null

  # Empty until its Secret exists: the manager retries (for about 30 s at a time) while
  # these files differ from the Secret, as while a kubelet has not refreshed the mount.
  rm -rf "$secrets" && mkdir -p "$certs" "$secrets/kubernetes.io/serviceaccount" && chmod -R 700 "$secrets"
  printf %s "$operator_ns" >"$secrets/kubernetes.io/serviceaccount/namespace"
  mkdir -p "$pod_secrets"
  log "starting its manager (webhook port $webhook_port, metrics port $metrics_port, log $log_file)"
  # Its arguments and environment are its release manifest's (releases/cnpg-1.27.0.yaml)
  # but for the ports and the watched namespace. /run/secrets is ours in its own mount
  # namespace only (the host keeps an empty mount point), so operators of two local
  # clusters do not share it. setsid, unshare and sh each exec: $! is the manager's pid.
  (
    cd "$out"
    export KUBECONFIG="$dev/kubeconfig" OPERATOR_NAMESPACE="$operator_ns" WATCH_NAMESPACE="$ns" \
      OPERATOR_IMAGE_NAME="ghcr.io/cloudnative-pg/cloudnative-pg:$version" \
      MONITORING_QUERIES_CONFIGMAP=cnpg-default-monitoring
    # shellcheck disable=SC2016 # expanded by the inner sh
    exec setsid unshare --mount --propagation private sh -c 'mount --bind "$1" "$2" && shift 2 && exec "$@"' \
      sh "$secrets" "$pod_secrets" "$out/manager" controller --leader-elect --max-concurrent-reconciles=10 \
      --config-map-name=cnpg-controller-manager-config --secret-name=cnpg-controller-manager-config \
      --webhook-port="$webhook_port" --metrics-bind-address="127.0.0.1:$metrics_port"
  ) >"$log_file" 2>&1 </dev/null &
  pid=$!
  echo "$pid" >"$pid_file"

  # Ready: its Cluster controller's workers started, and a Cluster passes its webhooks
  # through the API server (a server-side dry run: nothing is stored).
  deadline=$((SECONDS + 120))
  until grep -q '"msg":"Starting workers".*"controllerKind":"Cluster"' "$log_file" &&
    probe_cluster "$ns" | "${k[@]}" create --dry-run=server -f - >/dev/null 2>&1; do
    if ! kill -0 "$pid" 2>/dev/null; then tail -n 20 "$log_file" >&2; die "its manager exited; log: $log_file"; fi
    (( SECONDS < deadline )) || { tail -n 20 "$log_file" >&2; die "not ready within 120 s; log: $log_file"; }
    if (( !mounted )) && "${k[@]}" -n "$operator_ns" get secret "$webhook_secret" >/dev/null 2>&1; then
      mount_secret && mounted=1
    fi
    sleep 0.2
  done
  running_pid >/dev/null || die "pid $pid is not its manager"
  log "ready"
  echo "$pid"
}

apply() { # name namespace storageclass
  cluster_env
  "${k[@]}" apply -f - >/dev/null <<EOF
apiVersion: postgresql.cnpg.io/v1
kind: Cluster
metadata: {name: $1, namespace: $2}
spec:
  instances: 1
  storage: {size: 1Gi, storageClass: $3}
EOF
}

stop() {
  local pid
  cluster_env
  # The webhooks first: without their server, every write to its resources would fail.
  "${k[@]}" delete mutatingwebhookconfiguration cnpg-mutating-webhook-configuration --ignore-not-found >/dev/null
  "${k[@]}" delete validatingwebhookconfiguration cnpg-validating-webhook-configuration --ignore-not-found >/dev/null
  if pid="$(running_pid)"; then
    kill -TERM "$pid"
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid"; fi
  fi
  rm -f "$pid_file"
  # Its Clusters go with the CRDs (they carry no finalizer), their objects with them
  # (owner references, garbage collector).
  if ! "${k[@]}" delete -f "$out/crds/" --ignore-not-found --wait=true --timeout=120s >/dev/null; then
    die "its CRDs were not removed within 120 s: $("${k[@]}" get crd 2>&1 | grep cnpg.io)"
  fi
  "${k[@]}" delete namespace "$operator_ns" --ignore-not-found --wait=true --timeout=120s >/dev/null
  # Its copy of the monitoring queries in each watched namespace has no owner.
  local copy
  for copy in $("${k[@]}" get configmap -A -l cnpg.io/reload --field-selector metadata.name=cnpg-default-monitoring \
    -o jsonpath='{range .items[*]}{.metadata.namespace}{"\n"}{end}'); do
    "${k[@]}" -n "$copy" delete configmap cnpg-default-monitoring --ignore-not-found >/dev/null
  done
  rm -rf "$dev/cnpg"
  log "stopped"
}

case "${1:-}" in
  build) build ;;
  start) [[ $# == 2 ]] || die "usage: $0 start NAMESPACE"; start "$2" ;;
  apply) [[ $# == 4 ]] || die "usage: $0 apply NAME NAMESPACE STORAGECLASS"; apply "$2" "$3" "$4" ;;
  stop) stop ;;
  *) echo "usage: $0 build | start NAMESPACE | apply NAME NAMESPACE STORAGECLASS | stop" >&2; exit 2 ;;
esac

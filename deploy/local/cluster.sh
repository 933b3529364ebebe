#!/usr/bin/env bash
# The local Kubernetes control plane: etcd, kube-apiserver, kube-controller-manager and
# kube-scheduler as plain processes on loopback, with certificates generated here.
#
#   cluster.sh up      start (or find running) and wait until healthy; install the CRDs
#   cluster.sh down    stop every process it started and remove its state
#   cluster.sh status  exit 0 when the API server answers /readyz
#
# Environment:
#   CASTELLAN_DEV_DIR  state directory (default: <repo>/.dev); a second directory with
#                      another CASTELLAN_PORT_BASE runs a second, independent cluster
#   CASTELLAN_PORT_BASE  ports are derived from it (default 16000: API server on 16443),
#                      and so is the cluster's network slot (see network.sh)
#   CARGO_TARGET_DIR   where cargo builds castellan (default: /var/cache/castellan/target):
#                      <state>/bin/kubectl-castellan links to its debug build
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
dev="${CASTELLAN_DEV_DIR:-$repo/.dev}"
base="${CASTELLAN_PORT_BASE:-16000}"
api_port=$((base + 443))
etcd_port=$((base + 379))
etcd_peer_port=$((base + 380))
cm_port=$((base + 257))
scheduler_port=$((base + 259))
# Loopback ranges: Service ClusterIPs here, pod addresses elsewhere in 127.0.0.0/8 (the
# process-backed nodes hand out 127.<node>.x.y), so the two never overlap; both follow
# the port base, so clusters with different port bases can run side by side.
# shellcheck source=deploy/local/network.sh
source "$repo/deploy/local/network.sh"
service_octet="$(castellan_service_octet "$base")" || exit 1
service_cidr="127.$service_octet.0.0/16"
first_service_ip="127.$service_octet.0.1"

pki="$dev/pki"
logs="$dev/logs"
pids="$dev/pids"

log() { echo "cluster: $*" >&2; }
die() { echo "cluster: error: $*" >&2; exit 1; }

binaries() {
  local dir
  dir="$("$repo/deploy/controlplane/build.sh")" || die "building the control plane failed (see above)"
  echo "$dir"
}

gen_cert() { # name cn org san...
  local name="$1" cn="$2" org="$3"; shift 3
  [[ -f "$pki/$name.crt" ]] && return 0
  local subj="/CN=$cn"; [[ -n "$org" ]] && subj="/O=$org$subj"
  local ext="$pki/$name.ext"
  {
    echo "basicConstraints=CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    if [[ $# -gt 0 ]]; then
      echo "extendedKeyUsage=serverAuth,clientAuth"
      local sans="" s
      for s in "$@"; do sans+="${sans:+,}$s"; done
      echo "subjectAltName=$sans"
    else
      echo "extendedKeyUsage=clientAuth"
    fi
  } > "$ext"
  openssl genrsa -out "$pki/$name.key" 2048 2>/dev/null
  openssl req -new -key "$pki/$name.key" -subj "$subj" -out "$pki/$name.csr" 2>/dev/null
  openssl x509 -req -in "$pki/$name.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
    -days 3650 -sha256 -extfile "$ext" -out "$pki/$name.crt" 2>/dev/null
  rm -f "$pki/$name.csr" "$ext"
}

gen_pki() {
  command -v openssl >/dev/null || die "openssl is required (run deploy/local/deps.sh)"
  mkdir -p "$pki"
  chmod 700 "$pki"
  if [[ ! -f "$pki/ca.crt" ]]; then
    openssl req -x509 -newkey rsa:2048 -nodes -keyout "$pki/ca.key" -out "$pki/ca.crt" \
      -days 3650 -subj "/CN=castellan-local-ca" 2>/dev/null
  fi
  gen_cert apiserver kube-apiserver "" "IP:127.0.0.1" "IP:$first_service_ip" "DNS:localhost" \
    "DNS:kubernetes" "DNS:kubernetes.default" "DNS:kubernetes.default.svc" \
    "DNS:kubernetes.default.svc.cluster.local"
  gen_cert admin admin system:masters
  gen_cert controller-manager system:kube-controller-manager ""
  gen_cert scheduler system:kube-scheduler ""
  gen_cert apiserver-kubelet-client kube-apiserver-kubelet-client kubeadm:cluster-admins
  if [[ ! -f "$pki/sa.key" ]]; then
    openssl genrsa -out "$pki/sa.key" 2048 2>/dev/null
    openssl rsa -in "$pki/sa.key" -pubout -out "$pki/sa.pub" 2>/dev/null
  fi
}

kubeconfig() { # file user
  local file="$1" user="$2"
  cat > "$file" <<KUBECONFIG
apiVersion: v1
kind: Config
clusters:
- name: castellan-local
  cluster:
    server: https://127.0.0.1:$api_port
    certificate-authority: $pki/ca.crt
users:
- name: $user
  user:
    client-certificate: $pki/$user.crt
    client-key: $pki/$user.key
contexts:
- name: castellan-local
  context: {cluster: castellan-local, user: $user}
current-context: castellan-local
KUBECONFIG
  chmod 600 "$file"
}

# Whether the pid recorded for a component is still that component. Pids wrap quickly
# (pid_max may be 32768), so a stale pid file can name an unrelated process; nothing
# is signalled unless its executable is the component's own.
ours() { # name pid
  [[ "$2" =~ ^[0-9]+$ ]] && (( $2 > 1 )) || return 1
  [[ "$(basename "$(readlink "/proc/$2/exe" 2>/dev/null)")" == "$1" ]]
}

running() { # name
  local pid
  [[ -f "$pids/$1" ]] || return 1
  pid="$(cat "$pids/$1")"
  ours "$1" "$pid"
}

start() { # name command...
  local name="$1"; shift
  if running "$name"; then return 0; fi
  # setsid: the process outlives this script and make, and `down` ends its whole group.
  setsid "$@" >>"$logs/$name.log" 2>&1 < /dev/null &
  local pid=$! tries=0
  echo "$pid" > "$pids/$name"
  # Until the forked shell has exec'd setsid and setsid the program, /proc/PID/exe
  # names bash or setsid, and `running` would call the program exited.
  while ! ours "$name" "$pid" && kill -0 "$pid" 2>/dev/null && (( tries++ < 100 )); do
    sleep 0.05
  done
}

healthy() {
  [[ -f "$dev/kubeconfig" ]] || return 1
  "$dev/bin/kubectl" --kubeconfig "$dev/kubeconfig" --request-timeout=2s get --raw /readyz >/dev/null 2>&1
}

wait_for() { # process seconds command...
  local what="$1" seconds="$2"; shift 2
  local deadline=$((SECONDS + seconds))
  until "$@"; do
    if ! running "$what"; then
      tail -n 5 "$logs/$what.log" >&2 || true
      die "$what exited; its log is $logs/$what.log"
    fi
    if (( SECONDS >= deadline )); then
      die "$what did not become healthy within ${seconds}s; logs are in $logs"
    fi
    sleep 0.5
  done
}

etcd_healthy() { curl -fsS "http://127.0.0.1:$etcd_port/readyz" >/dev/null 2>&1; }
https_ok() { curl -fsSk "https://127.0.0.1:$1/healthz" -o /dev/null 2>/dev/null; }

up() {
  local bin
  bin="$(binaries)"
  mkdir -p "$dev/bin" "$logs" "$pids"
  ln -sfn "$bin/kubectl" "$dev/bin/kubectl"
  # The kubectl plugin is the castellan binary under the name kubectl looks for
  # (`kubectl castellan …` with <state>/bin on PATH); `make up` builds it right after.
  ln -sfn "${CARGO_TARGET_DIR:-/var/cache/castellan/target}/debug/castellan" "$dev/bin/kubectl-castellan"
  gen_pki
  kubeconfig "$dev/kubeconfig" admin
  kubeconfig "$dev/controller-manager.kubeconfig" controller-manager
  kubeconfig "$dev/scheduler.kubeconfig" scheduler

  start etcd "$bin/etcd" --name local --data-dir "$dev/etcd" \
    --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
    --listen-peer-urls "http://127.0.0.1:$etcd_peer_port" --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer_port" \
    --initial-cluster "local=http://127.0.0.1:$etcd_peer_port" --listen-metrics-urls "" \
    --quota-backend-bytes 2147483648 --unsafe-no-fsync
  wait_for etcd 60 etcd_healthy

  # The API server refuses a loopback advertise address for the `kubernetes` Service's
  # endpoints, so that reconciler is off: pods here reach the API server through the
  # KUBERNETES_SERVICE_HOST/PORT the process-backed nodes give them (127.0.0.1).
  # The toleration defaults are cut from 300 s so that pods leave a lost node in under a
  # minute here; a real cluster keeps its own settings.
  start kube-apiserver "$bin/kube-apiserver" \
    --etcd-servers "http://127.0.0.1:$etcd_port" \
    --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$api_port" \
    --tls-cert-file "$pki/apiserver.crt" --tls-private-key-file "$pki/apiserver.key" \
    --client-ca-file "$pki/ca.crt" \
    --kubelet-client-certificate "$pki/apiserver-kubelet-client.crt" \
    --kubelet-client-key "$pki/apiserver-kubelet-client.key" \
    --kubelet-certificate-authority "$pki/ca.crt" \
    --service-account-key-file "$pki/sa.pub" --service-account-signing-key-file "$pki/sa.key" \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-cluster-ip-range "$service_cidr" --endpoint-reconciler-type none \
    --authorization-mode Node,RBAC --allow-privileged=true \
    --default-not-ready-toleration-seconds 20 --default-unreachable-toleration-seconds 20 \
    --profiling=false --v=1
  wait_for kube-apiserver 120 healthy

  # Without the endpoint controllers: the API server refuses loopback pod addresses in
  # Endpoints and EndpointSlices, so they could never publish these pods and only logged
  # a Warning Event per Service every few minutes. The Service proxy selects the ready
  # pods itself (deploy/node/src/proxy.rs). Names as `kube-controller-manager --help`
  # lists them at v1.37.
  start kube-controller-manager "$bin/kube-controller-manager" \
    --controllers '*,-endpoints-controller,-endpointslice-controller,-endpointslice-mirroring-controller' \
    --kubeconfig "$dev/controller-manager.kubeconfig" \
    --authentication-kubeconfig "$dev/controller-manager.kubeconfig" \
    --authorization-kubeconfig "$dev/controller-manager.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$cm_port" \
    --cluster-signing-cert-file "$pki/ca.crt" --cluster-signing-key-file "$pki/ca.key" \
    --root-ca-file "$pki/ca.crt" --service-account-private-key-file "$pki/sa.key" \
    --use-service-account-credentials --service-cluster-ip-range "$service_cidr" \
    --node-monitor-period 2s --node-monitor-grace-period 16s \
    --leader-elect=false --profiling=false --v=1
  start kube-scheduler "$bin/kube-scheduler" \
    --kubeconfig "$dev/scheduler.kubeconfig" \
    --authentication-kubeconfig "$dev/scheduler.kubeconfig" \
    --authorization-kubeconfig "$dev/scheduler.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$scheduler_port" \
    --leader-elect=false --profiling=false --v=1
  wait_for kube-controller-manager 60 https_ok "$cm_port"
  wait_for kube-scheduler 60 https_ok "$scheduler_port"

  if compgen -G "$repo/crds/*.yaml" >/dev/null; then install_crds; fi
  log "control plane ready: export KUBECONFIG=$dev/kubeconfig; kubectl is $dev/bin/kubectl"
}

install_crds() {
  local k=("$dev/bin/kubectl" --kubeconfig "$dev/kubeconfig")
  "${k[@]}" apply --server-side --force-conflicts --field-manager castellan-dev -f "$repo/crds/" >/dev/null
  "${k[@]}" wait --for condition=Established --timeout 60s \
    $(cd "$repo/crds" && ls *.yaml | sed -E 's/^([^_]+)_([^.]+)\.yaml$/crd\/\2.\1/') >/dev/null
}

stop() { # name
  local name="$1" pid
  [[ -f "$pids/$name" ]] || return 0
  pid="$(cat "$pids/$name")"
  if ours "$name" "$pid"; then
    # Each component leads its own process group (setsid): end the group.
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do ours "$name" "$pid" || break; sleep 0.1; done
    if ours "$name" "$pid"; then kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true; fi
  fi
  rm -f "$pids/$name"
}

down() {
  local name
  for name in kube-scheduler kube-controller-manager kube-apiserver etcd; do stop "$name"; done
  # Every control-plane process of this cluster names the state directory on its
  # command line, and so does its S3 server (s3.sh, whose data this removes); one
  # still alive after the stops above is a leak, and `down` says so loudly. (Shells that
  # merely mention the directory, like make's, are not ours.)
  local pid left=""
  for pid in $(pgrep -f -- "$dev/" || true); do
    case "$(basename "$(readlink "/proc/$pid/exe" 2>/dev/null)")" in
      etcd | kube-apiserver | kube-controller-manager | kube-scheduler | s3s-fs)
        left+="$(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null)"$'\n' ;;
    esac
  done
  if [[ -n "$left" ]]; then
    echo "$left" >&2
    die "processes of the cluster in $dev are still running after down (deploy/local/s3.sh down stops the S3 server)"
  fi
  rm -rf "$dev"
  log "stopped; removed $dev"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) healthy ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Process-backed nodes and the Service proxy for the local cluster (deploy/node):
# castellan-devnode processes beside the control plane that cluster.sh started.
#
#   nodes.sh up           build castellan-devnode, start the nodes and the proxy, wait Ready
#   nodes.sh down         stop them all, and every container process they started
#   nodes.sh stop NAME    stop one node as a lost machine would (its pods' processes die)
#   nodes.sh start NAME   start one node again (it resumes its pods)
#   nodes.sh status       exit 0 when every node and the proxy run
#   nodes.sh release-disks  unmount the pools under the state directory and detach its
#                         loop devices (down does this after stopping the nodes)
#
# Environment:
#   CASTELLAN_DEV_DIR    the cluster's state directory (default: <repo>/.dev)
#   CASTELLAN_NODES      how many nodes (default 3: node-1 … node-3)
#   CASTELLAN_IMAGES     image map for the nodes (default: deploy/node/images.yaml if present)
#   CARGO_TARGET_DIR     where cargo builds (default: /var/cache/castellan/target)
#   CASTELLAN_CACHE      where deploy/local/postgres.sh composes PostgreSQL 18
#                        (default: /var/cache/castellan)
# Kubelet ports follow the API server's port: its port base + 100 + the node's index;
# pod addresses follow it too (network.sh).
set -euo pipefail
# A command that ends the script under set -e says which, instead of exiting silently.
trap 'echo "nodes: error: line $LINENO: $BASH_COMMAND exited with $?" >&2' ERR

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
dev="${CASTELLAN_DEV_DIR:-$repo/.dev}"
count="${CASTELLAN_NODES:-3}"
target="${CARGO_TARGET_DIR:-/var/cache/castellan/target}"
# The image map names the castellan binary by ${CARGO_TARGET_DIR}.
export CARGO_TARGET_DIR="$target"
# …and PostgreSQL 18 (the -pg18 image) by ${CASTELLAN_CACHE}.
export CASTELLAN_CACHE="${CASTELLAN_CACHE:-/var/cache/castellan}"
bin="$target/debug/castellan-devnode"
pki="$dev/pki"
logs="$dev/logs"
pids="$dev/pids"
kubeconfig="$dev/kubeconfig"

# shellcheck source=deploy/local/network.sh
source "$repo/deploy/local/network.sh"

log() { echo "nodes: $*" >&2; }
die() { echo "nodes: error: $*" >&2; exit 1; }

# The API server's port base (for the kubelet ports), from the cluster's kubeconfig.
port_base() {
  [[ -f "$kubeconfig" ]] || die "no cluster in $dev (run deploy/local/cluster.sh up first)"
  local api_port
  api_port="$(sed -nE 's#^ *server: https://[^:]+:([0-9]+).*#\1#p' "$kubeconfig" | head -n1)"
  [[ -n "$api_port" ]] || die "cannot read the API server port from $kubeconfig"
  echo $((api_port - 443))
}

names() { local i; for i in $(seq 1 "$count"); do echo "node-$i"; done; }
index_of() { [[ "$1" =~ ^node-([0-9]+)$ ]] || die "node names are node-N, not $1"; echo "${BASH_REMATCH[1]}"; }

build() {
  log "building castellan-devnode"
  (cd "$repo" && CARGO_TARGET_DIR="$target" nice cargo build --quiet -p castellan-devnode) \
    || die "building castellan-devnode failed"
}

# The kubelet serving certificate: signed by the cluster CA, since the API server checks
# it (--kubelet-certificate-authority) when it fetches logs.
node_cert() { # name
  local name="$1"
  [[ -f "$pki/$name.crt" ]] && return 0
  local ext="$pki/$name.ext"
  printf '%s\n' "basicConstraints=CA:FALSE" "keyUsage=critical,digitalSignature,keyEncipherment" \
    "extendedKeyUsage=serverAuth,clientAuth" "subjectAltName=IP:127.0.0.1,DNS:$name" > "$ext"
  openssl genrsa -out "$pki/$name.key" 2048 2>/dev/null
  openssl req -new -key "$pki/$name.key" -subj "/O=system:nodes/CN=system:node:$name" \
    -out "$pki/$name.csr" 2>/dev/null
  openssl x509 -req -in "$pki/$name.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
    -days 3650 -sha256 -extfile "$ext" -out "$pki/$name.crt" 2>/dev/null
  rm -f "$pki/$name.csr" "$ext"
}

# Whether the process in a pid file still runs and is ours: pids wrap around quickly
# (pid_max is often 32768), so a stale pid file may name an unrelated process, which
# must never be signalled.
ours() { # pid
  [[ "$1" =~ ^[0-9]+$ && "$1" -gt 1 ]] || return 1
  case "$(readlink "/proc/$1/exe" 2>/dev/null)" in
    */castellan-devnode | */"castellan-devnode (deleted)") return 0 ;;
    *) return 1 ;;
  esac
}

running() { # name
  [[ -f "$pids/$1" ]] || return 1
  ours "$(cat "$pids/$1")"
}

start_process() { # name command...
  local name="$1"; shift
  running "$name" && return 0
  setsid "$@" >>"$logs/$name.log" 2>&1 < /dev/null &
  local pid=$!
  echo "$pid" > "$pids/$name"
  # Until the forked shell has exec'd setsid and setsid the node, /proc/PID/exe names
  # bash or setsid, and `running` would take a node that is starting for one that exited.
  local tries=0
  while ! ours "$pid" && kill -0 "$pid" 2>/dev/null && (( tries++ < 100 )); do
    sleep 0.05
  done
}

images_args() {
  local images="${CASTELLAN_IMAGES:-$repo/deploy/node/images.yaml}"
  [[ -f "$images" ]] && echo "--images $images"
  return 0
}

start_node() { # name
  local name="$1" index base octet
  index="$(index_of "$name")"
  base="$(port_base)"
  octet="$(castellan_pod_octet "$base" "$index")" || die "no pod addresses for $name"
  node_cert "$name"
  # shellcheck disable=SC2046 # images_args is empty or two words
  start_process "$name" "$bin" node --kubeconfig "$kubeconfig" --name "$name" --index "$index" \
    --pod-octet "$octet" \
    --state-dir "$dev/nodes/$name" --kubelet-port $((base + 100 + index)) \
    --tls-cert "$pki/$name.crt" --tls-key "$pki/$name.key" --client-ca "$pki/ca.crt" \
    $(images_args)
}

stop_process() { # name
  local name="$1" pid
  [[ -f "$pids/$name" ]] || return 0
  pid="$(cat "$pids/$name")"
  if ours "$pid"; then
    # SIGTERM: the node kills its containers' processes itself, then exits.
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do ours "$pid" || break; sleep 0.1; done
    if ours "$pid"; then kill -KILL "$pid" 2>/dev/null || true; fi
  fi
  rm -f "$pids/$name"
}

# Whatever a node that was killed outright could not stop: the process groups it
# recorded under processes/, when the recorded start time shows it is the same process.
kill_recorded() { # state-dir
  local record pid recorded now
  for record in "$1"/processes/*; do
    [[ -f "$record" ]] || continue
    pid="$(basename "$record")"
    # The record may go between the test and the read (its container exited): under
    # set -e a failed read here ended `nodes.sh stop` silently with status 1.
    recorded="$({ cut -d' ' -f1 < "$record"; } 2>/dev/null || true)"
    now="$(sed -E 's/^.*\) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f20 || true)"
    if [[ "$pid" -gt 1 && -n "$now" && "$now" == "$recorded" ]]; then kill -KILL -- "-$pid" 2>/dev/null || true; fi
    rm -f "$record"
  done
}

# Container processes of this cluster's nodes, found by the marker every container
# process inherits (CASTELLAN_DEVNODE_CONTAINER=<node state>/pods/...): this also finds
# processes that left their container's process group.
marked() { # [node-name]
  local prefix="CASTELLAN_DEVNODE_CONTAINER=$dev/nodes/${1:+$1/}" file pid
  for file in /proc/[0-9]*/environ; do
    pid="${file#/proc/}"; pid="${pid%/environ}"
    # Kernel threads and processes that just exited have no readable environment.
    if { tr '\0' '\n' < "$file"; } 2>/dev/null | grep -qF -- "$prefix"; then echo "$pid"; fi
  done
}

kill_marked() { # [node-name]
  local pid round
  for round in 1 2 3; do
    for pid in $(marked "${1:-}"); do if [[ "$pid" -gt 1 ]]; then kill -KILL "$pid" 2>/dev/null || true; fi; done
  done
}

wait_ready() { # name...
  local k=("$dev/bin/kubectl" --kubeconfig "$kubeconfig") name
  for name in "$@"; do
    for _ in $(seq 1 60); do
      running "$name" || { tail -n 5 "$logs/$name.log" >&2; die "$name exited; its log is $logs/$name.log"; }
      "${k[@]}" get node "$name" >/dev/null 2>&1 && break
      sleep 0.5
    done
    "${k[@]}" wait --for condition=Ready --timeout 60s "node/$name" >/dev/null \
      || die "$name did not become Ready; its log is $logs/$name.log"
  done
}

up() {
  port_base >/dev/null
  # The -pg18 image's programs: instant when `make` has composed them, otherwise
  # downloaded and composed now; a missing piece stops here, not in a pod.
  "$repo/deploy/local/postgres.sh" 18.4 >/dev/null || die "PostgreSQL 18 for the -pg18 image is missing"
  "$repo/deploy/local/postgres.sh" 18.3 >/dev/null || die "PostgreSQL 18.3 for the -pg18.3 image is missing"
  build
  mkdir -p "$logs" "$pids" "$dev/nodes"
  local name
  for name in $(names); do start_node "$name"; done
  start_process proxy "$bin" proxy --kubeconfig "$kubeconfig"
  # shellcheck disable=SC2046
  wait_ready $(names)
  running proxy || die "the proxy exited; its log is $logs/proxy.log"
  log "$count nodes and the proxy are running (logs in $logs)"
}

# The storage the nodes' agents built (deploy/local/agent.sh): pools are mounted under
# $dev/pools (itself a shared self-bind mount, made by the nodes for the agent's
# Bidirectional volume) and the nodes' disks are loop devices over files under
# $dev/disks. Only
# what is under this cluster's state directory is touched: another cluster's (or the
# host's) mounts and loop devices are not ours. Deepest mounts first; a loop device is
# forgotten by btrfs before it is detached, so no stale member lingers in the kernel's
# btrfs device list.
pool_mounts() {
  findmnt -rn -o TARGET | awk -v root="$dev/pools" '$0 == root || index($0, root "/") == 1'
}

release_disks() {
  local target loop file left
  # One at a time, deepest first, looking again after each: unmounting one of several
  # shared mounts stacked at the same place takes its peers with it.
  for _ in $(seq 1 100); do
    target="$(pool_mounts | sort -r | head -n1)"
    [[ -n "$target" ]] || break
    umount "$target" 2>/dev/null || umount --lazy "$target" 2>/dev/null || true
  done
  while read -r loop file; do
    [[ -n "$loop" ]] || continue
    case "$file" in "$dev"/*) ;; *) continue ;; esac
    btrfs device scan --forget "$loop" >/dev/null 2>&1 || true
    losetup -d "$loop" || die "detaching $loop ($file) failed"
  done < <(losetup -n -l -O NAME,BACK-FILE 2>/dev/null)
  left="$(pool_mounts)"
  left+="$(losetup -n -l -O NAME,BACK-FILE 2>/dev/null | awk -v root="$dev/" 'index($2, root) == 1')"
  [[ -z "$left" ]] || die "still mounted or attached after releasing the disks: $left"
  log "pools under $dev/pools unmounted, loop devices over $dev detached"
}

down() {
  local name dir
  stop_process proxy
  for name in $(cd "$pids" 2>/dev/null && ls -d node-* 2>/dev/null); do stop_process "$name"; done
  for dir in "$dev"/nodes/*; do [[ -d "$dir" ]] && kill_recorded "$dir"; done
  kill_marked
  # Like cluster.sh down: anything of ours still alive now is a leak, said loudly.
  local pid left=""
  for pid in $(marked) $(pgrep -f -- "castellan-devnode .*--kubeconfig $kubeconfig" || true); do
    left+="$pid $(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null)"$'\n'
  done
  if [[ -n "$left" ]]; then
    echo "$left" >&2
    die "processes of the nodes in $dev are still running after down"
  fi
  log "nodes and proxy stopped"
  # After the nodes: their agents (pods) are gone and hold nothing open any more.
  release_disks
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  stop) [[ -n "${2:-}" ]] || die "usage: $0 stop NAME"; stop_process "$2"; kill_recorded "$dev/nodes/$2"; kill_marked "$2" ;;
  start) [[ -n "${2:-}" ]] || die "usage: $0 start NAME"; mkdir -p "$logs" "$pids"; start_node "$2"; wait_ready "$2" ;;
  release-disks) release_disks ;;
  status) for name in $(names) proxy; do running "$name" || exit 1; done ;;
  *) echo "usage: $0 up|down|stop NAME|start NAME|status|release-disks" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# DatabaseCluster benchmark: seconds from `kubectl apply` to Ready for 1- and
# 3-instance PostgreSQL clusters, and the operator's peak resident memory while it
# manages 10 clusters.
#
#   bench/clusters.sh            (or `make bench`)
#
# It starts its own local cluster (bench/local_cluster.sh: state in .dev/bench, port
# base 56000, so it runs beside `make up` and `make test`), runs the operator as a host
# process so that its memory can be read from /proc (VmHWM: peak resident set; the
# release build), and tears everything down at the end. Environment: BENCH_SAMPLES
# (default 3) samples of each apply-to-Ready figure; BENCH_CLUSTERS (default 10)
# clusters for the memory figure.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=bench/local_cluster.sh
source "$repo/bench/local_cluster.sh"
samples="${BENCH_SAMPLES:-3}"
clusters="${BENCH_CLUSTERS:-10}"
dev="$CASTELLAN_DEV_DIR"
k=("$dev/bin/kubectl" --kubeconfig "$dev/kubeconfig")
ns=bench
class=bench-local
operator_pid=""

log() { echo "bench: $*" >&2; }
die() { echo "bench: error: $*" >&2; exit 1; }

cleanup() {
  if [[ -n "$operator_pid" && "$(readlink "/proc/$operator_pid/exe" 2>/dev/null)" == */castellan* ]]; then
    kill "$operator_pid" 2>/dev/null || true
  fi
  bench_cluster_down
}
trap cleanup EXIT

bench_cluster_up
# The nodes run the debug build (the image map's); the measured operator is the
# release build, as it would be deployed.
release="$(cd "$repo" && cargo build --quiet -p castellan && deploy/release/build.sh --quiet)" \
  || die "building castellan failed"

uid="$(id -u postgres)"
gid="$(id -g postgres)"
"${k[@]}" create namespace "$ns" >/dev/null

# Enough local volumes for every instance the benchmark creates at once.
volumes() { # count
  local manifests="apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: $class}
provisioner: kubernetes.io/no-provisioner
volumeBindingMode: WaitForFirstConsumer
" i node dir
  for i in $(seq 1 "$1"); do
    node="node-$(( (i - 1) % 3 + 1 ))"
    dir="$dev/volumes/v$i"
    mkdir -p "$dir" && chown "$uid:$gid" "$dir" && chmod 700 "$dir"
    manifests+="---
apiVersion: v1
kind: PersistentVolume
metadata: {name: $class-$i}
spec:
  capacity: {storage: 2Gi}
  accessModes: [ReadWriteOnce]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: $class
  local: {path: $dir}
  nodeAffinity:
    required:
      nodeSelectorTerms:
      - matchExpressions: [{key: kubernetes.io/hostname, operator: In, values: [$node]}]
"
  done
  echo "$manifests" | "${k[@]}" apply -f - >/dev/null
}

# Released local volumes are not reused by the no-provisioner class: recreate them
# (with empty directories) between rounds.
reset_volumes() { # count
  "${k[@]}" delete pv --all --wait=true --timeout=60s >/dev/null 2>&1 || true
  [[ -z "$("${k[@]}" get pv -o name 2>/dev/null)" ]] || die "old volumes are still there: $("${k[@]}" get pv 2>&1)"
  rm -rf "$dev/volumes"
  volumes "$1"
}

log "starting the operator"
(
  export KUBECONFIG="$dev/kubeconfig" RUST_LOG=warn
  exec "$release/castellan" operator --postgres-uid "$uid" --postgres-gid "$gid" \
    --namespace "$ns" --watch-namespace "$ns" --metrics-address 127.0.63.1:8080 --identity bench
) >"$dev/logs/operator.log" 2>&1 &
operator_pid=$!

apply() { # name replicas
  "${k[@]}" apply -n "$ns" -f - >/dev/null <<EOF
apiVersion: castellan.io/v1alpha1
kind: DatabaseCluster
metadata: {name: $1}
spec:
  engine: postgresql
  version: "15"
  replicas: $2
  storage: {size: 1Gi, storageClassName: $class}
EOF
}

ready() { # name replicas
  [[ "$("${k[@]}" get dbc "$1" -n "$ns" -o jsonpath='{.status.phase}/{.status.readyInstances}' 2>/dev/null)" == "Ready/$2" ]]
}

# Seconds from apply to Ready, one sample.
apply_to_ready() { # name replicas
  local start end
  start=$(date +%s.%N)
  apply "$1" "$2"
  local deadline=$((SECONDS + 300))
  until ready "$1" "$2"; do
    (( SECONDS < deadline )) || die "$1 was not Ready within 300 s: $("${k[@]}" get dbc,pods -n "$ns" 2>&1)"
    sleep 0.2
  done
  end=$(date +%s.%N)
  "${k[@]}" delete dbc "$1" -n "$ns" --wait=true --timeout=120s >/dev/null
  # Owned pods and claims go through the garbage collector: wait until they are gone,
  # or a claim of this round could bind a volume made for the next.
  until [[ -z "$("${k[@]}" get pods,pvc -n "$ns" -o name 2>/dev/null)" ]]; do sleep 0.5; done
  awk -v a="$start" -v b="$end" 'BEGIN { printf "%.2f\n", b - a }'
}

summary() { # label values...
  local label="$1"; shift
  printf '%s\n' "$@" | sort -n | awk -v label="$label" '
    { v[NR] = $1 }
    END { printf "%-44s min %6.1f s   median %6.1f s   max %6.1f s   (%d samples)\n", label, v[1], v[int((NR + 1) / 2)], v[NR], NR }'
}

declare -a one three
for i in $(seq 1 "$samples"); do
  reset_volumes 3
  one+=("$(apply_to_ready "one-$i" 1)")
  reset_volumes 3
  three+=("$(apply_to_ready "three-$i" 3)")
done

reset_volumes "$clusters"
log "applying $clusters clusters"
for i in $(seq 1 "$clusters"); do apply "c$i" 1; done
deadline=$((SECONDS + 600))
for i in $(seq 1 "$clusters"); do
  until ready "c$i" 1; do
    (( SECONDS < deadline )) || die "c$i was not Ready within 600 s"
    sleep 1
  done
done
# Let it run the steady state (status polls, resyncs) for a while before reading.
sleep 30
peak_kib="$(awk '/^VmHWM:/ {print $2}' "/proc/$operator_pid/status")"
current_kib="$(awk '/^VmRSS:/ {print $2}' "/proc/$operator_pid/status")"

echo
echo "DatabaseCluster benchmark ($(nproc) cores, $(date -u +%Y-%m-%d))"
summary "kubectl apply → Ready, 1 instance" "${one[@]}"
summary "kubectl apply → Ready, 3 instances (async)" "${three[@]}"
awk -v label="operator memory with $clusters Ready clusters" -v peak="$peak_kib" -v now="$current_kib" \
  'BEGIN { printf "%-44s peak %6.1f MiB   now %6.1f MiB\n", label, peak / 1024, now / 1024 }'

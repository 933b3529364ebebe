#!/usr/bin/env bash
# The benchmarks' own local cluster: control plane and 3 process-backed nodes with their
# state in .dev/bench and port base 56000 (unless moved: below), so that a benchmark runs beside `make up`
# (16000) and `make test` (26000) and neither measures nor disturbs their clusters.
#
#   bench/local_cluster.sh COMMAND...   bring it up, run COMMAND against it, tear it
#                                       down whatever COMMAND's outcome; exit as COMMAND
#   source bench/local_cluster.sh       in a benchmark script that does more around the
#                                       cluster (bench/clusters.sh): bench_cluster_up,
#                                       and bench_cluster_down from its own EXIT trap
#
# Either way CASTELLAN_DEV_DIR, CASTELLAN_PORT_BASE (what deploy/local/*.sh and
# tests/support read) and CASTELLAN_KUBECONFIG are exported for the cluster.
#
# Two benchmarks at once (or a benchmark beside another bench cluster) need a state
# directory and a port base each: BENCH_DEV_DIR and BENCH_PORT_BASE (36000 or 46000; the
# port base also picks the cluster's loopback ranges, deploy/local/network.sh) move this
# one. They are not read from CASTELLAN_DEV_DIR / CASTELLAN_PORT_BASE, which a shell
# that works with `make up`'s cluster may have set: the benchmark would tear that down.

bench_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export CASTELLAN_DEV_DIR="${BENCH_DEV_DIR:-$bench_repo/.dev/bench}"
export CASTELLAN_PORT_BASE="${BENCH_PORT_BASE:-56000}"
export CASTELLAN_KUBECONFIG="$CASTELLAN_DEV_DIR/kubeconfig"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/cache/castellan/target}"

bench_cluster_down() {
  "$bench_repo/deploy/local/s3.sh" down >/dev/null 2>&1 || true
  "$bench_repo/deploy/local/nodes.sh" down >/dev/null 2>&1 || true
  "$bench_repo/deploy/local/cluster.sh" down >/dev/null 2>&1 || true
}

# A previous run that was killed before its teardown leaves its cluster behind: start
# from nothing, or the benchmark would measure a cluster in an unknown state.
bench_cluster_up() {
  bench_cluster_down
  "$bench_repo/deploy/local/deps.sh"
  "$bench_repo/deploy/local/cluster.sh" up
  # The S3 server, for the benchmarks that back up (BENCH_S3=1).
  if [[ -n "${BENCH_S3:-}" ]]; then "$bench_repo/deploy/local/s3.sh" up; fi
  "$bench_repo/deploy/local/nodes.sh" up
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  set -euo pipefail
  [[ $# -gt 0 ]] || { echo "usage: $0 COMMAND..." >&2; exit 2; }
  trap bench_cluster_down EXIT
  bench_cluster_up
  "$@"
fi

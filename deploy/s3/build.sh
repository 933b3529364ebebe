#!/usr/bin/env bash
# Builds the pinned S3-compatible server for the local cluster (s3s-fs: a real S3 server
# over a directory, from the Rust registry) into a cache outside the clone, keyed by its
# version, so only the first run on a machine pays for the build. docs/operations.md
# says why this server and not Garage or MinIO.
# Prints the path of the s3s-fs binary on stdout; progress goes to stderr.
set -euo pipefail

# 0.14.1 is the newest release whose rust-version (1.92) this machine's Rust meets;
# 0.15 and later need 1.96.
version=0.14.1
exec "$(dirname "$0")/../local/cargo-install.sh" s3s-fs "$version" "4 to 7" --features binary

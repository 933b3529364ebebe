#!/usr/bin/env bash
# The local cluster's object storage: the pinned S3-compatible server (deploy/s3/build.sh,
# s3s-fs) as a plain process on loopback, with a bucket for backups and the credentials
# to reach it, in the cluster's state directory.
#
#   s3.sh up      start (or find running) and wait until it answers; create the bucket
#                 `castellan`; write <state>/s3.env; when the cluster is there
#                 (<state>/kubeconfig), apply the Secret `castellan-s3` in `default`
#   s3.sh down    stop it and remove its data, credentials, s3.env and the Secret
#   s3.sh stop    stop the process only (an object store outage): data, credentials,
#                 s3.env and the Secret stay, and `up` starts it again with them, on
#                 the port s3.env records unless CASTELLAN_PORT_BASE is given
#   s3.sh status  exit 0 when it answers a signed request
#
# Environment:
#   CASTELLAN_DEV_DIR    the cluster's state directory (default: <repo>/.dev)
#   CASTELLAN_PORT_BASE  the server listens on 127.0.0.1:<base + 900> (default 16000:
#                        16900), so clusters with different port bases run side by side
#
# 127.0.0.1 reaches the server from everywhere in the local cluster: the process-backed
# nodes run pods as host processes in the host's network namespace (their 127.x.y.z pod
# addresses are on the same loopback), the way pods here reach the API server too. The
# cluster has no DNS, so S3_ENDPOINT is an address and port.
#
# State: <state>/s3/data (the server's root: one directory per bucket, plus the server's
# own metadata files), <state>/s3/credentials (generated on the first `up`, kept until
# `down`), the log <state>/logs/s3s-fs.log and the pid <state>/pids/s3s-fs.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
dev="${CASTELLAN_DEV_DIR:-$repo/.dev}"
base="${CASTELLAN_PORT_BASE:-16000}"
host=127.0.0.1
port=$((base + 900))
bucket=castellan
# s3s-fs checks the signature, which names a region, but keeps no region of its own;
# clients that insist on one (the AWS SDKs, object_store) are given this.
region=us-east-1
state="$dev/s3"
logs="$dev/logs"
pids="$dev/pids"
name=s3s-fs
env_file="$dev/s3.env"
# A server that was stopped (not taken down) comes back where its s3.env, and the
# Secret, say it is, whoever starts it: without CASTELLAN_PORT_BASE, the recorded port.
if [[ -z "${CASTELLAN_PORT_BASE:-}" && -f "$env_file" ]]; then
  recorded="$(sed -n 's#^S3_ENDPOINT=http://[^:]*:\([0-9]*\)$#\1#p' "$env_file")"
  if [[ -n "$recorded" ]]; then port="$recorded"; fi
fi
endpoint="http://$host:$port"
secret=castellan-s3
namespace=default

log() { echo "s3: $*" >&2; }
die() { echo "s3: error: $*" >&2; exit 1; }

# Whether the recorded pid is still the server (see cluster.sh: pids wrap, so a stale
# pid file may name an unrelated process, which is never signalled).
ours() { # pid
  [[ "$1" =~ ^[0-9]+$ ]] && (( $1 > 1 )) || return 1
  [[ "$(basename "$(readlink "/proc/$1/exe" 2>/dev/null)")" == "$name" ]]
}

running() {
  [[ -f "$pids/$name" ]] && ours "$(cat "$pids/$name")"
}

# The access key pair, generated once per state directory. Hex only, so that the values
# need no quoting in s3.env, on a command line or in a URL.
credentials() {
  if [[ ! -s "$state/credentials" ]]; then
    command -v openssl >/dev/null || die "openssl is required (run deploy/local/deps.sh)"
    mkdir -p "$state"
    (
      umask 077
      echo "access_key_id=$(openssl rand -hex 10 | tr a-f A-F)" > "$state/credentials.tmp"
      echo "secret_access_key=$(openssl rand -hex 20)" >> "$state/credentials.tmp"
    )
    mv "$state/credentials.tmp" "$state/credentials"
  fi
  access_key_id="$(sed -n 's/^access_key_id=//p' "$state/credentials")"
  secret_access_key="$(sed -n 's/^secret_access_key=//p' "$state/credentials")"
  [[ -n "$access_key_id" && -n "$secret_access_key" ]] || die "$state/credentials is incomplete; run $0 down"
}

# A signed request (SigV4, path style). s3s-fs requires x-amz-content-sha256, which curl
# signs when it is given.
s3_curl() { # curl arguments... (the URL relative to the endpoint comes last)
  local args=("$@")
  local path="${args[-1]}"
  unset 'args[-1]'
  curl -sS --max-time 5 --aws-sigv4 "aws:amz:$region:s3" --user "$access_key_id:$secret_access_key" \
    -H "x-amz-content-sha256: UNSIGNED-PAYLOAD" "${args[@]}" "$endpoint/$path"
}

answers() { [[ "$(s3_curl -o /dev/null -w '%{http_code}' "" 2>/dev/null)" == 200 ]]; }

# Whether a process exists and has not exited (a zombie has).
alive() { # pid
  [[ -r "/proc/$1/stat" ]] && [[ "$(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null)" != Z ]]
}

wait_until_answers() {
  local deadline=$((SECONDS + 30)) pid
  pid="$(cat "$pids/$name")"
  until answers; do
    # Alive, not `running`: right after the fork, on a loaded machine, the process may
    # not have become s3s-fs yet (its /proc/PID/exe is still bash).
    if ! alive "$pid"; then
      tail -n 20 "$logs/$name.log" >&2 || true
      die "$name exited; its log is $logs/$name.log"
    fi
    (( SECONDS < deadline )) || die "$name did not answer on $endpoint within 30s; its log is $logs/$name.log"
    sleep 0.2
  done
}

create_bucket() {
  local code
  code="$(s3_curl -o /dev/null -w '%{http_code}' -I "$bucket")" || die "asking $endpoint for bucket $bucket failed"
  case "$code" in
    200) return 0 ;;
    404) ;;
    *) die "HEAD $endpoint/$bucket answered $code" ;;
  esac
  code="$(s3_curl -o "$state/create-bucket.out" -w '%{http_code}' -X PUT "$bucket")" \
    || die "creating bucket $bucket at $endpoint failed"
  [[ "$code" == 200 ]] || die "creating bucket $bucket answered $code: $(cat "$state/create-bucket.out")"
  rm -f "$state/create-bucket.out"
  log "created bucket $bucket"
}

write_env() {
  (
    umask 077
    cat > "$env_file.tmp" <<ENV
S3_ENDPOINT=$endpoint
S3_BUCKET=$bucket
AWS_ACCESS_KEY_ID=$access_key_id
AWS_SECRET_ACCESS_KEY=$secret_access_key
AWS_REGION=$region
ENV
  )
  mv "$env_file.tmp" "$env_file"
}

# The Secret a DatabaseCluster's spec.backup.credentials names (keys accessKeyId and
# secretAccessKey, the defaults). Read from files, so the keys are on no command line.
apply_secret() {
  local k=("$dev/bin/kubectl" --kubeconfig "$dev/kubeconfig")
  local keys
  keys="$(mktemp -d "$state/secret.XXXXXX")"
  (
    umask 077
    printf '%s' "$access_key_id" > "$keys/accessKeyId"
    printf '%s' "$secret_access_key" > "$keys/secretAccessKey"
  )
  if ! "${k[@]}" create secret generic "$secret" --namespace "$namespace" \
      --from-file "accessKeyId=$keys/accessKeyId" --from-file "secretAccessKey=$keys/secretAccessKey" \
      --dry-run=client -o yaml \
    | "${k[@]}" apply --server-side --force-conflicts --field-manager castellan-dev -f - >/dev/null; then
    rm -rf "$keys"
    die "applying Secret $namespace/$secret failed (is the cluster in $dev up?)"
  fi
  rm -rf "$keys"
}

up() {
  local bin
  bin="$("$repo/deploy/s3/build.sh")" || die "building the S3 server failed (see above)"
  command -v setsid >/dev/null || die "setsid is required (run deploy/local/deps.sh)"
  mkdir -p "$state/data" "$logs" "$pids"
  credentials
  if ! running; then
    if (exec 3<>"/dev/tcp/$host/$port") 2>/dev/null; then
      die "$host:$port is already in use by another process (another cluster with port base $base?)"
    fi
    # setsid: the server outlives this script and make, and `down` ends its whole group.
    # Its keys are on its command line (s3s-fs takes them no other way): this is a
    # development server on loopback. At `info` it logs its start and every request it
    # refuses, not the requests it serves.
    RUST_LOG="${RUST_LOG:-info}" setsid "$bin" --host "$host" --port "$port" \
      --access-key "$access_key_id" --secret-key "$secret_access_key" "$state/data" \
      >>"$logs/$name.log" 2>&1 < /dev/null &
    echo $! > "$pids/$name"
  fi
  wait_until_answers
  create_bucket
  write_env
  if [[ -f "$dev/kubeconfig" ]]; then
    apply_secret
    log "ready on $endpoint: bucket $bucket, Secret $namespace/$secret, settings in $env_file"
  else
    log "ready on $endpoint: bucket $bucket, settings in $env_file (no cluster in $dev: no Secret)"
  fi
}

stop() {
  local pid
  if [[ -f "$pids/$name" ]]; then
    pid="$(cat "$pids/$name")"
    if ours "$pid"; then
      kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
      for _ in $(seq 1 50); do ours "$pid" || break; sleep 0.1; done
      if ours "$pid"; then kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true; fi
      for _ in $(seq 1 20); do ours "$pid" || break; sleep 0.1; done
      ! ours "$pid" || die "$name (pid $pid) is still running after SIGKILL"
    fi
    rm -f "$pids/$name"
  fi
}

down() {
  local pid
  stop
  # Like cluster.sh down: a server of this state directory still alive now is a leak
  # (its root, <state>/s3/data, is on its command line), said loudly.
  local left=""
  for pid in $(pgrep -f -- "$state/data" || true); do
    if ours "$pid"; then left+="$pid: $(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null)"$'\n'; fi
  done
  if [[ -n "$left" ]]; then
    echo "$left" >&2
    die "an S3 server of $dev is still running after down"
  fi
  # The Secret's keys die with the server; the next `up` applies new ones. Best effort:
  # with the cluster already gone there is no Secret to remove.
  if [[ -f "$dev/kubeconfig" && -x "$dev/bin/kubectl" ]]; then
    "$dev/bin/kubectl" --kubeconfig "$dev/kubeconfig" --request-timeout=5s delete secret "$secret" \
      --namespace "$namespace" --ignore-not-found --wait=false >/dev/null 2>&1 \
      || log "could not remove Secret $namespace/$secret (is the cluster in $dev down?)"
  fi
  rm -rf "$state" "$env_file" "$logs/$name.log"
  log "stopped; removed $state and $env_file"
}

status() {
  running || return 1
  [[ -s "$state/credentials" ]] || return 1
  credentials
  answers
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  stop) stop; log "stopped; its data and settings stay for the next up" ;;
  status) status ;;
  *) echo "usage: $0 up|down|stop|status" >&2; exit 2 ;;
esac

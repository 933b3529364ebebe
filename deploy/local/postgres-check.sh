#!/usr/bin/env bash
# Proves that a PostgreSQL directory composed by deploy/local/postgres.sh does what the
# instance manager asks of it, with the programs it really runs and TLS everywhere, the
# way a cluster refuses plain text:
#
#   initdb with data checksums; the server with ssl=on and a certificate from a
#   throwaway CA; psql with sslmode=verify-full; pg_basebackup over TLS with a client
#   certificate (hba `hostssl replication … cert`); that copy started as a streaming
#   replica (pg_stat_wal_receiver streaming, its walsender's connection encrypted);
#   pg_rewind over TLS of a diverged former primary that crashed (after crash recovery
#   in single-user mode: see that step for why pg_rewind cannot run it here);
#   pg_upgrade --check, then the upgrade, of a data directory of Debian's PostgreSQL 15,
#   and the 18 server started on the result (vacuumdb --analyze-in-stages).
#
#   postgres-check.sh [BIN_DIR]   (default: the directory postgres.sh prints for 18.4)
#
# Environment: CASTELLAN_PG15_BIN (Debian's /usr/lib/postgresql/15/bin), CHECK_PORT (the
# first of four loopback ports, 25432). Runs the servers as the user postgres when started
# as root (postgres refuses root). Takes about 10 s; everything lives in a temporary
# directory, removed at the end. Exits non-zero on the first step that fails.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
bin="${1:-$("$repo/deploy/local/postgres.sh" 18.4)/bin}"
pg15="${CASTELLAN_PG15_BIN:-/usr/lib/postgresql/15/bin}"
port="${CHECK_PORT:-25432}"
replica_port=$((port + 1))

log() { echo "postgres-check: $*" >&2; }
die() { echo "postgres-check: FAILED: $*" >&2; exit 1; }

[[ -x "$bin/postgres" ]] || die "no postgres in $bin"
[[ -x "$pg15/postgres" ]] || die "no PostgreSQL 15 in $pg15 (deploy/local/deps.sh installs it)"

work="$(mktemp -d /tmp/castellan-postgres-check.XXXXXX)"
as_postgres=()
if [[ $(id -u) == 0 ]]; then
  chown postgres: "$work"
  as_postgres=(runuser -u postgres --)
fi
run() { "${as_postgres[@]}" "$@"; }
cleanup() {
  for data in "$work"/primary "$work"/replica "$work"/old15 "$work"/new18; do
    [[ -f "$data/postmaster.pid" ]] && run "$bin/pg_ctl" -D "$data" -m immediate stop >/dev/null 2>&1
  done
  rm -rf "$work"
}
trap cleanup EXIT

# A throwaway CA, the server's certificate (for localhost, which verify-full checks) and
# client certificates whose CN is the role they log in as (hba `cert`).
tls="$work/tls"
mkdir -p "$tls"
openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=check-ca \
  -keyout "$tls/ca.key" -out "$tls/ca.crt" 2>/dev/null
issue() { # name cn [extensions]
  openssl req -newkey rsa:2048 -nodes -subj "/CN=$2" -keyout "$tls/$1.key" -out "$tls/$1.csr" 2>/dev/null
  openssl x509 -req -in "$tls/$1.csr" -CA "$tls/ca.crt" -CAkey "$tls/ca.key" -CAcreateserial \
    -days 1 ${3:+-extfile <(printf '%s\n' "$3")} -out "$tls/$1.crt" 2>/dev/null
}
issue server localhost 'subjectAltName=DNS:localhost,IP:127.0.0.1'
issue replicator replicator
issue superuser postgres
chmod 600 "$tls"/*.key
[[ -z "${as_postgres[*]}" ]] || chown -R postgres: "$tls"

tls_client() { # role
  echo "host=localhost sslmode=verify-full sslrootcert=$tls/ca.crt sslcert=$tls/$1.crt sslkey=$tls/$1.key"
}

log "$("$bin/postgres" --version), $("$bin/psql" --version)"
log "initdb with data checksums"
run "$bin/initdb" -D "$work/primary" -U postgres --data-checksums --auth=trust >/dev/null \
  || die "initdb"
cat >>"$work/primary/postgresql.conf" <<EOF
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = '$work'
ssl = on
ssl_cert_file = '$tls/server.crt'
ssl_key_file = '$tls/server.key'
ssl_ca_file = '$tls/ca.crt'
wal_log_hints = on
# pg_rewind reads the target's WAL back to the last checkpoint before the fork.
wal_keep_size = '128MB'
EOF
# Only the local socket (the check's own setup) trusts; every TCP connection is TLS
# with a client certificate, and plain text is refused.
cat >"$work/primary/pg_hba.conf" <<EOF
local all all trust
hostssl replication replicator 127.0.0.1/32 cert
hostssl all all 127.0.0.1/32 cert
hostnossl all all 0.0.0.0/0 reject
EOF
run "$bin/pg_ctl" -D "$work/primary" -l "$work/primary.log" -w start >/dev/null \
  || die "starting the primary with ssl=on: $(tail -5 "$work/primary.log")"
run "$bin/psql" -h "$work" -p "$port" -U postgres -qAt \
  -c "CREATE ROLE replicator REPLICATION LOGIN" \
  -c "GRANT EXECUTE ON FUNCTION pg_catalog.pg_ls_dir(text, boolean, boolean), pg_catalog.pg_stat_file(text, boolean), pg_catalog.pg_read_binary_file(text), pg_catalog.pg_read_binary_file(text, bigint, bigint, boolean) TO replicator" \
  -c "CREATE TABLE t AS SELECT generate_series(1, 1000) AS n" >/dev/null

log "psql over TLS, sslmode=verify-full"
out="$(run "$bin/psql" "$(tls_client superuser) port=$port dbname=postgres" -qAt \
  -c "SELECT current_setting('server_version') || ' ssl=' || ssl || ' ' || version FROM pg_stat_ssl WHERE pid = pg_backend_pid()")" \
  || die "psql with sslmode=verify-full"
log "  $out"
[[ "$out" == *"ssl=true TLS"* ]] || die "psql's connection is not encrypted: $out"
if run "$bin/psql" "host=localhost port=$port sslmode=disable user=postgres dbname=postgres" -c 'SELECT 1' >/dev/null 2>&1; then
  die "a plain-text connection was accepted"
fi

log "pg_basebackup over TLS with a client certificate"
run "$bin/pg_basebackup" -d "$(tls_client replicator) port=$port user=replicator" \
  -D "$work/replica" -X stream -R -c fast >/dev/null 2>"$work/basebackup.err" \
  || die "pg_basebackup: $(cat "$work/basebackup.err")"
sed -i "s/^port = $port/port = $replica_port/" "$work/replica/postgresql.conf"
run "$bin/pg_ctl" -D "$work/replica" -l "$work/replica.log" -w start >/dev/null \
  || die "starting the replica: $(tail -5 "$work/replica.log")"
status=""
for _ in $(seq 1 50); do
  status="$(run "$bin/psql" -h "$work" -p "$replica_port" -U postgres -qAt \
    -c "SELECT status FROM pg_stat_wal_receiver")" || true
  [[ "$status" == streaming ]] && break
  sleep 0.2
done
[[ "$status" == streaming ]] || die "the replica does not stream (status '$status'): $(tail -5 "$work/replica.log")"
walsender="$(run "$bin/psql" -h "$work" -p "$port" -U postgres -qAt \
  -c "SELECT r.usename || ' ' || r.state || ' ssl=' || s.ssl || ' ' || s.version || ' client_dn=' || s.client_dn FROM pg_stat_replication r JOIN pg_stat_ssl s USING (pid)")"
log "  replica: pg_stat_wal_receiver.status=$status; primary's walsender: $walsender"
[[ "$walsender" == *"ssl=true TLS"* ]] || die "the walreceiver's connection is not encrypted"

log "pg_rewind over TLS of a diverged former primary that crashed"
run "$bin/pg_ctl" -D "$work/replica" -w promote >/dev/null || die "promoting the replica"
run "$bin/psql" -h "$work" -p "$port" -U postgres -qAt -c "INSERT INTO t SELECT generate_series(1001, 2000)" >/dev/null
# Killed, not shut down. pg_rewind would run crash recovery itself with a postgres of
# its own version, here the wheel's 18.6 (postgres.sh), which has no OpenSSL and refuses
# the target's `ssl = on` ("SSL is not supported by this build"). So recovery runs first
# in single-user mode with the 18 server on PATH, as pg_rewind would, and pg_rewind finds
# a cleanly shut down target: what the instance manager must do on these nodes.
run "$bin/pg_ctl" -D "$work/primary" -m immediate -w stop >/dev/null
state() { run "$bin/pg_controldata" -D "$work/primary" | sed -n 's/^Database cluster state: *//p'; }
[[ "$(state)" == "in production" ]] || die "the killed primary's state: $(state)"
run "$bin/postgres" --single -F -D "$work/primary" template1 </dev/null >"$work/recovery.out" 2>&1 \
  || die "crash recovery in single-user mode: $(cat "$work/recovery.out")"
[[ "$(state)" == "shut down" ]] || die "after crash recovery the state is $(state)"
run "$bin/pg_rewind" --target-pgdata="$work/primary" \
  --source-server="$(tls_client superuser) port=$replica_port user=postgres dbname=postgres" \
  >"$work/rewind.out" 2>&1 || die "pg_rewind: $(cat "$work/rewind.out")"
log "  $(tail -1 "$work/rewind.out")"
grep -q 'Done!' "$work/rewind.out" || die "pg_rewind did not finish: $(cat "$work/rewind.out")"
run "$bin/pg_ctl" -D "$work/replica" -m fast -w stop >/dev/null

log "pg_upgrade from Debian's PostgreSQL 15 ($("$pg15/postgres" --version))"
run "$pg15/initdb" -D "$work/old15" -U postgres --data-checksums --auth=trust >/dev/null || die "initdb 15"
cat >>"$work/old15/postgresql.conf" <<EOF
port = $((port + 2))
unix_socket_directories = '$work'
EOF
run "$pg15/pg_ctl" -D "$work/old15" -l "$work/old15.log" -w start >/dev/null || die "starting 15"
run "$pg15/psql" -h "$work" -p $((port + 2)) -U postgres -qAt \
  -c "CREATE TABLE t AS SELECT generate_series(1, 1000) AS n" >/dev/null
run "$pg15/pg_ctl" -D "$work/old15" -m fast -w stop >/dev/null
run "$bin/initdb" -D "$work/new18" -U postgres --data-checksums --auth=trust >/dev/null || die "initdb 18"
# No -B: the new bindir defaults to pg_upgrade's own (resolved) directory, the only one
# whose programs are all of its version (postgres.sh). pg_upgrade writes its logs into
# the new data directory and its sockets into the current directory.
upgrade() {
  (cd "$work" && run "$bin/pg_upgrade" -b "$pg15" -d "$work/old15" -D "$work/new18" \
    -U postgres -p $((port + 2)) -P $((port + 3)) -s "$work" "$@") >"$work/upgrade.out" 2>&1
}
upgrade --check || die "pg_upgrade --check: $(cat "$work/upgrade.out")"
log "  --check: $(grep -m1 -i 'compatible' "$work/upgrade.out" || tail -1 "$work/upgrade.out")"
upgrade --copy || die "pg_upgrade: $(cat "$work/upgrade.out")"
log "  $(grep -m1 'Upgrade Complete' "$work/upgrade.out" || tail -1 "$work/upgrade.out")"
cat >>"$work/new18/postgresql.conf" <<EOF
port = $((port + 3))
unix_socket_directories = '$work'
EOF
run "$bin/pg_ctl" -D "$work/new18" -l "$work/new18.log" -w start >/dev/null \
  || die "starting the upgraded directory with $("$bin/postgres" --version): $(tail -5 "$work/new18.log")"
upgraded="$(run "$bin/psql" -h "$work" -p $((port + 3)) -U postgres -qAt \
  -c "SELECT current_setting('server_version') || ' rows=' || count(*) || ' checksums=' || current_setting('data_checksums') FROM t")"
run "$bin/vacuumdb" -h "$work" -p $((port + 3)) -U postgres --all --analyze-in-stages >/dev/null 2>&1 \
  || die "vacuumdb --analyze-in-stages on the upgraded directory"
run "$bin/pg_ctl" -D "$work/new18" -m fast -w stop >/dev/null
log "  the upgraded directory under the 18 server: $upgraded"
[[ "$upgraded" == *" rows=1000 checksums=on" ]] || die "the upgraded data: $upgraded"
log "all checks passed for $bin"

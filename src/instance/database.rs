//! What the instance manager asks its own PostgreSQL server, through sqlx over the
//! local socket: role, timeline, WAL positions, replication state and lag; the roles
//! and databases it creates at bootstrap; the heartbeat a primary writes. Statement
//! logging is off, because some statements carry passwords.

use std::path::Path;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{ConnectOptions, Row};

use crate::instance_api::{ServerStatus, Slot, Standby, slot_name};

/// The schema Castellan installs in every cluster, versioned in `migrations/`.
static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

#[derive(Debug, thiserror::Error)]
pub enum DatabaseError {
    #[error("{what}: {source}")]
    Query {
        what: &'static str,
        source: sqlx::Error,
    },
    #[error("applying Castellan's schema migrations: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("the password of role {role}: {reason}")]
    Password { role: String, reason: String },
}

fn query(what: &'static str) -> impl FnOnce(sqlx::Error) -> DatabaseError {
    move |source| DatabaseError::Query { what, source }
}

/// A small pool of superuser connections over the unix socket. Connections are made
/// on first use, so the pool outlives server restarts.
pub fn connect(socket_dir: &Path, port: u16, database: &str) -> PgPool {
    PgPoolOptions::new()
        .max_connections(3)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy_with(connect_options(socket_dir, port, database))
}

/// How the pool's sessions connect.
///
/// They commit with `synchronous_commit = local`: nothing the instance manager writes
/// (the roles' passwords, Castellan's schema, the application database, the heartbeat)
/// waits for the synchronous quorum. A primary restarted in place sets its roles again
/// before it reports itself running, and its standbys can only reconnect once it is
/// ready (`-rw` routes to ready pods only): a commit that waited for them waited for
/// ever, and the supervisor with it (no log, no lease enforcement, the pod not ready).
/// These writes are idempotent and made again from the Secrets whenever a primary is
/// prepared; they reach the standbys as soon as those stream. Clients' commits still
/// wait for the quorum. A startup option, so that a `synchronous_commit` among the
/// cluster's parameters (a lower-priority source) cannot override it.
fn connect_options(socket_dir: &Path, port: u16, database: &str) -> PgConnectOptions {
    PgConnectOptions::new()
        .socket(socket_dir)
        .port(port)
        .username("postgres")
        .database(database)
        .application_name("castellan-instance")
        .options([("synchronous_commit", "local")])
        .disable_statement_logging()
}

pub async fn status(pool: &PgPool) -> Result<ServerStatus, DatabaseError> {
    let row = sqlx::query(
        "select pg_is_in_recovery() as in_recovery, current_setting('server_version') as version,
                current_setting('synchronous_standby_names') as sync_names",
    )
    .fetch_one(pool)
    .await
    .map_err(query("reading recovery state"))?;
    let in_recovery: bool = row.get("in_recovery");
    let server_version: String = row.get("version");
    let synchronous_standby_names: String = row.get("sync_names");
    let pending_restart = pending_restart(pool).await?;

    if in_recovery {
        let row = sqlx::query(
            "select pg_last_wal_replay_lsn()::text as replay, pg_last_wal_receive_lsn()::text as receive,
                    (select received_tli::bigint from pg_stat_wal_receiver) as timeline,
                    (select status = 'streaming' from pg_stat_wal_receiver) as streaming",
        )
        .fetch_one(pool)
        .await
        .map_err(query("reading replay position"))?;
        // The heartbeat table arrives by replication; before the first one it is absent.
        let lag_seconds: Option<f64> = sqlx::query_scalar(
            "select extract(epoch from clock_timestamp() - written_at)::float8
               from castellan.heartbeat where to_regclass('castellan.heartbeat') is not null",
        )
        .fetch_optional(pool)
        .await
        .unwrap_or(None);
        Ok(ServerStatus {
            in_recovery,
            timeline: row.get("timeline"),
            lsn: row.get("replay"),
            receive_lsn: row.get("receive"),
            lag_seconds: lag_seconds.map(|s| s.max(0.0)),
            streaming: Some(row.get::<Option<bool>, _>("streaming").unwrap_or(false)),
            standbys: Vec::new(),
            slots: Vec::new(),
            server_version,
            synchronous_standby_names: synchronous_standby_names.clone(),
            pending_restart,
        })
    } else {
        let row = sqlx::query(
            "select pg_current_wal_lsn()::text as lsn,
                    ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint as timeline",
        )
        .fetch_one(pool)
        .await
        .map_err(query("reading the write position"))?;
        let standbys = sqlx::query(
            "select application_name, state, sync_state, replay_lsn::text as replay_lsn,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), replay_lsn)::bigint as lag_bytes
               from pg_stat_replication order by application_name",
        )
        .fetch_all(pool)
        .await
        .map_err(query("reading pg_stat_replication"))?
        .into_iter()
        .map(|row| Standby {
            name: row.get("application_name"),
            state: row.get::<Option<String>, _>("state").unwrap_or_default(),
            sync_state: row
                .get::<Option<String>, _>("sync_state")
                .unwrap_or_default(),
            replay_lsn: row.get("replay_lsn"),
            lag_bytes: row.get("lag_bytes"),
        })
        .collect();
        let slots = slots(pool).await?;
        Ok(ServerStatus {
            in_recovery,
            timeline: row.get("timeline"),
            lsn: row.get("lsn"),
            receive_lsn: None,
            lag_seconds: Some(0.0),
            streaming: None,
            standbys,
            slots,
            server_version,
            synchronous_standby_names,
            pending_restart,
        })
    }
}

/// The physical replication slots and the WAL each holds back.
async fn slots(pool: &PgPool) -> Result<Vec<Slot>, DatabaseError> {
    Ok(sqlx::query(
        "select slot_name::text as name, active, wal_status,
                pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint as retained
           from pg_replication_slots where slot_type = 'physical' order by slot_name",
    )
    .fetch_all(pool)
    .await
    .map_err(query("reading pg_replication_slots"))?
    .into_iter()
    .map(|row| Slot {
        name: row.get("name"),
        active: row.get("active"),
        retained_bytes: row.get("retained"),
        wal_status: row.get("wal_status"),
    })
    .collect())
}

/// Makes the primary's Castellan slots exactly those of `instances`: creates the
/// missing ones (reserving WAL from now, so a replica that connects later finds what it
/// needs), and drops the others that no walsender uses. A slot left behind by a removed
/// replica would otherwise hold WAL until the disk is full.
pub async fn keep_slots(pool: &PgPool, instances: &[String]) -> Result<(), DatabaseError> {
    let wanted: Vec<String> = instances.iter().map(|i| slot_name(i)).collect();
    let existing: Vec<(String, bool)> = sqlx::query_as(
        "select slot_name::text, active from pg_replication_slots
          where slot_type = 'physical' and slot_name like 'castellan\\_%'",
    )
    .fetch_all(pool)
    .await
    .map_err(query("listing Castellan's replication slots"))?;
    for slot in &wanted {
        if !existing.iter().any(|(name, _)| name == slot) {
            sqlx::query("select pg_create_physical_replication_slot($1, true)")
                .bind(slot)
                .execute(pool)
                .await
                .map_err(query("creating a replication slot"))?;
            tracing::info!(%slot, "created replication slot");
        }
    }
    for (slot, active) in existing {
        if !active && !wanted.contains(&slot) {
            sqlx::query("select pg_drop_replication_slot($1)")
                .bind(&slot)
                .execute(pool)
                .await
                .map_err(query("dropping a replication slot"))?;
            tracing::info!(%slot, "dropped the replication slot of an instance that is gone");
        }
    }
    Ok(())
}

/// Applies Castellan's schema on a primary (replicas receive it by replication).
pub async fn migrate(pool: &PgPool) -> Result<(), DatabaseError> {
    MIGRATOR.run(pool).await?;
    Ok(())
}

/// Creates (or updates the password of) a login role. The password never reaches the
/// server: only its SCRAM verifier, computed here, goes into the statement, which runs
/// with statement logging off for its transaction (a user's `log_statement: all` would
/// otherwise keep even the verifier).
pub async fn ensure_role(
    pool: &PgPool,
    name: &str,
    password: &str,
    attributes: &str,
) -> Result<(), DatabaseError> {
    let verifier = super::scram::verifier(password).map_err(|reason| DatabaseError::Password {
        role: name.to_owned(),
        reason,
    })?;
    let exists: bool =
        sqlx::query_scalar("select exists(select 1 from pg_roles where rolname = $1)")
            .bind(name)
            .fetch_one(pool)
            .await
            .map_err(query("looking up a role"))?;
    let verb = if exists { "alter" } else { "create" };
    // Logging off first, in its own statement: PostgreSQL decides whether to log a
    // query string (and a bound verifier) before it runs any of it. A failed
    // transaction is rolled back when dropped.
    let mut transaction = pool
        .begin()
        .await
        .map_err(query("starting a transaction"))?;
    sqlx::raw_sql(
        "set local log_statement = 'none';
         set local log_min_duration_statement = -1;
         set local log_min_error_statement = 'panic'",
    )
    .execute(&mut *transaction)
    .await
    .map_err(query("turning statement logging off"))?;
    // `verb` and `attributes` are fixed strings chosen in this module, never input.
    let statement: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "select format('{verb} role %I with login {attributes} password %L', $1::text, $2::text)"
    )))
    .bind(name)
    .bind(&verifier)
    .fetch_one(&mut *transaction)
    .await
    .map_err(query("building a role statement"))?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
        .execute(&mut *transaction)
        .await
        .map_err(query("creating a role"))?;
    transaction
        .commit()
        .await
        .map_err(query("creating a role"))?;
    Ok(())
}

/// Creates the application database owned by `owner`, if it does not exist.
pub async fn ensure_database(pool: &PgPool, name: &str, owner: &str) -> Result<(), DatabaseError> {
    let exists: bool =
        sqlx::query_scalar("select exists(select 1 from pg_database where datname = $1)")
            .bind(name)
            .fetch_one(pool)
            .await
            .map_err(query("looking up a database"))?;
    if !exists {
        let statement: String =
            sqlx::query_scalar("select format('create database %I owner %I', $1::text, $2::text)")
                .bind(name)
                .bind(owner)
                .fetch_one(pool)
                .await
                .map_err(query("building a create database statement"))?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
            .execute(pool)
            .await
            .map_err(query("creating the application database"))?;
    }
    Ok(())
}

/// Writes the primary's heartbeat: replicas replay it, and the age of the replayed row
/// is their lag in seconds, meaningful even when nothing else is written.
/// It commits locally: it needs no durability, and waiting for a synchronous quorum
/// that is not there would hold one of the pool's few connections for as long.
pub async fn beat(pool: &PgPool) -> Result<(), DatabaseError> {
    sqlx::raw_sql(
        "begin;
         set local synchronous_commit = local;
         insert into castellan.heartbeat (id, written_at) values (1, clock_timestamp())
         on conflict (id) do update set written_at = excluded.written_at;
         commit;",
    )
    .execute(pool)
    .await
    .map_err(query("writing the heartbeat"))?;
    Ok(())
}

/// The WAL receiver's process id while it is still connecting to its upstream (the
/// connection and its handshake, before streaming starts).
pub async fn connecting_wal_receiver(pool: &PgPool) -> Result<Option<i32>, DatabaseError> {
    sqlx::query_scalar(
        "select pid from pg_stat_activity
          where backend_type = 'walreceiver' and wait_event = 'LibPQWalReceiverConnect'",
    )
    .fetch_optional(pool)
    .await
    .map_err(query("reading the WAL receiver's state"))
}

/// Promotes a replica and waits for the promotion to finish, then checkpoints: until
/// a checkpoint records the new timeline in the control file, pg_rewind run against
/// this server would see no divergence and a former primary could not rejoin.
pub async fn promote(pool: &PgPool) -> Result<bool, DatabaseError> {
    let promoted: bool = sqlx::query_scalar("select pg_promote(true, 60)")
        .fetch_one(pool)
        .await
        .map_err(query("promoting"))?;
    if promoted {
        sqlx::query("checkpoint")
            .execute(pool)
            .await
            .map_err(query("checkpointing after promotion"))?;
    }
    Ok(promoted)
}

/// Closes the current WAL segment so that it is archived; returns where it ended.
pub async fn switch_wal(pool: &PgPool) -> Result<String, DatabaseError> {
    sqlx::query_scalar("select pg_switch_wal()::text")
        .fetch_one(pool)
        .await
        .map_err(query("switching to the next WAL segment"))
}

/// Runs a checkpoint; returns where its record is (a later one's, if another checkpoint
/// ran meanwhile: replaying that one includes this one).
pub async fn checkpoint(pool: &PgPool) -> Result<String, DatabaseError> {
    sqlx::query("checkpoint")
        .execute(pool)
        .await
        .map_err(query("running a checkpoint"))?;
    sqlx::query_scalar("select checkpoint_lsn::text from pg_control_checkpoint()")
        .fetch_one(pool)
        .await
        .map_err(query("reading the checkpoint's position"))
}

/// Whether a replica has replayed past `lsn`.
pub async fn replayed_past(pool: &PgPool, lsn: &str) -> Result<bool, DatabaseError> {
    sqlx::query_scalar("select coalesce(pg_last_wal_replay_lsn() > $1::pg_lsn, false)")
        .bind(lsn)
        .fetch_one(pool)
        .await
        .map_err(query("comparing the replay position"))
}

/// Makes the server re-read its configuration files.
pub async fn reload(pool: &PgPool) -> Result<(), DatabaseError> {
    sqlx::query("select pg_reload_conf()")
        .execute(pool)
        .await
        .map_err(query("reloading the configuration"))?;
    Ok(())
}

/// The lines of pg_hba.conf, as it is on disk now, that PostgreSQL cannot load, each
/// with its reason (`pg_hba_file_rules` reads the file, not the rules in force).
pub async fn hba_errors(pool: &PgPool) -> Result<Vec<String>, DatabaseError> {
    sqlx::query_scalar(
        "select format('line %s: %s', line_number, error) from pg_hba_file_rules \
         where error is not null order by line_number",
    )
    .fetch_all(pool)
    .await
    .map_err(query("checking pg_hba.conf"))
}

/// Settings changed in the files that need a restart to apply.
pub async fn pending_restart(pool: &PgPool) -> Result<Vec<String>, DatabaseError> {
    sqlx::query_scalar("select name from pg_settings where pending_restart order by name")
        .fetch_all(pool)
        .await
        .map_err(query("reading settings pending a restart"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_managers_own_commits_never_wait_for_the_synchronous_quorum() {
        let options = connect_options(Path::new("/run/castellan"), 5432, "postgres");
        assert_eq!(
            options.get_options(),
            Some("-c synchronous_commit=local"),
            "a restarted primary would wait for standbys that reconnect only once it is ready"
        );
        assert_eq!(
            options.get_socket(),
            Some(&Path::new("/run/castellan").to_path_buf())
        );
        assert_eq!(options.get_username(), "postgres");
    }
}

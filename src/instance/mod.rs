//! `castellan instance`: the instance manager, PID 1 of every database pod.
//!
//! It fills the data directory (initdb for a cluster that never had data, a base
//! backup of the primary for the others), writes the configuration Castellan owns,
//! runs and supervises PostgreSQL (restarting it with back-off when it dies), writes
//! the primary's heartbeat, and serves the HTTP API the operator drives it with
//! (`api`, its bodies in `crate::instance_api`) and, on a plain-HTTP port of its own,
//! PostgreSQL's metrics (`metrics`).
//!
//! It never decides roles itself. The data on the volume says what the instance *was*
//! (primary data, or a standby's); the operator says what it *is*:
//! - a primary runs its server only while it holds the lease the operator renews
//!   (`POST /lease`). When the lease runs out the server is stopped at once
//!   (immediate shutdown), so a primary cut off from the operator stops taking writes
//!   before the operator may promote another instance (`docs/failover.md`);
//! - a replica follows the cluster's `-rw` Service; `POST /promote` makes it primary;
//! - `POST /demote` turns a primary, or an instance whose volume lost its data, into a
//!   replica: pg_rewind onto the new primary's timeline, or a fresh base backup;
//! - `POST /fence` stops the server and keeps it stopped, across restarts.
//!
//! An empty volume is only ever initialised with initdb when the operator says the
//! cluster never had data (`--allow-initdb`): a lost primary volume is rebuilt from
//! the new primary after a failover, never started empty.

mod api;
pub mod archive;
pub mod backup;
pub(crate) mod bootstrap;
mod config;
mod database;
mod metrics;
mod pglog;
mod postmaster;
mod restore;
mod scram;
mod tls;
mod verify;
pub(crate) mod version;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::Context;
use backon::{BackoffBuilder, ExponentialBuilder};
use sqlx::PgPool;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use crate::instance_api::{
    Access, FenceResponse, LeaseGrant, PromoteRequest, PromoteResponse, ReloadResponse,
    RestoreRequest, RunningRole, slot_name,
};
use bootstrap::Binaries;
use config::{Role, Upstream};
use postmaster::{Postmaster, Shutdown};

/// The role the operator creates an instance's pod in. It only decides how an empty
/// volume is filled: existing data keeps the role it has until the operator changes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum StartRole {
    /// Empty volume: initdb, if `--allow-initdb`; otherwise wait for the operator.
    Primary,
    /// Empty volume: base backup of `--upstream-host`.
    Replica,
}

/// Settings of `castellan instance`; in a pod they come from the environment the
/// operator sets.
#[derive(Clone, Debug, clap::Args)]
pub struct InstanceArgs {
    /// Name of the DatabaseCluster.
    #[arg(long, env = "CASTELLAN_CLUSTER")]
    pub cluster_name: String,
    /// Name of this instance (its pod).
    #[arg(long, env = "POD_NAME")]
    pub instance_name: String,
    /// The data directory (PGDATA).
    #[arg(long, env = "PGDATA")]
    pub data_dir: PathBuf,
    /// Directory for the server's unix socket and the password file; only the
    /// instance's user may enter it. Default: `run` beside the data directory.
    #[arg(long, env = "CASTELLAN_SOCKET_DIR")]
    pub socket_dir: Option<PathBuf>,
    /// Address PostgreSQL and the HTTP API listen on (the pod's IP).
    #[arg(long, env = "POD_IP", default_value = "127.0.0.1")]
    pub listen_address: String,
    #[arg(long, env = "CASTELLAN_PG_PORT", default_value_t = 5432)]
    pub port: u16,
    /// Port of the instance API (TLS, the operator's client certificate required).
    #[arg(long, env = "CASTELLAN_HTTP_PORT", default_value_t = 8000)]
    pub http_port: u16,
    /// Port of the kubelet's probes (plain HTTP, `/healthz` and `/readyz` only).
    #[arg(long, env = "CASTELLAN_PROBE_PORT", default_value_t = 8001)]
    pub probe_port: u16,
    /// Port of `/metrics` (plain HTTP; docs/metrics.md): postgres_exporter's.
    #[arg(long, env = "CASTELLAN_METRICS_PORT", default_value_t = 9187)]
    pub metrics_port: u16,
    /// The instance API's server certificate (PEM), from the cluster's
    /// `<cluster>-instance-tls` Secret.
    #[arg(long, env = "CASTELLAN_TLS_CERT_FILE")]
    pub tls_cert_file: PathBuf,
    /// Its private key (PEM).
    #[arg(long, env = "CASTELLAN_TLS_KEY_FILE")]
    pub tls_key_file: PathBuf,
    /// Castellan's CA (PEM): callers must present a client certificate it signed.
    #[arg(long, env = "CASTELLAN_TLS_CA_FILE")]
    pub tls_ca_file: PathBuf,
    /// Directory holding PostgreSQL's programs; `PATH` when absent.
    #[arg(long, env = "PG_BIN_DIR")]
    pub pg_bin_dir: Option<PathBuf>,
    /// How an empty volume is filled.
    #[arg(long, env = "CASTELLAN_ROLE", value_enum, default_value = "primary")]
    pub role: StartRole,
    /// Whether an empty volume may be initialised with initdb: only for a cluster that
    /// never had data. Without it, a primary on an empty volume waits for the operator.
    #[arg(long, env = "CASTELLAN_ALLOW_INITDB", default_value_t = false, action = clap::ArgAction::Set)]
    pub allow_initdb: bool,
    /// `true` once the operator marked the pod: the cluster has had data since it was
    /// created, so `--allow-initdb` no longer holds. The pod's
    /// `castellan.io/initialized` annotation, read when the container starts; the
    /// first instance's pod keeps its creation-time environment for its life, and an
    /// emptied volume (a node back without its disk) must not be initialised again.
    #[arg(long, env = "CASTELLAN_CLUSTER_INITIALIZED", default_value = "")]
    pub cluster_initialized: String,
    /// The cluster is made from a backup: an empty volume waits for the operator's
    /// `POST /restore` (the first instance of a cluster with `bootstrap.recovery`).
    #[arg(long, env = "CASTELLAN_AWAIT_RESTORE", default_value_t = false, action = clap::ArgAction::Set)]
    pub await_restore: bool,
    /// Host replicas follow: the cluster's `-rw` Service.
    #[arg(long, env = "CASTELLAN_UPSTREAM_HOST")]
    pub upstream_host: Option<String>,
    #[arg(long, env = "CASTELLAN_UPSTREAM_PORT", default_value_t = 5432)]
    pub upstream_port: u16,
    /// File holding the `postgres` superuser's password.
    #[arg(long, env = "CASTELLAN_SUPERUSER_PASSWORD_FILE")]
    pub superuser_password_file: PathBuf,
    /// File holding the replication role's password.
    #[arg(long, env = "CASTELLAN_REPLICATION_PASSWORD_FILE")]
    pub replication_password_file: PathBuf,
    /// Application database made at initdb.
    #[arg(long, env = "CASTELLAN_APP_DATABASE", default_value = "app")]
    pub app_database: String,
    /// Owner of the application database.
    #[arg(long, env = "CASTELLAN_APP_OWNER", default_value = "app")]
    pub app_owner: String,
    /// File holding the application owner's password.
    #[arg(long, env = "CASTELLAN_APP_PASSWORD_FILE")]
    pub app_password_file: Option<PathBuf>,
    #[command(flatten)]
    pub log: crate::telemetry::LogArgs,
    /// JSON object of server parameters (from the DatabaseCluster spec).
    #[arg(long, env = "CASTELLAN_PARAMETERS", default_value = "{}")]
    pub parameters: String,
    /// `synchronous_standby_names` to start with (the operator updates it by reload).
    #[arg(long, env = "CASTELLAN_SYNCHRONOUS_STANDBY_NAMES", default_value = "")]
    pub synchronous_standby_names: String,
    /// `max_slot_wal_keep_size`: the most WAL a replication slot may hold back.
    #[arg(long, env = "CASTELLAN_MAX_SLOT_WAL_KEEP_SIZE", default_value = "1GB")]
    pub max_slot_wal_keep_size: String,
    /// The mounted `<cluster>-server-tls` Secret (PostgreSQL's server certificate).
    /// With `--replication-tls-dir`, PostgreSQL serves TLS; without them it does not.
    #[arg(
        long,
        env = "CASTELLAN_SERVER_TLS_DIR",
        requires = "replication_tls_dir"
    )]
    pub server_tls_dir: Option<PathBuf>,
    /// The mounted `<cluster>-replication-tls` Secret (the replicas' client
    /// certificate).
    #[arg(
        long,
        env = "CASTELLAN_REPLICATION_TLS_DIR",
        requires = "server_tls_dir"
    )]
    pub replication_tls_dir: Option<PathBuf>,
    /// The name the primary's certificate is verified for: the `-rw` Service's.
    #[arg(long, env = "CASTELLAN_UPSTREAM_SERVER_NAME")]
    pub upstream_server_name: Option<String>,
    /// Accept clients over plain TCP too (`spec.tls.allowPlaintext`; the operator
    /// changes it by reload).
    #[arg(long, env = "CASTELLAN_ALLOW_PLAINTEXT", default_value_t = false, action = clap::ArgAction::Set)]
    pub allow_plaintext: bool,
    /// The superuser may log in over the network (`spec.enableSuperuserAccess`; the
    /// operator changes it by reload).
    #[arg(long, env = "CASTELLAN_SUPERUSER_ACCESS", default_value_t = false, action = clap::ArgAction::Set)]
    pub superuser_access: bool,
    /// JSON array of the user's own pg_hba.conf lines (`spec.pgHba`; the operator
    /// changes them by reload).
    #[arg(long, env = "CASTELLAN_PG_HBA", default_value = "[]")]
    pub pg_hba: String,
    /// The PostgreSQL major version the cluster asks for (`spec.version`): binaries of
    /// another major touch no data and start nothing. Unchecked when absent.
    #[arg(long, env = "CASTELLAN_POSTGRES_VERSION")]
    pub postgres_version: Option<String>,
}

/// A request from the HTTP API, carried out by the supervisor one at a time so that
/// a promotion never races a restart.
pub enum Request {
    Promote(PromoteRequest),
    Demote,
    Fence(bool),
    Restart,
    Reload {
        parameters: Option<BTreeMap<String, String>>,
        synchronous_standby_names: Option<String>,
        slots: Option<Vec<String>>,
        access: Option<Access>,
    },
    Restore(Box<RestoreRequest>),
}

pub type Reply = oneshot::Sender<Result<serde_json::Value, String>>;

/// What the supervisor publishes about itself, for the API and the heartbeat.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Published {
    /// The role the data is in: absent while an empty volume waits for the operator.
    pub role: Option<RunningRole>,
    pub running: bool,
    pub fenced: bool,
    pub problem: Option<String>,
    /// The server parameters the configuration was last written with, reported so the
    /// operator knows which instances a spec change has not reached.
    pub parameters: BTreeMap<String, String>,
    /// Parameters asked for that PostgreSQL refused.
    pub refused_parameters: Option<crate::instance_api::RefusedParameters>,
    /// What a restore into the empty volume is doing, or why it failed.
    pub restoring: Option<String>,
    /// A scratch instance's verdict on the backup it restored.
    pub verification: Option<crate::instance_api::VerificationReport>,
    /// Whether PostgreSQL serves TLS.
    pub tls: bool,
    /// Who may connect how, as pg_hba.conf is written.
    pub access: Access,
    /// The PostgreSQL release the binaries carry.
    pub release: String,
    /// The certificates PostgreSQL runs with.
    pub certificates: Option<crate::instance_api::LoadedCertificates>,
}

/// What the HTTP API and the heartbeat share with the supervisor.
pub struct Shared {
    pub instance_name: String,
    pub pool: PgPool,
    pub published: watch::Receiver<Published>,
    /// When the primary lease ends (the instance's monotonic clock). The API renews
    /// it directly, never behind a queued request, so a slow operation cannot make a
    /// healthy primary lose it.
    pub lease: watch::Sender<Option<Instant>>,
    pub requests: mpsc::Sender<(Request, Reply)>,
    /// WAL archiving: the setting the operator sent (`POST /reload`), what it did,
    /// and the archive socket's work.
    pub archive: Arc<archive::Archive>,
    /// Base backups taken on this instance (`POST /backup`).
    pub backups: Arc<backup::Backups>,
    /// The statistics run after a major upgrade (`StatusReport::analyze`).
    pub analyze: watch::Sender<Option<String>>,
}

impl Shared {
    /// Extends the lease by `grant`; a grant that arrives after its end is refused.
    pub fn renew(&self, grant: &LeaseGrant) -> Option<Duration> {
        let remaining = grant.remaining_at(SystemTime::now());
        if remaining.is_zero() {
            return None;
        }
        let until = Instant::now() + remaining;
        self.lease.send_modify(|lease| {
            // Grants may arrive out of order: a late one never shortens the lease.
            *lease = Some(lease.map_or(until, |current| current.max(until)));
        });
        self.lease_remaining()
    }

    pub fn lease_remaining(&self) -> Option<Duration> {
        let until = (*self.lease.borrow())?;
        let now = Instant::now();
        (until > now).then(|| until - now)
    }
}

/// Everything fixed for the life of the process (but `access`).
struct Instance {
    args: InstanceArgs,
    binaries: Binaries,
    socket_dir: PathBuf,
    passfile: PathBuf,
    /// The mounted certificates, their private copies and whether the build can serve
    /// them, when the pod has them.
    certificates: Option<tls::Certificates>,
    /// The PostgreSQL release the binaries carry (`postgres --version`).
    release: String,
    /// Why the data directory must not be started: it holds a primary's data of
    /// another major than the binaries (`version::data_mismatch`).
    data_refusal: Option<String>,
    /// Who may connect how (`spec.tls.allowPlaintext`, `spec.enableSuperuserAccess`,
    /// `spec.pgHba`) as last sent: the settings of the configuration that are not
    /// server parameters and still change with the spec. Behind a lock, so that
    /// every file written reads the current value without each writer taking it as an
    /// argument; held only to copy or replace it.
    access: std::sync::RwLock<Access>,
}

/// The roles' passwords as the mounted Secret files hold them.
#[derive(Clone, Debug, PartialEq)]
struct Passwords {
    superuser: String,
    replication: String,
    app: Option<String>,
}

impl Instance {
    async fn read_passwords(&self) -> anyhow::Result<Passwords> {
        Ok(Passwords {
            superuser: read_secret(&self.args.superuser_password_file).await?,
            replication: read_secret(&self.args.replication_password_file).await?,
            app: match &self.args.app_password_file {
                Some(file) => Some(read_secret(file).await?),
                None => None,
            },
        })
    }

    /// The password file libpq reads for pg_basebackup, pg_rewind and streaming.
    async fn write_passfile(&self, passwords: &Passwords) -> anyhow::Result<()> {
        bootstrap::write_private(
            &self.passfile,
            &config::render_passfile(&passwords.superuser, &passwords.replication),
        )
        .await
        .with_context(|| format!("writing {}", self.passfile.display()))
    }

    /// Sets the roles' passwords (as SCRAM verifiers) that differ from `applied`.
    async fn set_passwords(
        &self,
        pool: &PgPool,
        passwords: &Passwords,
        applied: Option<&Passwords>,
    ) -> anyhow::Result<Vec<String>> {
        let mut set = Vec::new();
        for (role, password, attributes) in roles_to_set(&self.args.app_owner, passwords, applied) {
            database::ensure_role(pool, role, password, attributes).await?;
            set.push(role.to_owned());
        }
        Ok(set)
    }
}

/// Each role whose password differs from `applied` (all without it): the role, the
/// password and the role's attributes.
fn roles_to_set<'a>(
    owner: &'a str,
    passwords: &'a Passwords,
    applied: Option<&Passwords>,
) -> Vec<(&'a str, &'a str, &'static str)> {
    let before = |pick: fn(&Passwords) -> Option<&String>| applied.and_then(pick);
    [
        (
            "postgres",
            Some(&passwords.superuser),
            before(|a| Some(&a.superuser)),
            "superuser",
        ),
        (
            config::REPLICATION_USER,
            Some(&passwords.replication),
            before(|a| Some(&a.replication)),
            "replication",
        ),
        (
            owner,
            passwords.app.as_ref(),
            before(|a| a.app.as_ref()),
            "",
        ),
    ]
    .into_iter()
    .filter_map(|(role, password, before, attributes)| {
        let password = password.filter(|p| Some(*p) != before)?;
        Some((role, password.as_str(), attributes))
    })
    .collect()
}

async fn read_secret(path: &Path) -> anyhow::Result<String> {
    let value = tokio::fs::read_to_string(path)
        .await
        .with_context(|| format!("reading secret file {}", path.display()))?;
    Ok(value.trim_end_matches(['\n', '\r']).to_owned())
}

/// A directory only its owner may enter.
pub(crate) async fn private_dir(path: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    tokio::fs::create_dir_all(path)
        .await
        .with_context(|| format!("creating {}", path.display()))?;
    tokio::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700))
        .await
        .with_context(|| format!("restricting {} to its owner", path.display()))
}

/// What the volume holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Holds {
    Nothing,
    Primary,
    Replica,
}

impl Instance {
    fn access(&self) -> Access {
        // A poisoned lock still holds a whole value: it is only ever replaced whole.
        self.access
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn set_access(&self, access: Access) {
        *self
            .access
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = access;
    }

    /// Why the binaries must not run for this cluster (another major than it asks
    /// for), if they must not: then nothing is initialised, copied or started.
    fn version_refusal(&self) -> Option<String> {
        version::refusal(self.args.postgres_version.as_deref(), &self.release)
            .or_else(|| self.data_refusal.clone())
    }

    fn allows_plaintext(&self) -> bool {
        self.access().allow_plaintext
    }

    /// TLS or plain TCP, or why the server must not run.
    fn tls_decision(&self) -> tls::Decision {
        tls::decide(self.certificates.as_ref(), self.allows_plaintext())
    }

    /// The transport the configuration is written for. A refused one is written as
    /// plain TCP with nothing allowed over it (`render_pg_hba`), and the server is not
    /// started anyway.
    fn transport(&self) -> tls::Transport {
        match self.tls_decision() {
            tls::Decision::Run(transport) => transport,
            tls::Decision::Refuse(_) => tls::Transport::Plain,
        }
    }

    fn upstream(&self) -> anyhow::Result<Upstream> {
        let host = self.args.upstream_host.clone().context(
            "a replica needs --upstream-host (the cluster's -rw Service) to follow its primary",
        )?;
        let tls = match self.transport() {
            tls::Transport::Tls(files) => Some(config::UpstreamTls {
                server_name: self.args.upstream_server_name.clone().context(
                    "a replica over TLS needs --upstream-server-name (the -rw Service's name) \
                     to verify its primary's certificate",
                )?,
                files,
            }),
            tls::Transport::Plain => None,
        };
        Ok(Upstream {
            host,
            port: self.args.upstream_port,
            slot: slot_name(&self.args.instance_name),
            tls,
        })
    }

    /// Copies renewed certificates from the mounted Secrets; whether any changed.
    async fn install_certificates(&self) -> anyhow::Result<bool> {
        let Some(certificates) = &self.certificates else {
            return Ok(false);
        };
        tls::install(&certificates.mounted, &certificates.files)
            .await
            .context("copying the mounted TLS certificates")
    }

    /// The marker that keeps a fenced instance stopped across restarts: beside the
    /// data directory, on the same volume, so it goes with the data.
    fn fence_marker(&self) -> PathBuf {
        self.args
            .data_dir
            .parent()
            .unwrap_or(Path::new("/"))
            .join("castellan.fenced")
    }

    /// `archive_command` and `restore_command`: this binary's `wal-archive` and
    /// `wal-restore`, which hand the work to this manager (`archive`).
    fn wal_commands(&self) -> (String, String) {
        let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("castellan"));
        let exe = shell_quote(runnable_path(&exe.to_string_lossy()));
        let socket = shell_quote(&self.socket_dir.join(archive::SOCKET).to_string_lossy());
        (
            format!("{exe} wal-archive --socket {socket} %p"),
            format!("{exe} wal-restore --socket {socket} %f %p"),
        )
    }

    fn holds(&self) -> Holds {
        let data_dir = &self.args.data_dir;
        if !bootstrap::initialised(data_dir) {
            Holds::Nothing
        } else if data_dir.join("standby.signal").exists() {
            Holds::Replica
        } else {
            Holds::Primary
        }
    }

    /// The marker of a restore under way, beside the data directory: a restore that
    /// failed may empty the data directory it filled, and only that one.
    fn restore_marker(&self) -> PathBuf {
        self.args
            .data_dir
            .parent()
            .unwrap_or(Path::new("/"))
            .join("castellan.restoring")
    }

    fn conf(
        &self,
        role: &Role,
        parameters: &BTreeMap<String, String>,
        sync_names: &str,
        recovery: Option<&config::RecoveryTarget>,
    ) -> String {
        let (archive_command, restore_command) = self.wal_commands();
        config::render_castellan_conf(&config::Settings {
            cluster_name: &self.args.cluster_name,
            instance_name: &self.args.instance_name,
            listen_address: &self.args.listen_address,
            port: self.args.port,
            socket_dir: &self.socket_dir,
            role,
            passfile: &self.passfile,
            synchronous_standby_names: sync_names,
            parameters,
            max_slot_wal_keep_size: &self.args.max_slot_wal_keep_size,
            archive_command: &archive_command,
            restore_command: &restore_command,
            recovery,
            transport: &self.transport(),
        })
    }

    fn pg_hba(&self) -> String {
        config::render_pg_hba(&self.transport(), &self.access())
    }

    /// Fills an empty volume as the operator allows: initdb for a cluster that never
    /// had data, a base backup of the primary for a replica. Returns `None` when the
    /// volume must wait for the operator (a primary's volume that lost its data).
    async fn fill(&self) -> anyhow::Result<Option<Role>> {
        let data_dir = &self.args.data_dir;
        private_dir(data_dir).await?;
        let allowed = initdb_allowed(self.args.allow_initdb, &self.args.cluster_initialized);
        if self.args.allow_initdb && !allowed {
            tracing::warn!(
                data_dir = %data_dir.display(),
                "the volume is empty, but the cluster has had data: not running initdb; \
                 waiting for the operator to fill it from the primary"
            );
        }
        match (self.args.role, allowed) {
            (StartRole::Primary, true) => {
                tracing::info!(data_dir = %data_dir.display(), "creating an empty cluster with initdb");
                bootstrap::initdb(&self.binaries, data_dir, &self.args.superuser_password_file)
                    .await
                    .with_context(|| format!("running initdb in {}", data_dir.display()))?;
                Ok(Some(Role::Primary))
            }
            (StartRole::Primary, false) => Ok(None),
            // The operator sends the backup to restore (`POST /restore`).
            (StartRole::Replica, _) => self.clone_primary().await.map(Some),
        }
    }

    async fn clone_primary(&self) -> anyhow::Result<Role> {
        let data_dir = &self.args.data_dir;
        let upstream = self.upstream()?;
        tracing::info!(host = %upstream.host, slot = %upstream.slot, "copying the primary with pg_basebackup");
        bootstrap::base_backup(&self.binaries, data_dir, &upstream, &self.passfile)
            .await
            .with_context(|| {
                format!(
                    "taking a base backup of {} into {}",
                    upstream.host,
                    data_dir.display()
                )
            })?;
        Ok(Role::Replica(upstream))
    }

    /// Brings a stopped former primary onto the current primary's timeline (pg_rewind
    /// copies back what differs, running crash recovery first if the server did not
    /// shut down cleanly), or copies the primary afresh when there is nothing to
    /// rewind, or when pg_rewind cannot see the fork.
    async fn rejoin(&self) -> anyhow::Result<Role> {
        if self.holds() == Holds::Nothing {
            return self.clone_primary().await;
        }
        let upstream = self.upstream()?;
        let data_dir = &self.args.data_dir;
        // A former primary on the very timeline the current primary writes on forked
        // from it: both were promoted, each to the next number, from different
        // histories (one never saw the other's timeline). pg_rewind compares only the
        // numbers, says "no rewind required", and the server would start diverged,
        // streaming nothing. Its own writes after the fork were never confirmed by the
        // standby the current primary was promoted from, so they are not acknowledged
        // commits under required durability; the volume is filled from the primary.
        let local = bootstrap::checkpoint_timeline(&self.binaries, data_dir)
            .await
            .context("reading this instance's timeline")?;
        let current = bootstrap::primary_timeline(&self.binaries, &upstream, &self.passfile)
            .await
            .with_context(|| format!("reading the timeline of {}", upstream.host))?;
        let Some(current) = current else {
            anyhow::bail!(
                "{} is not a primary yet; rejoining waits for one to follow",
                upstream.host
            );
        };
        if local == Some(current) {
            tracing::warn!(
                timeline = current,
                host = %upstream.host,
                "this former primary forked from the primary on the same timeline; \
                 discarding its data and copying the primary afresh"
            );
            bootstrap::clear_dir(data_dir)
                .await
                .with_context(|| format!("emptying {}", data_dir.display()))?;
            return self.clone_primary().await;
        }
        tracing::info!(host = %upstream.host, "rejoining as a replica with pg_rewind");
        let output = bootstrap::rewind(&self.binaries, data_dir, &upstream, &self.passfile)
            .await
            .with_context(|| format!("rewinding {} onto {}", data_dir.display(), upstream.host))?;
        tracing::info!(output = %output.trim(), "pg_rewind finished");
        Ok(Role::Replica(upstream))
    }

    /// Asks PostgreSQL whether it takes `parameters`: `None` when it does, else what it
    /// refused and why. When PostgreSQL cannot be asked (no data directory yet), the
    /// parameters pass: the server could not start either.
    async fn vet_parameters(
        &self,
        parameters: &BTreeMap<String, String>,
    ) -> Option<crate::instance_api::RefusedParameters> {
        if !bootstrap::initialised(&self.args.data_dir) {
            return None;
        }
        match bootstrap::refused_parameters(&self.binaries, &self.args.data_dir, parameters).await {
            Ok(refused) if refused.is_empty() => None,
            Ok(reasons) => Some(crate::instance_api::RefusedParameters {
                parameters: parameters.clone(),
                reasons,
            }),
            Err(error) => {
                tracing::warn!(%error, "could not have PostgreSQL check the server parameters");
                None
            }
        }
    }

    /// Writes the files Castellan owns in the data directory for `role`.
    async fn write_config(
        &self,
        role: &Role,
        parameters: &BTreeMap<String, String>,
        sync_names: &str,
    ) -> Result<(), bootstrap::BootstrapError> {
        bootstrap::write_role_files(
            &self.args.data_dir,
            &self.conf(role, parameters, sync_names, None),
            &self.pg_hba(),
            role,
        )
        .await
    }

    async fn start(
        &self,
        role: &Role,
        parameters: &BTreeMap<String, String>,
        sync_names: &str,
    ) -> anyhow::Result<Postmaster> {
        self.write_config(role, parameters, sync_names).await?;
        if let Role::Replica(upstream) = role {
            // The primary keeps every replica's slot (the operator tells it which);
            // this only saves a replica that starts before that from waiting for it.
            if let Err(error) =
                bootstrap::ensure_slot(&self.binaries, upstream, &self.passfile).await
            {
                tracing::info!(slot = %upstream.slot, %error, "could not make sure of this replica's slot on the primary; the primary will create it");
            }
        }
        let mut postmaster = Postmaster::start(&self.binaries, &self.args.data_dir)?;
        tracing::info!(
            pid = postmaster.pid(),
            role = role_name(role),
            "started postgres"
        );
        let startup = postmaster
            .wait_accepting(
                &self.binaries,
                &self.socket_dir,
                self.args.port,
                Duration::from_secs(120),
            )
            .await;
        match startup {
            postmaster::Startup::Accepting => {}
            postmaster::Startup::Exited => anyhow::bail!(
                "postgres in {} exited while starting; its log above says why",
                self.args.data_dir.display()
            ),
            postmaster::Startup::TimedOut => anyhow::bail!(
                "postgres in {} did not accept connections within 120s",
                self.args.data_dir.display()
            ),
        }
        Ok(postmaster)
    }

    async fn stop(&self, postmaster: Postmaster, mode: Shutdown) -> anyhow::Result<()> {
        postmaster
            .stop(
                &self.binaries,
                &self.args.data_dir,
                mode,
                Duration::from_secs(60),
            )
            .await
            .with_context(|| format!("stopping postgres in {}", self.args.data_dir.display()))
    }

    /// On a primary: Castellan's schema, the roles with the passwords the Secrets hold
    /// now (a restored primary's are its source's; a Secret may have been rotated while
    /// the server was down) and the application's database, all idempotent.
    async fn prepare_primary(&self, pool: &PgPool) -> anyhow::Result<()> {
        // Roles first: a migration grants to the replication role.
        let passwords = self.read_passwords().await?;
        self.set_passwords(pool, &passwords, None).await?;
        database::migrate(pool).await?;
        if self.args.app_password_file.is_some() {
            database::ensure_database(pool, &self.args.app_database, &self.args.app_owner).await?;
        }
        Ok(())
    }
}

pub fn role_name(role: &Role) -> &'static str {
    running_role(role).as_str()
}

fn running_role(role: &Role) -> RunningRole {
    match role {
        Role::Primary => RunningRole::Primary,
        Role::Replica(_) => RunningRole::Replica,
    }
}

/// The supervisor's state: what the instance is, and whether its server runs.
struct Supervisor {
    instance: Arc<Instance>,
    pool: PgPool,
    shared: Arc<Shared>,
    publish: watch::Sender<Published>,
    /// None while an empty primary volume waits for the operator.
    role: Option<Role>,
    postmaster: Option<Postmaster>,
    fenced: bool,
    /// A former primary that must be rewound before it can follow.
    rejoin: bool,
    /// The server parameters in force: only ones PostgreSQL accepted.
    parameters: BTreeMap<String, String>,
    /// The last set asked for that PostgreSQL refused, and why.
    refused_parameters: Option<crate::instance_api::RefusedParameters>,
    sync_names: String,
    /// Castellan's schema and roles were made on this primary since the process began.
    prepared: bool,
    /// The passwords the Secret files held when last read; the password file has them.
    passwords: Passwords,
    /// No start before this (back-off after failures).
    not_before: Instant,
    restarts: backon::ExponentialBackoff,
    /// When the server last started.
    started: Instant,
    problem: Option<String>,
    /// The restore the operator asked for, until it is done.
    restore: Option<RestoreRequest>,
    /// What it is doing, for the status report.
    restoring: Option<String>,
    /// A scratch instance's verdict, once it verified its backup.
    verification: Option<crate::instance_api::VerificationReport>,
    /// What PostgreSQL runs with of the certificates, and whether it has yet to load
    /// changed copies.
    certificates: FollowedCertificates,
}

#[derive(Default)]
struct FollowedCertificates {
    loaded: Option<crate::instance_api::LoadedCertificates>,
    pending: bool,
}

impl Supervisor {
    fn lease_held(&self) -> bool {
        self.shared.lease_remaining().is_some()
    }

    /// Whether the server should run now.
    fn should_run(&self) -> bool {
        // A demoted instance runs nothing until it has rejoined as a replica: a lease
        // grant still in flight when it was demoted must not start it as a primary.
        if self.fenced || self.rejoin || self.instance.version_refusal().is_some() {
            return false;
        }
        // Never plain text the cluster does not allow (`tls::decide`).
        if matches!(self.instance.tls_decision(), tls::Decision::Refuse(_)) {
            return false;
        }
        match &self.role {
            None => false,
            Some(Role::Primary) => self.lease_held(),
            Some(Role::Replica(_)) => true,
        }
    }

    /// A rotated Secret (the kubelet rewrites its files in place): every instance's
    /// password file follows, and a running primary sets the new verifiers, which
    /// replicate. A primary that is not running sets them all when it starts.
    async fn follow_passwords(&mut self) {
        let read = match self.instance.read_passwords().await {
            Ok(read) if read != self.passwords => read,
            Ok(_) => return,
            Err(error) => {
                tracing::warn!(error = %format!("{error:#}"), "reading the password files");
                return;
            }
        };
        if let Err(error) = self.instance.write_passfile(&read).await {
            tracing::warn!(error = %format!("{error:#}"), "a password changed; retrying");
            return;
        }
        if self.role == Some(Role::Primary) && self.postmaster.is_some() {
            match self
                .instance
                .set_passwords(&self.pool, &read, Some(&self.passwords))
                .await
            {
                Ok(roles) => tracing::info!(?roles, "applied rotated passwords"),
                Err(error) => {
                    tracing::warn!(error = %format!("{error:#}"), "applying a rotated password failed; retrying");
                    return;
                }
            }
        } else {
            tracing::info!("a password changed: the password file follows");
            // A primary sets them when it next starts.
            self.prepared = false;
        }
        self.passwords = read;
    }

    fn publish(&self) {
        // A demoted instance is a replica from the moment it is told, even before its
        // rewind succeeds.
        let role = if self.rejoin {
            Some(RunningRole::Replica)
        } else {
            self.role.as_ref().map(running_role)
        };
        let (tls, refusal) = match self.instance.tls_decision() {
            tls::Decision::Run(tls::Transport::Tls(_)) => (true, None),
            tls::Decision::Run(tls::Transport::Plain) => (false, None),
            tls::Decision::Refuse(reason) => (false, Some(reason)),
        };
        self.publish.send_replace(Published {
            role,
            running: self.postmaster.is_some(),
            fenced: self.fenced,
            problem: self.problem.clone().or(refusal),
            parameters: self.parameters.clone(),
            refused_parameters: self.refused_parameters.clone(),
            restoring: self.restoring.clone(),
            verification: self.verification.clone(),
            tls,
            access: self.instance.access(),
            release: self.instance.release.clone(),
            certificates: self.certificates.loaded.clone(),
        });
    }

    /// A renewed certificate (the operator re-issues one in the last third of its
    /// life, or when the CA changed): the copies follow the mounted Secrets, and a
    /// running server reloads to serve it (again at the next tick, if the reload
    /// failed). A replica's WAL receiver reads its client certificate at its next
    /// connection. What the server then runs with is published.
    async fn follow_certificates(&mut self) {
        let Some(certificates) = &self.instance.certificates else {
            return;
        };
        match self.instance.install_certificates().await {
            Ok(changed) => self.certificates.pending |= changed,
            Err(error) => {
                tracing::warn!(error = %format!("{error:#}"), "following the TLS certificates");
                return;
            }
        }
        if !self.certificates.pending && self.certificates.loaded.is_some() {
            return;
        }
        if self.certificates.pending && self.postmaster.is_some() {
            match database::reload(&self.pool).await {
                Ok(()) => tracing::info!("the TLS certificates changed: reloaded PostgreSQL"),
                Err(error) => {
                    tracing::warn!(%error, "the TLS certificates changed but PostgreSQL could not be reloaded; trying again");
                    return;
                }
            }
        }
        // A stopped server reads them when it starts.
        self.certificates.pending = false;
        self.certificates.loaded = Some(tls::loaded(&certificates.files).await);
        self.publish();
    }

    /// Waits before trying again after a failure. The failure is logged, not reported
    /// as the instance's `problem`: that is kept for what will not pass by itself (an
    /// empty volume), which the operator fails over at once.
    fn back_off(&mut self, error: &anyhow::Error, what: &str) {
        let delay = self.restarts.next().unwrap_or(Duration::from_secs(30));
        tracing::error!(error = %format!("{error:#}"), ?delay, "{what}");
        self.not_before = Instant::now() + delay;
    }

    /// Starts or stops the server to match [`Supervisor::should_run`], and rejoins a
    /// former primary once it is stopped.
    async fn settle(&mut self) {
        self.follow_passwords().await;
        self.follow_certificates().await;
        if Instant::now() < self.not_before {
            return;
        }
        // Binaries of another major than the cluster asks for touch no data: no
        // restore, no initdb, no base backup, no start (`should_run`); the refusal is
        // the instance's problem (set at startup), published for the operator.
        if let Some(refusal) = self.instance.version_refusal() {
            if self.publish.borrow().problem.as_ref() != Some(&refusal) {
                self.problem = Some(refusal);
                self.publish();
            }
            return;
        }
        if self.role.is_none()
            && let Some(request) = self.restore.clone()
            && request.verify
        {
            let began = Instant::now();
            let outcome = self.run_restore(&request).await;
            let (ok, message) = match outcome {
                Ok(found) => (true, found.unwrap_or_default()),
                Err(error) => (false, format!("{error:#}")),
            };
            tracing::info!(ok, %message, "verification of the backup finished");
            self.verification = Some(crate::instance_api::VerificationReport {
                ok,
                message,
                duration_ms: u64::try_from(began.elapsed().as_millis()).unwrap_or(u64::MAX),
            });
            self.restore = None;
            self.restoring = Some("verification finished".to_owned());
            self.publish();
            return;
        }
        if self.role.is_none()
            && let Some(request) = self.restore.clone()
        {
            match self.run_restore(&request).await {
                Ok(_) => {
                    self.role = Some(Role::Primary);
                    self.restore = None;
                    self.restoring = None;
                    self.problem = None;
                }
                Err(error) => {
                    self.restoring = Some(format!("the restore failed and is retried: {error:#}"));
                    self.back_off(&error, "restoring the backup failed; retrying");
                    self.publish();
                    return;
                }
            }
        }
        if self.rejoin && self.postmaster.is_none() && !self.fenced {
            match self.instance.rejoin().await {
                Ok(role) => {
                    self.role = Some(role);
                    self.rejoin = false;
                    self.problem = None;
                }
                Err(error) => self.back_off(&error, "rejoining as a replica failed; retrying"),
            }
        }
        let should_run = self.should_run();
        if should_run && self.postmaster.is_none() {
            let Some(role) = self.role.clone() else {
                return;
            };
            self.drop_refused_parameters().await;
            match self
                .instance
                .start(&role, &self.parameters, &self.sync_names)
                .await
            {
                Ok(postmaster) => {
                    self.postmaster = Some(postmaster);
                    self.started = Instant::now();
                    self.problem = None;
                    if role == Role::Primary && !self.prepared {
                        match self.instance.prepare_primary(&self.pool).await {
                            Ok(()) => self.prepared = true,
                            Err(error) => {
                                tracing::warn!(error = %format!("{error:#}"), "preparing the primary failed; retrying on the next start");
                            }
                        }
                    }
                    self.analyze_after_upgrade(&role).await;
                }
                Err(error) => self.back_off(&error, "starting postgres failed"),
            }
        } else if !should_run && let Some(postmaster) = self.postmaster.take() {
            let lease_lost = self.role == Some(Role::Primary) && !self.fenced;
            let mode = if lease_lost {
                tracing::warn!(
                    "the primary lease ran out: stopping postgres at once so that it takes no more writes"
                );
                Shutdown::Immediate
            } else {
                tracing::info!(fenced = self.fenced, "stopping postgres");
                Shutdown::Fast
            };
            if let Err(error) = self.instance.stop(postmaster, mode).await {
                tracing::error!(error = %format!("{error:#}"), "stopping postgres failed");
            }
        }
        self.publish();
    }

    /// After a major upgrade (its marker in the data directory): a primary analyzes
    /// in the background; a replica, whose copy of the primary brought the marker,
    /// drops it (the primary's statistics replicate).
    async fn analyze_after_upgrade(&self, role: &Role) {
        let marker = self
            .instance
            .args
            .data_dir
            .join(crate::upgrade::ANALYZE_MARKER);
        if !marker.exists() {
            return;
        }
        match role {
            Role::Primary => {
                let running = self.shared.analyze.borrow().as_deref()
                    == Some(crate::instance_api::ANALYZE_RUNNING);
                if !running {
                    tokio::spawn(analyze(self.shared.clone(), self.instance.clone()));
                }
            }
            Role::Replica(_) => {
                if let Err(error) = tokio::fs::remove_file(&marker).await {
                    tracing::warn!(%error, marker = %marker.display(), "removing the copied analyze marker");
                }
            }
        }
    }

    async fn handle(&mut self, request: Request) -> Result<serde_json::Value, String> {
        match request {
            Request::Promote(request) => self.promote(request).await.map(to_json),
            Request::Demote => self.demote().await.map(to_json),
            Request::Fence(fenced) => self.fence(fenced).await.map(to_json),
            Request::Restart => {
                let Some(postmaster) = self.postmaster.take() else {
                    return Err("postgres is not running here".to_owned());
                };
                tracing::info!("restarting postgres");
                if let Err(error) = self.instance.stop(postmaster, Shutdown::Fast).await {
                    return Err(format!("{error:#}"));
                }
                self.settle().await;
                if self.postmaster.is_some() {
                    Ok(serde_json::json!({"restarted": true}))
                } else {
                    Err(self
                        .problem
                        .clone()
                        .unwrap_or_else(|| "postgres did not start again".to_owned()))
                }
            }
            Request::Reload {
                parameters,
                synchronous_standby_names,
                slots,
                access,
            } => self
                .reload(parameters, synchronous_standby_names, slots, access)
                .await
                .map(to_json),
            Request::Restore(request) => self.accept_restore(*request),
        }
    }

    /// Takes a restore request: only for an empty volume the operator is told to fill
    /// from a backup. The work is done by [`Supervisor::settle`].
    fn accept_restore(&mut self, request: RestoreRequest) -> Result<serde_json::Value, String> {
        if !self.instance.args.await_restore {
            return Err("this instance was not created to be restored into".to_owned());
        }
        if self.role.is_some() {
            return Err(
                "this instance has data already: a restore only fills an empty volume".to_owned(),
            );
        }
        if self.restore.as_ref() != Some(&request) {
            tracing::info!(backup = %request.backup_id, source = ?request.source, "restore requested");
            self.restore = Some(request);
            self.restoring = Some("restore requested".to_owned());
            self.not_before = Instant::now();
            self.restarts = restart_backoff();
            self.publish();
        }
        Ok(serde_json::json!({"accepted": true}))
    }

    fn set_restoring(&mut self, what: String) {
        tracing::info!(restore = %what, "restoring");
        self.restoring = Some(what);
        self.publish();
    }

    /// Fills the empty volume from the backup and replays the source's WAL to the
    /// target; the server promotes itself there, and is stopped cleanly to start again
    /// as this cluster's primary under the operator's lease. A verifying scratch
    /// instance checks the data before stopping, and returns what it found.
    async fn run_restore(&mut self, request: &RestoreRequest) -> anyhow::Result<Option<String>> {
        let instance = self.instance.clone();
        let data_dir = instance.args.data_dir.clone();
        let marker = instance.restore_marker();
        private_dir(&data_dir).await?;
        let empty = std::fs::read_dir(&data_dir)
            .with_context(|| format!("listing {}", data_dir.display()))?
            .next()
            .is_none();
        if !empty {
            if !marker.exists() {
                anyhow::bail!(
                    "{} is not empty and no restore of Castellan's filled it: it is left untouched",
                    data_dir.display()
                );
            }
            // What an earlier attempt of this restore left.
            bootstrap::clear_dir(&data_dir).await?;
        }
        tokio::fs::write(&marker, request.backup_id.as_bytes())
            .await
            .with_context(|| format!("writing {}", marker.display()))?;

        let read = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let unpack = restore::unpack(request, &data_dir, read.clone());
        tokio::pin!(unpack);
        let manifest = loop {
            tokio::select! {
                outcome = &mut unpack => break outcome?,
                () = tokio::time::sleep(Duration::from_secs(1)) => {
                    let mib = read.load(std::sync::atomic::Ordering::Relaxed) >> 20;
                    self.set_restoring(format!(
                        "downloading base backup {}: {mib} MiB received",
                        request.backup_id
                    ));
                }
            }
        };
        let target = config::RecoveryTarget {
            time: request.target_time.clone(),
            lsn: request.target_lsn.clone(),
        };
        let conf = instance.conf(&Role::Primary, &self.parameters, "", Some(&target));
        bootstrap::write_role_files(&data_dir, &conf, &instance.pg_hba(), &Role::Primary).await?;
        bootstrap::write_private(&data_dir.join("recovery.signal"), "").await?;
        self.shared
            .archive
            .read_from(Some(&request.source))
            .context("reading the source cluster's archive")?;
        let replayed = self.replay(&manifest).await;
        let _ = self.shared.archive.read_from(None);
        let postmaster = replayed?;
        let found = if request.verify {
            self.set_restoring("recovered; checking the data".to_owned());
            let checked = verify::check(&self.pool, &instance.socket_dir, instance.args.port).await;
            instance.stop(postmaster, Shutdown::Fast).await?;
            Some(checked.map_err(anyhow::Error::msg)?)
        } else {
            instance.stop(postmaster, Shutdown::Fast).await?;
            None
        };
        instance
            .write_config(&Role::Primary, &self.parameters, &self.sync_names)
            .await?;
        tokio::fs::remove_file(&marker)
            .await
            .with_context(|| format!("removing {}", marker.display()))?;
        tracing::info!(backup = %request.backup_id, "restored");
        Ok(found)
    }

    /// Runs the server in archive recovery until it promotes itself at the target (or
    /// the end of the archive), and checkpoints; returns the running server.
    async fn replay(
        &mut self,
        manifest: &crate::instance_api::BackupReport,
    ) -> anyhow::Result<Postmaster> {
        let instance = self.instance.clone();
        let mut postmaster = Postmaster::start(&instance.binaries, &instance.args.data_dir)?;
        self.set_restoring(format!(
            "replaying WAL from the archive, from {}",
            manifest
                .begin_lsn
                .as_deref()
                .unwrap_or("the backup's start")
        ));
        loop {
            tokio::select! {
                exit = postmaster.exited() => anyhow::bail!(
                    "postgres stopped during the recovery ({exit:?}); its log above says why"
                ),
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
            let state: Result<(bool, Option<String>), sqlx::Error> = sqlx::query_as(
                "select pg_is_in_recovery(), coalesce(pg_last_wal_replay_lsn(), pg_current_wal_lsn())::text",
            )
            .fetch_one(&self.pool)
            .await;
            match state {
                Ok((false, _)) => break,
                Ok((true, lsn)) => self.set_restoring(format!(
                    "replaying WAL from the archive: at {}",
                    lsn.unwrap_or_default()
                )),
                // Not accepting connections before the backup is consistent.
                Err(_) => {}
            }
        }
        self.set_restoring("recovered; promoted at the target".to_owned());
        sqlx::query("checkpoint")
            .execute(&self.pool)
            .await
            .context("checkpointing after the recovery")?;
        Ok(postmaster)
    }

    async fn promote(&mut self, request: PromoteRequest) -> Result<PromoteResponse, String> {
        if self.fenced {
            return Err("this instance is fenced: unfence it before promoting it".to_owned());
        }
        // The lease first: a primary without one would stop at once.
        if self.shared.renew(&request.lease).is_none() {
            return Err("the lease in the promotion request had already ended".to_owned());
        }
        let changed = match self.role.clone() {
            Some(Role::Primary) => false,
            Some(replica @ Role::Replica(_)) if self.postmaster.is_some() => {
                if let Some(names) = request.synchronous_standby_names {
                    // In force before the first commit as a primary: a standby reads
                    // the setting too (it only has no effect there until promotion).
                    self.sync_names = names;
                    self.instance
                        .write_config(&replica, &self.parameters, &self.sync_names)
                        .await
                        .map_err(|e| format!("writing the quorum before promotion: {e}"))?;
                    database::reload(&self.pool)
                        .await
                        .map_err(|e| format!("loading the quorum before promotion: {e}"))?;
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
                tracing::info!(synchronous_standby_names = %self.sync_names, "promoting to primary");
                match database::promote(&self.pool).await {
                    Ok(true) => {}
                    Ok(false) => return Err("the promotion did not finish within 60s".to_owned()),
                    Err(error) => return Err(error.to_string()),
                }
                self.role = Some(Role::Primary);
                // The running server no longer reads its upstream, but a restart would.
                if let Err(error) = self
                    .instance
                    .write_config(&Role::Primary, &self.parameters, &self.sync_names)
                    .await
                {
                    return Err(format!(
                        "promoted, but rewriting the configuration failed: {error}"
                    ));
                }
                true
            }
            _ => return Err("only a running replica can be promoted".to_owned()),
        };
        self.settle().await;
        if let Err(error) = database::keep_slots(&self.pool, &request.slots).await {
            tracing::warn!(%error, "creating the replicas' slots after promotion failed; the next reload retries");
        }
        if changed {
            // The passwords as the Secrets say now. A rotation the old primary applied
            // (its own commits are local) may not have reached this replica before it
            // failed, and this instance read the same files earlier without applying
            // them: without this, the old passwords would stay in force.
            match self
                .instance
                .set_passwords(&self.pool, &self.passwords, None)
                .await
            {
                Ok(roles) => tracing::info!(?roles, "set the passwords after promotion"),
                Err(error) => tracing::warn!(
                    error = %format!("{error:#}"),
                    "setting the passwords after promotion failed; the next start sets them"
                ),
            }
        }
        let timeline = database::status(&self.pool)
            .await
            .ok()
            .and_then(|s| s.timeline);
        Ok(PromoteResponse { changed, timeline })
    }

    /// Stops a primary cleanly (its standbys receive all its WAL), and rejoins it as a
    /// replica once another instance is primary; an empty volume is filled from the
    /// primary instead.
    async fn demote(&mut self) -> Result<FenceResponse, String> {
        if matches!(self.role, Some(Role::Replica(_))) && !self.rejoin {
            return Ok(FenceResponse {
                fenced: self.fenced,
                checkpoint_lsn: None,
            });
        }
        tracing::info!("demoting: this instance will follow the new primary");
        // No lease from here on: the server must not start as a primary again.
        self.shared.lease.send_replace(None);
        if let Some(postmaster) = self.postmaster.take()
            && let Err(error) = self.instance.stop(postmaster, Shutdown::Fast).await
        {
            return Err(format!("{error:#}"));
        }
        let checkpoint_lsn = if self.instance.holds() == Holds::Nothing {
            None
        } else {
            bootstrap::checkpoint_lsn(&self.instance.binaries, &self.instance.args.data_dir)
                .await
                .map_err(|e| e.to_string())?
        };
        self.rejoin = true;
        self.problem = None;
        self.not_before = Instant::now();
        self.publish();
        Ok(FenceResponse {
            fenced: self.fenced,
            checkpoint_lsn,
        })
    }

    async fn fence(&mut self, fenced: bool) -> Result<FenceResponse, String> {
        let marker = self.instance.fence_marker();
        let written = if fenced {
            tokio::fs::write(&marker, b"fenced by the operator\n").await
        } else {
            match tokio::fs::remove_file(&marker).await {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                other => other,
            }
        };
        written.map_err(|e| format!("recording fencing in {}: {e}", marker.display()))?;
        if self.fenced != fenced {
            tracing::info!(fenced, "fencing changed");
        }
        self.fenced = fenced;
        self.not_before = Instant::now();
        self.settle().await;
        let checkpoint_lsn = if fenced && self.instance.holds() != Holds::Nothing {
            bootstrap::checkpoint_lsn(&self.instance.binaries, &self.instance.args.data_dir)
                .await
                .ok()
                .flatten()
        } else {
            None
        };
        Ok(FenceResponse {
            fenced,
            checkpoint_lsn,
        })
    }

    /// Before a start: a parameter PostgreSQL would refuse to start with (a pod made
    /// while the spec held one) is left out, and reported, so that the server starts
    /// rather than crash-looping.
    async fn drop_refused_parameters(&mut self) {
        let Some(refusal) = self.instance.vet_parameters(&self.parameters).await else {
            return;
        };
        tracing::warn!(reasons = ?refusal.reasons, "starting without the server parameters PostgreSQL refuses");
        if refusal.reasons.contains_key(crate::instance_api::TOGETHER) {
            self.parameters.clear();
        } else {
            self.parameters
                .retain(|name, _| !refusal.reasons.contains_key(name));
        }
        self.refused_parameters = Some(refusal);
        self.publish();
    }

    async fn reload(
        &mut self,
        parameters: Option<BTreeMap<String, String>>,
        sync_names: Option<String>,
        slots: Option<Vec<String>>,
        access: Option<Access>,
    ) -> Result<ReloadResponse, String> {
        // The access before this request, to go back to if PostgreSQL cannot read the
        // new pg_hba.conf.
        let previous_access = self.instance.access();
        let access_changed = access.as_ref().is_some_and(|a| *a != previous_access);
        if let Some(access) = access.filter(|_| access_changed) {
            tracing::info!(
                allow_plaintext = access.allow_plaintext,
                superuser = access.superuser,
                hba_lines = access.hba.len(),
                "network access follows spec.tls.allowPlaintext, spec.enableSuperuserAccess and spec.pgHba"
            );
            self.instance.set_access(access);
        }
        // New parameters are written only once PostgreSQL has accepted them; refused,
        // the last good ones stay in force and the refusal is reported.
        if let Some(p) = parameters {
            if p == self.parameters {
                self.refused_parameters = None;
            } else if self
                .refused_parameters
                .as_ref()
                .is_none_or(|r| r.parameters != p)
            {
                match self.instance.vet_parameters(&p).await {
                    None => {
                        self.parameters = p;
                        self.refused_parameters = None;
                    }
                    Some(refusal) => {
                        tracing::warn!(reasons = ?refusal.reasons, "refused server parameters; the last good ones stay in force");
                        self.refused_parameters = Some(refusal);
                    }
                }
            }
        }
        if let Some(s) = sync_names {
            self.sync_names = s;
        }
        let Some(role) = self.role.clone() else {
            self.publish();
            return Ok(ReloadResponse::default());
        };
        self.instance
            .write_config(&role, &self.parameters, &self.sync_names)
            .await
            .map_err(|e| e.to_string())?;
        self.publish();
        if self.postmaster.is_none() {
            // Written; the next start reads it.
            return Ok(ReloadResponse::default());
        }
        if access_changed {
            self.vet_pg_hba(&role, previous_access).await?;
        }
        database::reload(&self.pool)
            .await
            .map_err(|e| e.to_string())?;
        if role == Role::Primary
            && let Some(slots) = slots
        {
            database::keep_slots(&self.pool, &slots)
                .await
                .map_err(|e| e.to_string())?;
        }
        // pg_settings reflects the files only after the reload is processed.
        tokio::time::sleep(Duration::from_millis(300)).await;
        database::pending_restart(&self.pool)
            .await
            .map(|pending_restart| ReloadResponse { pending_restart })
            .map_err(|e| e.to_string())
    }

    /// Asks the running server whether it can load the pg_hba.conf just written
    /// (`pg_hba_file_rules` reads the file, not the rules in force): the checks of
    /// `pg_hba::rule_problem` are meant to admit only lines every build loads, and
    /// this is the proof before a reload. A file it cannot load is replaced by the one
    /// written from `previous` (a reload would keep the old rules anyway, but the next
    /// start would fail on it) and the reload is refused with PostgreSQL's reasons.
    async fn vet_pg_hba(&mut self, role: &Role, previous: Access) -> Result<(), String> {
        let errors = match database::hba_errors(&self.pool).await {
            Ok(errors) => errors,
            Err(error) => {
                tracing::warn!(%error, "could not have PostgreSQL check pg_hba.conf; reloading as written");
                return Ok(());
            }
        };
        if errors.is_empty() {
            return Ok(());
        }
        tracing::warn!(
            ?errors,
            "PostgreSQL cannot load the new pg_hba.conf; keeping the last good one"
        );
        self.instance.set_access(previous);
        self.instance
            .write_config(role, &self.parameters, &self.sync_names)
            .await
            .map_err(|e| e.to_string())?;
        self.publish();
        Err(format!(
            "refused the pg_hba lines: PostgreSQL cannot load them: {}",
            errors.join("; ")
        ))
    }
}

/// Whether an empty volume may be initialised: the pod was created allowing it, and
/// the operator has not marked it since as of a cluster that has had data.
fn initdb_allowed(allow_initdb: bool, cluster_initialized: &str) -> bool {
    allow_initdb && cluster_initialized != "true"
}

/// The path of this executable as a command PostgreSQL can run. Linux names an
/// executable replaced on disk after it started `PATH (deleted)`; the file now at PATH
/// (a rebuilt development binary: images never change under a running container) is
/// the one to run, and the name with the suffix runs nothing.
fn runnable_path(exe: &str) -> &str {
    exe.strip_suffix(" (deleted)").unwrap_or(exe)
}

/// Quotes a word for the shell PostgreSQL runs `archive_command` with.
fn shell_quote(word: &str) -> String {
    format!("'{}'", word.replace('\'', "'\\''"))
}

fn to_json(value: impl serde::Serialize) -> serde_json::Value {
    serde_json::to_value(value).unwrap_or_default()
}

/// Who may connect how when the manager starts, from its arguments (the pod spec's
/// copy of the cluster's spec). Admission and the API refuse pg_hba lines that could
/// stop PostgreSQL from starting; should such lines reach the arguments anyway, the
/// server starts refusing every client but replication (never more open than asked,
/// and never a crash loop), and logs why.
fn initial_access(args: &InstanceArgs) -> anyhow::Result<Access> {
    let hba: Vec<String> = serde_json::from_str(&args.pg_hba)
        .context("parsing --pg-hba as a JSON array of pg_hba.conf lines")?;
    let problems = castellan_crds::pg_hba::rules_problems(&hba);
    let hba = if problems.is_empty() {
        hba
    } else {
        tracing::error!(
            ?problems,
            "refusing every client but replication: the pg_hba lines cannot be loaded"
        );
        vec!["host all all all reject".to_owned()]
    };
    Ok(Access {
        allow_plaintext: args.allow_plaintext,
        superuser: args.superuser_access,
        hba,
    })
}

/// Runs the instance manager until SIGTERM or SIGINT.
pub async fn run(args: InstanceArgs) -> anyhow::Result<()> {
    // Before anything touches the data: without its certificate the instance could
    // never be driven, so it should not start a server either.
    let tls = crate::pki::tls::instance_server_config(
        &args.tls_ca_file,
        &args.tls_cert_file,
        &args.tls_key_file,
    )
    .context("loading the instance API's TLS certificate")?;
    let socket_dir = args
        .socket_dir
        .clone()
        .unwrap_or_else(|| args.data_dir.parent().unwrap_or(Path::new("/")).join("run"));
    private_dir(&socket_dir).await?;
    pglog::open(&socket_dir).await?;
    let passfile = socket_dir.join("pgpass");
    let parameters: BTreeMap<String, String> = serde_json::from_str(&args.parameters)
        .context("parsing --parameters as a JSON object of strings")?;
    let sync_names = args.synchronous_standby_names.clone();

    let binaries = Binaries {
        bin_dir: args.pg_bin_dir.clone(),
    };
    // Whether the build can serve TLS is asked once: the binaries do not change under
    // a running manager.
    let certificates = match (&args.server_tls_dir, &args.replication_tls_dir) {
        (Some(server), Some(replication)) => {
            let probe = socket_dir.join("tls-probe");
            private_dir(&probe).await?;
            let supported = tls::supported(&binaries, &probe)
                .await
                .context("asking PostgreSQL whether it can serve TLS (postgres -C ssl_library)")?;
            Some(tls::Certificates {
                mounted: tls::Mounted {
                    server: server.clone(),
                    replication: replication.clone(),
                },
                files: tls::Files::new(socket_dir.join("tls")),
                supported,
            })
        }
        _ => None,
    };
    let release = version::release(&binaries)
        .await
        .context("asking PostgreSQL for its version (postgres --version)")?;
    let data_refusal = match version::refusal(args.postgres_version.as_deref(), &release) {
        // Binaries of another major than asked for touch no data at all.
        Some(_) => None,
        None => settle_data_major(&args, &release).await?,
    };
    let instance = Arc::new(Instance {
        binaries,
        release,
        data_refusal,
        socket_dir: socket_dir.clone(),
        passfile,
        certificates,
        access: std::sync::RwLock::new(initial_access(&args)?),
        args,
    });
    if let tls::Decision::Refuse(reason) = instance.tls_decision() {
        tracing::error!("{reason}");
    }
    if let Some(refusal) = instance.version_refusal() {
        tracing::error!("{refusal}");
    }
    // Before a base backup, which authenticates with the client certificate.
    instance.install_certificates().await?;
    let passwords = instance.read_passwords().await?;
    instance.write_passfile(&passwords).await?;
    let pool = database::connect(&socket_dir, instance.args.port, "postgres");
    let (publish, published) = watch::channel(Published {
        parameters: parameters.clone(),
        ..Published::default()
    });
    let (requests_tx, mut requests) = mpsc::channel::<(Request, Reply)>(8);
    let archive = Arc::new(archive::Archive::new(
        instance.args.data_dir.clone(),
        instance.binaries.clone(),
        published.clone(),
    ));
    let shared = Arc::new(Shared {
        instance_name: instance.args.instance_name.clone(),
        pool: pool.clone(),
        published,
        lease: watch::Sender::new(None),
        requests: requests_tx,
        archive,
        backups: Arc::new(backup::Backups::new(
            instance.args.instance_name.clone(),
            instance.args.data_dir.clone(),
            instance.binaries.clone(),
            pool.clone(),
        )),
        analyze: watch::Sender::new(None),
    });

    // The API serves before the server starts: a primary waits for its lease through it,
    // and an instance that cannot start says why through it.
    let listen = |port: u16| -> anyhow::Result<SocketAddr> {
        format!("{}:{port}", instance.args.listen_address)
            .parse()
            .with_context(|| {
                format!(
                    "parsing the HTTP listen address {}",
                    instance.args.listen_address
                )
            })
    };
    let http_address = listen(instance.args.http_port)?;
    let listener = tokio::net::TcpListener::bind(http_address)
        .await
        .with_context(|| format!("listening on {http_address}"))?;
    let probe_address = listen(instance.args.probe_port)?;
    let probe_listener = tokio::net::TcpListener::bind(probe_address)
        .await
        .with_context(|| format!("listening on {probe_address}"))?;
    let metrics_address = listen(instance.args.metrics_port)?;
    let metrics_listener = tokio::net::TcpListener::bind(metrics_address)
        .await
        .with_context(|| format!("listening on {metrics_address} for /metrics"))?;
    tracing::info!(%http_address, %probe_address, %metrics_address, "serving the instance API (TLS), probes and metrics");
    tokio::spawn(api::serve(listener, Arc::new(tls), shared.clone()));
    tokio::spawn(api::serve_probes(probe_listener, shared.clone()));
    // Metrics read the server when scraped, over the manager's own pool: no second
    // set of credentials, and a stopped server reads as castellan_pg_up 0.
    tokio::spawn({
        let (pool, cluster) = (pool.clone(), instance.args.cluster_name.clone());
        crate::exposition::serve(metrics_listener, move || {
            let (pool, cluster) = (pool.clone(), cluster.clone());
            async move { metrics::scrape(&pool, &cluster).await }
        })
    });
    tokio::spawn(heartbeat(shared.clone()));
    tokio::spawn(watch_upstream(shared.clone()));
    // archive_command's way in: a socket in the directory only this instance's user
    // may enter.
    let archive_socket = socket_dir.join(archive::SOCKET);
    let _ = tokio::fs::remove_file(&archive_socket).await;
    let archive_listener = tokio::net::UnixListener::bind(&archive_socket)
        .with_context(|| format!("listening on {}", archive_socket.display()))?;
    tokio::spawn(archive::serve(archive_listener, shared.archive.clone()));

    let fenced = instance.fence_marker().exists();
    let (role, problem) = match instance.holds() {
        // Binaries of another major touch no data (`version`): the role stays open and
        // the supervisor only reports why.
        _ if instance.version_refusal().is_some() => (None, instance.version_refusal()),
        Holds::Primary => (Some(Role::Primary), None),
        Holds::Replica => (Some(Role::Replica(instance.upstream()?)), None),
        Holds::Nothing => match instance.fill().await? {
            Some(role) => (Some(role), None),
            None if instance.args.await_restore => {
                tracing::info!(
                    "empty volume: waiting for the operator to send the backup to restore"
                );
                (None, None)
            }
            None => {
                let problem = "the volume is empty but this cluster already has data: \
                               waiting for the operator to make this instance a replica of the \
                               new primary (initdb runs only for a cluster that never had data)";
                tracing::error!("{problem}");
                (None, Some(problem.to_owned()))
            }
        },
    };
    if role == Some(Role::Primary) {
        tracing::info!("primary data: the server starts once the operator grants the lease");
    }
    let mut supervisor = Supervisor {
        instance,
        pool,
        shared: shared.clone(),
        publish,
        role,
        postmaster: None,
        fenced,
        rejoin: false,
        parameters,
        refused_parameters: None,
        sync_names,
        prepared: false,
        not_before: Instant::now(),
        restarts: restart_backoff(),
        started: Instant::now(),
        problem,
        restore: None,
        // Absent until the operator sends the restore: that is how it knows to.
        restoring: None,
        passwords,
        verification: None,
        certificates: FollowedCertificates::default(),
    };
    supervisor.settle().await;

    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    let mut lease = shared.lease.subscribe();
    loop {
        // Wake when the lease runs out, when a back-off ends, or every second to
        // retry what is pending.
        let now = Instant::now();
        let mut wake = now + Duration::from_secs(1);
        if let Some(end) = *lease.borrow_and_update()
            && supervisor.postmaster.is_some()
            && supervisor.role == Some(Role::Primary)
        {
            wake = wake.min(end);
        }
        if supervisor.not_before > now {
            wake = wake.min(supervisor.not_before);
        }
        tokio::select! {
            _ = terminate.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
            exit = exited(&mut supervisor.postmaster) => {
                // The server died under us: restart it, backing off if it keeps dying
                // (a server that ran for a while starts over from the shortest delay).
                supervisor.postmaster = None;
                if supervisor.started.elapsed() > STABLE_RUN {
                    supervisor.restarts = restart_backoff();
                }
                let delay = supervisor.restarts.next().unwrap_or(Duration::from_secs(30));
                tracing::error!(status = ?exit, ?delay, "postgres exited unexpectedly; restarting");
                supervisor.not_before = Instant::now() + delay;
                supervisor.publish();
            }
            changed = lease.changed() => {
                if changed.is_err() { break; }
            }
            Some((request, reply)) = requests.recv() => {
                let outcome = supervisor.handle(request).await;
                let _ = reply.send(outcome);
            }
            () = tokio::time::sleep_until(wake) => {}
        }
        supervisor.settle().await;
    }
    tracing::info!("shutting down");
    if let Some(postmaster) = supervisor.postmaster.take() {
        supervisor.instance.stop(postmaster, Shutdown::Fast).await?;
    }
    Ok(())
}

/// Data of another major than the binaries (a major upgrade changed the image): a
/// replica's data is cleared, so that it is copied from the (upgraded) primary again;
/// a primary's is left alone and the returned refusal keeps the server from starting.
/// Only a replica's data: a volume without `standby.signal` may be the only copy of a
/// primary, whatever role its pod was created in.
async fn settle_data_major(args: &InstanceArgs, release: &str) -> anyhow::Result<Option<String>> {
    let data_dir = &args.data_dir;
    let Some(held) = version::data_major(data_dir).await else {
        return Ok(None);
    };
    let Some(mismatch) = version::data_mismatch(&held, release) else {
        return Ok(None);
    };
    if args.role == StartRole::Replica && data_dir.join("standby.signal").exists() {
        tracing::warn!(
            data_dir = %data_dir.display(),
            "{mismatch}: clearing this replica's data directory to copy the primary afresh"
        );
        bootstrap::clear_dir(data_dir)
            .await
            .with_context(|| format!("emptying {}", data_dir.display()))?;
        return Ok(None);
    }
    // Logged with the other refusals when the manager starts.
    Ok(Some(format!(
        "{mismatch}: a primary's data is never started or touched by another major; \
         upgrade it (castellan upgrade run) or run it with an image of PostgreSQL {held}"
    )))
}

/// Runs `vacuumdb --all --analyze-in-stages` on a primary that started on a major
/// upgrade's data directory (`upgrade::ANALYZE_MARKER`), in the background: the
/// instance serves meanwhile, with the statistics pg_upgrade carried (PostgreSQL 18
/// carries most; then only what is missing is gathered). The marker goes once it is
/// done; a failure is reported and the next start tries again.
async fn analyze(shared: Arc<Shared>, instance: Arc<Instance>) {
    let marker = instance.args.data_dir.join(crate::upgrade::ANALYZE_MARKER);
    shared
        .analyze
        .send_replace(Some(crate::instance_api::ANALYZE_RUNNING.to_owned()));
    let socket = instance.socket_dir.to_string_lossy().into_owned();
    let port = instance.args.port.to_string();
    let mut args = vec![
        "--all",
        "--analyze-in-stages",
        "--host",
        &*socket,
        "--port",
        &*port,
        "--username",
        "postgres",
    ];
    // PostgreSQL 18's pg_upgrade carries the planner statistics: keep them (the
    // planner's choices never get transiently worse) and gather only what is missing.
    if version::major_of(&instance.release)
        .parse::<u32>()
        .is_ok_and(|major| major >= 18)
    {
        args.push("--missing-stats-only");
    }
    tracing::info!(?args, "analyzing the databases after the major upgrade");
    let began = Instant::now();
    let outcome = match instance.binaries.run("vacuumdb", &args, &[]).await {
        Ok(_) => tokio::fs::remove_file(&marker)
            .await
            .with_context(|| format!("removing {}", marker.display())),
        Err(error) => {
            Err(anyhow::Error::new(error).context("running vacuumdb --analyze-in-stages"))
        }
    };
    let state = match outcome {
        Ok(()) => {
            tracing::info!(elapsed = ?began.elapsed(), "the databases are analyzed");
            crate::instance_api::ANALYZE_DONE.to_owned()
        }
        Err(error) => {
            let error = format!("{error:#}");
            tracing::error!(%error, "analyzing after the major upgrade failed; the next start tries again");
            error
        }
    };
    shared.analyze.send_replace(Some(state));
}

/// A server that ran this long without dying is restarted at once when it dies.
const STABLE_RUN: Duration = Duration::from_secs(30);

/// Restarts after the server died: 0.5 s, 1 s, 2 s … up to 30 s.
fn restart_backoff() -> backon::ExponentialBackoff {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(500))
        .with_max_delay(Duration::from_secs(30))
        .without_max_times()
        .build()
}

/// Resolves when the running server exits; never when none runs.
async fn exited(postmaster: &mut Option<Postmaster>) -> std::io::Result<std::process::ExitStatus> {
    match postmaster {
        Some(postmaster) => postmaster.exited().await,
        None => std::future::pending().await,
    }
}

/// How long a replica's WAL receiver may stay connecting before it is restarted.
const RECEIVER_CONNECT_LIMIT: Duration = Duration::from_secs(5);

/// Restarts a replica's WAL receiver that stays connecting for longer than
/// [`RECEIVER_CONNECT_LIMIT`]. A connection through `-rw` to a primary that was frozen
/// or paused is accepted by its kernel and then never answered; PostgreSQL's WAL
/// receiver waits for it without a timeout (`connect_timeout` does not apply to it,
/// and `wal_receiver_timeout` only once it streams), so the replica would never reach
/// the new primary behind `-rw`, and under required durability the new primary's
/// commits would wait for it.
async fn watch_upstream(shared: Arc<Shared>) {
    let mut interval = tokio::time::interval(Duration::from_secs(1));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut connecting = None;
    loop {
        interval.tick().await;
        let published = shared.published.borrow().clone();
        let receiver = if published.role == Some(RunningRole::Replica) && published.running {
            database::connecting_wal_receiver(&shared.pool)
                .await
                .ok()
                .flatten()
        } else {
            None
        };
        let (next, stuck) = connecting_since(connecting, receiver, Instant::now());
        connecting = next;
        if let Some(pid) = stuck {
            tracing::warn!(
                pid,
                limit = ?RECEIVER_CONNECT_LIMIT,
                "the WAL receiver has been connecting to the upstream for too long; restarting it"
            );
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
    }
}

/// Since when the WAL receiver `receiver` (its pid, while it is connecting) has been
/// connecting, and the pid to restart once that is longer than the limit. A new pid
/// starts the clock again.
fn connecting_since(
    seen: Option<(i32, Instant)>,
    receiver: Option<i32>,
    now: Instant,
) -> (Option<(i32, Instant)>, Option<i32>) {
    match (receiver, seen) {
        (Some(pid), Some((seen_pid, since))) if pid == seen_pid => {
            if now.duration_since(since) >= RECEIVER_CONNECT_LIMIT {
                (None, Some(pid))
            } else {
                (Some((pid, since)), None)
            }
        }
        (Some(pid), _) => (Some((pid, now)), None),
        (None, _) => (None, None),
    }
}

/// Writes the heartbeat every second while this instance is a running primary.
async fn heartbeat(shared: Arc<Shared>) {
    let mut interval = tokio::time::interval(Duration::from_secs(1));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        let published = shared.published.borrow().clone();
        if published.role != Some(RunningRole::Primary) || !published.running {
            continue;
        }
        if let Err(error) = database::beat(&shared.pool).await {
            tracing::debug!(%error, "heartbeat not written");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn initdb_only_while_the_pod_allows_it_and_is_not_marked_initialized() {
        assert!(initdb_allowed(true, ""));
        // The first pod of a cluster keeps `--allow-initdb` for life; the mark the
        // operator puts on it once the cluster has data withdraws it.
        assert!(!initdb_allowed(true, "true"));
        assert!(!initdb_allowed(false, ""));
        assert!(!initdb_allowed(false, "true"));
    }

    #[test]
    fn a_replaced_executable_is_run_by_its_path() {
        assert_eq!(
            runnable_path("/usr/bin/castellan (deleted)"),
            "/usr/bin/castellan"
        );
        assert_eq!(runnable_path("/usr/bin/castellan"), "/usr/bin/castellan");
    }

    #[test]
    fn a_wal_receiver_connecting_past_the_limit_is_restarted_once() {
        let start = Instant::now();
        let (seen, stuck) = connecting_since(None, Some(7), start);
        assert_eq!((seen, stuck), (Some((7, start)), None));
        let (seen, stuck) = connecting_since(seen, Some(7), start + Duration::from_secs(4));
        assert_eq!((seen, stuck), (Some((7, start)), None));
        let (seen, stuck) = connecting_since(seen, Some(7), start + RECEIVER_CONNECT_LIMIT);
        assert_eq!((seen, stuck), (None, Some(7)));
    }

    #[test]
    fn only_rotated_passwords_are_set_again_and_all_at_a_start() {
        let passwords = Passwords {
            superuser: "s".into(),
            replication: "r".into(),
            app: Some("a".into()),
        };
        let roles = |applied: Option<&Passwords>| -> Vec<&str> {
            roles_to_set("clerk", &passwords, applied)
                .into_iter()
                .map(|(role, _, _)| role)
                .collect()
        };
        assert_eq!(roles(None), ["postgres", "streaming_replica", "clerk"]);
        assert!(roles(Some(&passwords)).is_empty());
        let before = Passwords {
            app: Some("old".into()),
            ..passwords.clone()
        };
        assert_eq!(
            roles_to_set("clerk", &passwords, Some(&before)),
            [("clerk", "a", "")]
        );
        let without_app = Passwords {
            app: None,
            ..passwords.clone()
        };
        assert_eq!(
            roles_to_set("clerk", &without_app, None).len(),
            2,
            "no application role without its Secret"
        );
    }

    #[test]
    fn a_new_or_streaming_wal_receiver_starts_the_clock_again() {
        let start = Instant::now();
        let later = start + RECEIVER_CONNECT_LIMIT;
        // Restarted: another pid.
        assert_eq!(
            connecting_since(Some((7, start)), Some(8), later),
            (Some((8, later)), None)
        );
        // Connected (or none running): nothing to watch.
        assert_eq!(
            connecting_since(Some((7, start)), None, later),
            (None, None)
        );
    }
}

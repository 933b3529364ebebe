//! `castellan instance`: the instance manager, PID 1 of every database pod.
//!
//! It bootstraps the data directory (initdb for a cluster's first instance, a base
//! backup of the primary for the others), writes the configuration Castellan owns,
//! runs and supervises PostgreSQL (restarting it with back-off when it dies), writes
//! the primary's heartbeat, and serves the HTTP API the operator drives it with
//! (`api`). It never decides roles itself: promotion and demotion are the operator's
//! calls.

mod api;
mod bootstrap;
mod config;
mod database;
mod postmaster;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use backon::{BackoffBuilder, ExponentialBuilder};
use sqlx::PgPool;
use tokio::sync::{mpsc, oneshot, watch};

use bootstrap::Binaries;
use config::{Role, Upstream};
use postmaster::Postmaster;

/// The role the operator wants this instance to start in. It decides how an empty
/// volume is filled, and what happens to data that says otherwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum StartRole {
    /// Empty volume: initdb. Existing replica data: start, then promote.
    Primary,
    /// Empty volume: base backup of `--upstream-host`. Existing primary data (a former
    /// primary after a failover): rewind it onto the new primary's timeline with
    /// pg_rewind, then follow.
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
    /// The role to start in.
    #[arg(long, env = "CASTELLAN_ROLE", value_enum, default_value = "primary")]
    pub role: StartRole,
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
    /// JSON object of server parameters (from the DatabaseCluster spec).
    #[arg(long, env = "CASTELLAN_PARAMETERS", default_value = "{}")]
    pub parameters: String,
    /// `synchronous_standby_names` to start with (the operator updates it by reload).
    #[arg(long, env = "CASTELLAN_SYNCHRONOUS_STANDBY_NAMES", default_value = "")]
    pub synchronous_standby_names: String,
}

/// A request from the HTTP API, carried out by the supervisor one at a time so that
/// a promotion never races a restart.
pub enum Request {
    Promote,
    Restart,
    Reload {
        parameters: Option<BTreeMap<String, String>>,
        synchronous_standby_names: Option<String>,
    },
}

pub type Reply = oneshot::Sender<Result<serde_json::Value, String>>;

/// What the HTTP API and the heartbeat share with the supervisor.
pub struct Shared {
    pub instance_name: String,
    pub pool: PgPool,
    pub role: watch::Receiver<Role>,
    /// The server parameters the configuration was last written with, reported in
    /// status so the operator knows which instances a spec change has not reached.
    pub parameters: watch::Receiver<BTreeMap<String, String>>,
    pub requests: mpsc::Sender<(Request, Reply)>,
}

/// Everything fixed for the life of the process.
struct Instance {
    args: InstanceArgs,
    binaries: Binaries,
    socket_dir: PathBuf,
    passfile: PathBuf,
}

async fn read_secret(path: &Path) -> anyhow::Result<String> {
    let value = tokio::fs::read_to_string(path)
        .await
        .with_context(|| format!("reading secret file {}", path.display()))?;
    Ok(value.trim_end_matches(['\n', '\r']).to_owned())
}

async fn private_dir(path: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    tokio::fs::create_dir_all(path)
        .await
        .with_context(|| format!("creating {}", path.display()))?;
    tokio::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700))
        .await
        .with_context(|| format!("restricting {} to its owner", path.display()))
}

impl Instance {
    fn upstream(&self) -> anyhow::Result<Upstream> {
        let host = self.args.upstream_host.clone().context(
            "a replica needs --upstream-host (the cluster's -rw Service) to follow its primary",
        )?;
        Ok(Upstream {
            host,
            port: self.args.upstream_port,
            slot: config::slot_name(&self.args.instance_name),
        })
    }

    fn conf(&self, role: &Role, parameters: &BTreeMap<String, String>, sync_names: &str) -> String {
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
        })
    }

    /// Makes the data directory if the volume is empty, or brings existing data into
    /// line with the role asked for; returns the role to start in and whether to
    /// promote once started.
    async fn bootstrap(&self) -> anyhow::Result<(Role, bool)> {
        let data_dir = &self.args.data_dir;
        if bootstrap::initialised(data_dir) {
            let holds_replica = data_dir.join("standby.signal").exists();
            tracing::info!(data_dir = %data_dir.display(), holds_replica, "data directory exists; keeping it");
            return match (self.args.role, holds_replica) {
                (StartRole::Primary, false) => Ok((Role::Primary, false)),
                (StartRole::Primary, true) => Ok((Role::Replica(self.upstream()?), true)),
                (StartRole::Replica, true) => Ok((Role::Replica(self.upstream()?), false)),
                (StartRole::Replica, false) => {
                    // A former primary: its WAL may have diverged from the new primary's
                    // timeline. pg_rewind copies back what differs (running crash
                    // recovery first if the server did not shut down cleanly).
                    let upstream = self.upstream()?;
                    tracing::info!(host = %upstream.host, "rejoining a former primary with pg_rewind");
                    let output =
                        bootstrap::rewind(&self.binaries, data_dir, &upstream, &self.passfile)
                            .await
                            .with_context(|| {
                                format!("rewinding {} onto {}", data_dir.display(), upstream.host)
                            })?;
                    tracing::info!(output = %output.trim(), "pg_rewind finished");
                    Ok((Role::Replica(upstream), false))
                }
            };
        }
        private_dir(data_dir).await?;
        match self.args.role {
            StartRole::Primary => {
                tracing::info!(data_dir = %data_dir.display(), "creating an empty cluster with initdb");
                bootstrap::initdb(&self.binaries, data_dir, &self.args.superuser_password_file)
                    .await
                    .with_context(|| format!("running initdb in {}", data_dir.display()))?;
                Ok((Role::Primary, false))
            }
            StartRole::Replica => {
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
                Ok((Role::Replica(upstream), false))
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
            &self.conf(role, parameters, sync_names),
            role,
        )
        .await
    }

    /// Promotes the running replica and rewrites the configuration without its
    /// upstream (the running server no longer reads it, but a restart would).
    async fn promote(
        &self,
        pool: &PgPool,
        parameters: &BTreeMap<String, String>,
        sync_names: &str,
    ) -> anyhow::Result<()> {
        tracing::info!("promoting to primary");
        if !database::promote(pool).await? {
            anyhow::bail!(
                "promoting {} did not finish within 60s",
                self.args.instance_name
            );
        }
        self.write_config(&Role::Primary, parameters, sync_names)
            .await
            .context("promoted, but rewriting the configuration failed")
    }

    async fn start(
        &self,
        role: &Role,
        parameters: &BTreeMap<String, String>,
        sync_names: &str,
    ) -> anyhow::Result<Postmaster> {
        self.write_config(role, parameters, sync_names).await?;
        if let Role::Replica(upstream) = role {
            bootstrap::ensure_slot(&self.binaries, upstream, &self.passfile)
                .await
                .with_context(|| format!("creating slot {} on {}", upstream.slot, upstream.host))?;
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

    async fn stop(&self, postmaster: Postmaster) -> anyhow::Result<()> {
        postmaster
            .stop(&self.binaries, &self.args.data_dir, Duration::from_secs(60))
            .await
            .with_context(|| format!("stopping postgres in {}", self.args.data_dir.display()))
    }

    /// On a primary: Castellan's schema, the replication role and the application's
    /// role and database, all idempotent.
    async fn prepare_primary(&self, pool: &PgPool) -> anyhow::Result<()> {
        database::migrate(pool).await?;
        let replication = read_secret(&self.args.replication_password_file).await?;
        database::ensure_role(pool, config::REPLICATION_USER, &replication, "replication").await?;
        if let Some(file) = &self.args.app_password_file {
            let password = read_secret(file).await?;
            database::ensure_role(pool, &self.args.app_owner, &password, "").await?;
            database::ensure_database(pool, &self.args.app_database, &self.args.app_owner).await?;
        }
        Ok(())
    }
}

pub fn role_name(role: &Role) -> &'static str {
    match role {
        Role::Primary => "primary",
        Role::Replica(_) => "replica",
    }
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
    let superuser_password = read_secret(&args.superuser_password_file).await?;
    let replication_password = read_secret(&args.replication_password_file).await?;
    let passfile = socket_dir.join("pgpass");
    bootstrap::write_private(
        &passfile,
        &config::render_passfile(&superuser_password, &replication_password),
    )
    .await?;
    let mut parameters: BTreeMap<String, String> = serde_json::from_str(&args.parameters)
        .context("parsing --parameters as a JSON object of strings")?;
    let mut sync_names = args.synchronous_standby_names.clone();

    let instance = Arc::new(Instance {
        binaries: Binaries {
            bin_dir: args.pg_bin_dir.clone(),
        },
        socket_dir: socket_dir.clone(),
        passfile,
        args,
    });
    let (mut role, promote_once_started) = instance.bootstrap().await?;
    let pool = database::connect(&socket_dir, instance.args.port, "postgres");
    let mut postmaster = instance.start(&role, &parameters, &sync_names).await?;
    if promote_once_started {
        tracing::info!("asked to start as primary on replica data");
        instance.promote(&pool, &parameters, &sync_names).await?;
        role = Role::Primary;
    }
    if role == Role::Primary {
        instance.prepare_primary(&pool).await?;
    }

    let (role_tx, role_rx) = watch::channel(role.clone());
    let (parameters_tx, parameters_rx) = watch::channel(parameters.clone());
    let (requests_tx, mut requests) = mpsc::channel::<(Request, Reply)>(8);
    let shared = Arc::new(Shared {
        instance_name: instance.args.instance_name.clone(),
        pool: pool.clone(),
        role: role_rx,
        parameters: parameters_rx,
        requests: requests_tx,
    });
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
    tracing::info!(%http_address, %probe_address, "serving the instance API (TLS) and probes");
    tokio::spawn(api::serve(listener, Arc::new(tls), shared.clone()));
    tokio::spawn(api::serve_probes(probe_listener, shared.clone()));
    tokio::spawn(heartbeat(shared.clone()));

    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    let mut restarts = ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(500))
        .with_max_delay(Duration::from_secs(30))
        .without_max_times()
        .build();
    loop {
        tokio::select! {
            _ = terminate.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
            exit = postmaster.exited() => {
                // The server died under us: restart it, backing off if it keeps dying.
                let delay = restarts.next().unwrap_or(Duration::from_secs(30));
                tracing::error!(status = ?exit, ?delay, "postgres exited unexpectedly; restarting");
                tokio::time::sleep(delay).await;
                postmaster = instance.start(&role, &parameters, &sync_names).await?;
            }
            Some((request, reply)) = requests.recv() => {
                let outcome = match request {
                    Request::Promote => match &role {
                        Role::Primary => Ok(serde_json::json!({"role": "primary", "changed": false})),
                        Role::Replica(_) => match instance.promote(&pool, &parameters, &sync_names).await {
                            Ok(()) => {
                                role = Role::Primary;
                                let _ = role_tx.send(role.clone());
                                Ok(serde_json::json!({"role": "primary", "changed": true}))
                            }
                            Err(e) => Err(format!("{e:#}")),
                        },
                    },
                    Request::Restart => {
                        tracing::info!("restarting postgres");
                        let result: anyhow::Result<Postmaster> = async {
                            instance.stop(postmaster).await?;
                            instance.start(&role, &parameters, &sync_names).await
                        }.await;
                        match result {
                            Ok(started) => { postmaster = started; Ok(serde_json::json!({"restarted": true})) }
                            Err(e) => {
                                let _ = reply.send(Err(format!("{e:#}")));
                                return Err(e.context("restarting postgres"));
                            }
                        }
                    }
                    Request::Reload { parameters: new_parameters, synchronous_standby_names } => {
                        if let Some(p) = new_parameters { parameters = p; }
                        if let Some(s) = synchronous_standby_names { sync_names = s; }
                        let written = instance.write_config(&role, &parameters, &sync_names).await;
                        if written.is_ok() {
                            parameters_tx.send_replace(parameters.clone());
                        }
                        match written {
                            Err(e) => Err(e.to_string()),
                            Ok(()) => match database::reload(&pool).await {
                                Err(e) => Err(e.to_string()),
                                Ok(()) => {
                                    // pg_settings reflects the files only after the reload is processed.
                                    tokio::time::sleep(Duration::from_millis(300)).await;
                                    database::pending_restart(&pool).await
                                        .map(|pending| serde_json::json!({"reloaded": true, "pendingRestart": pending}))
                                        .map_err(|e| e.to_string())
                                }
                            },
                        }
                    }
                };
                let _ = reply.send(outcome);
            }
        }
    }
    tracing::info!("shutting down");
    instance.stop(postmaster).await?;
    Ok(())
}

/// Writes the heartbeat every second while this instance is the primary.
async fn heartbeat(shared: Arc<Shared>) {
    let mut interval = tokio::time::interval(Duration::from_secs(1));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        if *shared.role.borrow() != Role::Primary {
            continue;
        }
        if let Err(error) = database::beat(&shared.pool).await {
            tracing::debug!(%error, "heartbeat not written");
        }
    }
}

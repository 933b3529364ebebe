//! `kubectl castellan`: the kubectl plugin, the same binary run as `kubectl-castellan`
//! (kubectl finds it on PATH by that name) or as `castellan plugin`. Every command reads
//! or changes Castellan's resources the way a user could with kubectl — annotations,
//! new objects, the API server's log endpoint — never through a side channel to the
//! operator or the instances, so what it does is visible in the objects and their
//! Events, and RBAC governs it as it governs kubectl.
//!
//! One module per command; `table.rs` lays out what they print.

mod actions;
mod backup;
mod logs;
mod pools;
mod psql;
mod report;
mod status;
mod table;

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use serde::Serialize;

/// The name kubectl runs the plugin by; `main` dispatches here when argv[0] is it.
pub const PLUGIN_NAME: &str = "kubectl-castellan";

/// `kubectl castellan`: Castellan's clusters and pools from the command line.
#[derive(Parser)]
#[command(name = "kubectl castellan", bin_name = "kubectl castellan", version = crate::VERSION)]
pub struct PluginCli {
    #[command(flatten)]
    pub args: PluginArgs,
}

#[derive(Args)]
pub struct PluginArgs {
    /// The kubeconfig to use (default: KUBECONFIG, then ~/.kube/config, then in-cluster).
    #[arg(long, global = true)]
    kubeconfig: Option<PathBuf>,
    /// The kubeconfig context to use.
    #[arg(long, global = true)]
    context: Option<String>,
    /// The namespace of the cluster (default: the context's).
    #[arg(short, long, global = true)]
    namespace: Option<String>,
    #[command(subcommand)]
    command: PluginCommand,
}

#[derive(Subcommand)]
enum PluginCommand {
    /// A DatabaseCluster at a glance: instances, roles, lag, replication, archiving,
    /// backups, conditions.
    Status {
        cluster: String,
        #[arg(short, long, value_enum, default_value_t)]
        output: Output,
    },
    /// StoragePools, their disks (BlockDevices), capacity and health.
    Pools {
        #[arg(short, long, value_enum, default_value_t)]
        output: Output,
    },
    /// Run the local psql against the primary (or a replica) through the cluster's
    /// Service, as the application user.
    Psql(psql::PsqlArgs),
    /// The instances' logs, each line prefixed with its pod.
    Logs(logs::LogsArgs),
    /// Switch the primary over to INSTANCE (`castellan.io/switchover-to`).
    #[command(alias = "switchover")]
    Promote { cluster: String, instance: String },
    /// Stop INSTANCE's server and keep it stopped (`castellan.io/fenced-instances`);
    /// `*` fences them all.
    Fence { cluster: String, instance: String },
    /// Let a fenced INSTANCE run again; `*` unfences them all.
    Unfence { cluster: String, instance: String },
    /// Restart every instance, replicas first, the primary last (`castellan.io/restart`).
    Restart { cluster: String },
    /// Have every instance reload its configuration (`castellan.io/reload`).
    Reload { cluster: String },
    /// Take a backup (a new Backup object) and follow it to the end.
    Backup(backup::BackupArgs),
    /// Write a diagnostic bundle (objects, Events, logs, status; Secrets by name only).
    Report(report::ReportArgs),
}

/// How a command prints what it read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// For people: tables, coloured on a terminal.
    #[default]
    Table,
    Json,
    Yaml,
}

/// Prints `value` as JSON or YAML; `false` when the output is a table (the caller's).
pub fn print_structured(output: Output, value: &impl Serialize) -> anyhow::Result<bool> {
    match output {
        Output::Table => Ok(false),
        Output::Json => {
            out_line(serde_json::to_string_pretty(value).context("writing JSON")?)?;
            Ok(true)
        }
        Output::Yaml => {
            write_out(&serde_yaml_ng::to_string(value).context("writing YAML")?)?;
            Ok(true)
        }
    }
}

/// Writes `text` to standard output. A reader that went away (`| head`) ends the
/// command quietly, as it ends other command-line tools: `println!` would panic.
pub fn write_out(text: &str) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        other => other.context("writing to standard output"),
    }
}

/// [`write_out`] of `text` and a line break.
pub fn out_line(text: impl std::fmt::Display) -> anyhow::Result<()> {
    write_out(&format!("{text}\n"))
}

/// The API client and the namespace the command works in.
pub struct Target {
    pub client: Client,
    pub namespace: String,
}

async fn connect(args: &PluginArgs) -> anyhow::Result<Target> {
    let options = KubeConfigOptions {
        context: args.context.clone(),
        ..KubeConfigOptions::default()
    };
    let config = match &args.kubeconfig {
        Some(path) => {
            let kubeconfig = Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            Config::from_custom_kubeconfig(kubeconfig, &options)
                .await
                .with_context(|| format!("loading kubeconfig {}", path.display()))?
        }
        None if args.context.is_some() => Config::from_kubeconfig(&options)
            .await
            .context("loading the kubeconfig")?,
        None => Config::infer()
            .await
            .context("finding a kubeconfig (KUBECONFIG, ~/.kube/config, in-cluster)")?,
    };
    let namespace = args
        .namespace
        .clone()
        .unwrap_or_else(|| config.default_namespace.clone());
    let client = crate::api_client::from_config(config)?;
    Ok(Target { client, namespace })
}

/// Runs the plugin: argv[0] was `kubectl-castellan`, or `castellan plugin` was asked for.
pub fn run(args: PluginArgs) -> anyhow::Result<()> {
    crate::runtime()?.block_on(dispatch(args))
}

async fn dispatch(args: PluginArgs) -> anyhow::Result<()> {
    let target = connect(&args).await?;
    match args.command {
        PluginCommand::Status { cluster, output } => status::run(&target, &cluster, output).await,
        PluginCommand::Pools { output } => pools::run(&target, output).await,
        PluginCommand::Psql(psql) => psql::run(&target, psql).await,
        PluginCommand::Logs(logs) => logs::run(&target, logs).await,
        PluginCommand::Promote { cluster, instance } => {
            actions::switchover(&target, &cluster, &instance).await
        }
        PluginCommand::Fence { cluster, instance } => {
            actions::fence(&target, &cluster, &instance, true).await
        }
        PluginCommand::Unfence { cluster, instance } => {
            actions::fence(&target, &cluster, &instance, false).await
        }
        PluginCommand::Restart { cluster } => {
            actions::declare(
                &target,
                &cluster,
                crate::operator::cluster::RESTART_ANNOTATION,
            )
            .await
        }
        PluginCommand::Reload { cluster } => {
            actions::declare(
                &target,
                &cluster,
                crate::operator::cluster::RELOAD_ANNOTATION,
            )
            .await
        }
        PluginCommand::Backup(backup) => backup::run(&target, backup).await,
        PluginCommand::Report(report) => report::run(&target, report).await,
    }
}

//! `castellan`: the one binary of Castellan. Its subcommands are the processes the
//! architecture describes (operator, agent, instance manager) and the tools around
//! them.
#![forbid(unsafe_code)]

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};

mod agent;
mod api_client;
mod cadence;
mod events;
mod exposition;
mod instance;
mod instance_api;
mod kube_ops;
mod operator;
mod pki;
mod plugin;
mod telemetry;
mod upgrade;

/// Castellan runs stateful data services on Kubernetes by itself.
#[derive(Parser)]
#[command(name = "castellan", version = VERSION)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print every CustomResourceDefinition as YAML, or write one file each.
    Crds {
        /// Write `<group>_<plural>.yaml` files into this directory instead of printing.
        #[arg(long)]
        out_dir: Option<PathBuf>,
    },
    /// Print the version of this binary and of the API it serves.
    Version,
    /// Run the node agent: discover this node's disks and keep its BlockDevices current.
    Agent(agent::AgentArgs),
    /// Run the operator: the controllers.
    Operator(operator::OperatorArgs),
    /// Run the instance manager: PID 1 of a database pod.
    Instance(Box<instance::InstanceArgs>),
    /// The instance side of a PostgreSQL major upgrade (export the old binaries, run
    /// pg_upgrade, roll back, forget the old data); the last line of stdout is a JSON
    /// report.
    Upgrade(upgrade::UpgradeArgs),
    /// The kubectl plugin, `kubectl castellan` (this binary runs it by itself when
    /// invoked as `kubectl-castellan`).
    Plugin(plugin::PluginArgs),
    /// Make Castellan's CA and issue its certificates as files (tests, debugging).
    Pki(pki::cli::PkiArgs),
    /// PostgreSQL's `archive_command`: hand a completed WAL file to the instance
    /// manager, which stores it in the object store; exits 0 only once it is stored.
    WalArchive {
        /// The instance manager's archive socket.
        #[arg(long)]
        socket: PathBuf,
        /// The file, as PostgreSQL names it (`%p`: relative to the data directory).
        file: PathBuf,
    },
    /// PostgreSQL's `restore_command`: have the instance manager fetch a WAL file from
    /// the object store; exits 1 when the archive does not have it.
    WalRestore {
        /// The instance manager's archive socket.
        #[arg(long)]
        socket: PathBuf,
        /// The WAL file's name (`%f`).
        file: String,
        /// Where PostgreSQL wants it (`%p`: relative to the data directory).
        dest: PathBuf,
    },
}

const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Runs the long-lived control processes (operator, agent) with one malloc arena.
///
/// glibc gives threads that allocate at the same time arenas of their own (up to eight
/// per core), and memory freed in one arena serves no other: the burst of an operator
/// starting onto 100 clusters (a hundred actors' requests at once) leaves each arena
/// holding its peak. With one arena that operator held 9 MiB less untraced and 11–13
/// MiB less with traces exported, of 50–57 MiB (docs/benchmarks.md, Scale); these processes do too little
/// allocation for the shared lock to matter. The setting must be in place before the
/// first allocation, and the code forbids `unsafe` (no `mallopt`), so the process
/// executes itself again with `MALLOC_ARENA_MAX=1` in its environment, keeping its pid
/// and arguments. A `MALLOC_ARENA_MAX` the user set is left as it is; when the
/// executable cannot be run again (it was replaced on disk), the process goes on with
/// glibc's default.
fn with_one_malloc_arena() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        use std::os::unix::process::CommandExt;
        const ARENAS: &str = "MALLOC_ARENA_MAX";
        if std::env::var_os(ARENAS).is_some() {
            return;
        }
        let Ok(exe) = std::env::current_exe() else {
            return;
        };
        let mut args = std::env::args_os();
        let mut command = std::process::Command::new(&exe);
        if let Some(arg0) = args.next() {
            command.arg0(arg0);
        }
        let error = command.args(args).env(ARENAS, "1").exec();
        eprintln!(
            "castellan: going on with glibc's default malloc arenas: executing {} again with {ARENAS}=1: {error}",
            exe.display()
        );
    }
}

fn main() -> anyhow::Result<()> {
    // The process' TLS provider, for clients that take it from the process (the S3
    // client's reqwest): ring, as everything else here uses. It fails only when one is
    // installed already.
    let _ = rustls::crypto::ring::default_provider().install_default();
    // kubectl runs a plugin by its file name: the same binary, linked or copied as
    // `kubectl-castellan`, is the plugin with its own command line.
    let invoked_as = std::env::args_os()
        .next()
        .map(PathBuf::from)
        .and_then(|path| path.file_name().map(|name| name.to_owned()));
    if invoked_as.as_deref() == Some(std::ffi::OsStr::new(plugin::PLUGIN_NAME)) {
        return plugin::run(plugin::PluginCli::parse().args);
    }
    let command = Cli::parse().command;
    if matches!(command, Command::Operator(_) | Command::Agent(_)) {
        with_one_malloc_arena();
    }
    match command {
        Command::Plugin(args) => plugin::run(args),
        Command::Instance(args) => {
            let _telemetry = telemetry::init(
                "castellan-instance",
                args.log.log_format,
                &[
                    ("cluster", args.cluster_name.clone()),
                    ("instance", args.instance_name.clone()),
                ],
            );
            tokio::runtime::Runtime::new()
                .context("starting the async runtime")?
                .block_on(instance::run(*args))
        }
        Command::Agent(args) => agent::run(args),
        Command::Operator(args) => {
            let _telemetry = telemetry::init("castellan-operator", args.log.log_format, &[]);
            tokio::runtime::Runtime::new()
                .context("starting the async runtime")?
                .block_on(operator::run(args))
        }
        Command::Pki(args) => pki::cli::run(args),
        Command::Upgrade(args) => std::process::exit(upgrade::main(args)),
        Command::WalArchive { socket, file } => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the async runtime")?
            .block_on(instance::archive::request(&socket, &file)),
        Command::WalRestore { socket, file, dest } => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the async runtime")?
            .block_on(instance::archive::request_restore(&socket, &file, &dest)),
        Command::Crds { out_dir } => write_crds(out_dir),
        Command::Version => {
            println!(
                "castellan {VERSION} (API {}/{})",
                castellan_crds::GROUP,
                castellan_crds::VERSION
            );
            Ok(())
        }
    }
}

fn write_crds(out_dir: Option<PathBuf>) -> anyhow::Result<()> {
    use castellan_crds::render;
    let mut documents = Vec::new();
    for crd in render::all() {
        let name = render::file_name(&crd);
        let yaml = render::to_yaml(&crd).with_context(|| format!("rendering {name}"))?;
        match &out_dir {
            Some(dir) => {
                let path = dir.join(&name);
                std::fs::write(&path, &yaml)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            None => documents.push(yaml),
        }
    }
    if out_dir.is_none() {
        print!("{}", documents.join("---\n"));
    }
    Ok(())
}

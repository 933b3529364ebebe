//! Castellan: the processes the architecture describes (operator, agent, instance
//! manager) and the tools around them, as the subcommands of the `castellan` binary
//! ([`main`]). The operator and the agent also have a binary each ([`role_main`]),
//! which `castellan operator` and `castellan agent` execute when it is installed beside
//! them: a process maps only its own role's code.
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Parser, Subcommand};

mod agent;
mod api_client;
mod cadence;
mod events;
mod exposition;
mod heap;
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

/// The processes that have a binary of their own, `castellan-<role>`, beside
/// `castellan`.
///
/// One binary for every role maps the code of all of them: the operator touched or
/// faulted in 2.7 MiB more of the binary's pages than one linked with the operator's
/// code alone (docs/benchmarks.md, Scale). `castellan operator` and `castellan agent`
/// therefore execute the role's binary when it is installed beside `castellan` (the
/// images and `cargo build` put it there), so that the chart, the images' entrypoint and
/// every script keep one command; without it they run in this binary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Operator,
    Agent,
}

impl Role {
    /// The role's binary's file name.
    pub fn binary(self) -> &'static str {
        match self {
            Self::Operator => "castellan-operator",
            Self::Agent => "castellan-agent",
        }
    }
}

/// The binary `role` runs in when started from `exe`: the role's own binary beside it
/// when `exe` is not already that binary and it `exists`, `None` for this one.
fn role_binary(role: Role, exe: &Path, exists: impl Fn(&Path) -> bool) -> Option<PathBuf> {
    let sibling = exe.with_file_name(role.binary());
    let own = exe.file_name() == Some(std::ffi::OsStr::new(role.binary()));
    (!own && exists(&sibling)).then_some(sibling)
}

/// Executes `role`'s own binary ([`role_binary`]) with `role_args` (its arguments after
/// the subcommand), keeping the pid. Returns only when there is none to execute or the
/// execution failed (then the role runs here; the binary may have been replaced on
/// disk).
fn start_as(role: Role, role_args: Vec<std::ffi::OsString>) {
    use std::os::unix::process::CommandExt;
    let Ok(exe) = std::env::current_exe() else {
        return;
    };
    let Some(binary) = role_binary(role, &exe, |p| p.is_file()) else {
        return;
    };
    let error = std::process::Command::new(&binary).args(role_args).exec();
    eprintln!(
        "castellan: going on in this process: executing {} failed: {error}",
        binary.display()
    );
}

/// The command line of a role's own binary: the role's arguments, as after
/// `castellan <role>`.
#[derive(Parser)]
#[command(version = VERSION)]
struct OperatorCli {
    #[command(flatten)]
    args: operator::OperatorArgs,
}

#[derive(Parser)]
#[command(version = VERSION)]
struct AgentCli {
    #[command(flatten)]
    args: agent::AgentArgs,
}

/// `main` of `castellan-operator` and `castellan-agent`.
pub fn role_main(role: Role) -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    match role {
        Role::Operator => run_operator(OperatorCli::parse().args),
        Role::Agent => agent::run(AgentCli::parse().args),
    }
}

fn run_operator(args: operator::OperatorArgs) -> anyhow::Result<()> {
    let _telemetry = telemetry::init("castellan-operator", args.log.log_format, &[]);
    runtime()?.block_on(operator::run(args))
}

/// The async runtime of Castellan's long-running processes (operator, agent, instance
/// manager) and of the plugin: two workers, whatever the node's core count. Their work
/// is waiting on the network, the API server and PostgreSQL; tokio's default, one
/// worker per core, would give each of a 64-core node's instance managers 64 threads'
/// stacks and queues, and their idle wake-ups, for nothing.
pub(crate) fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// `main` of `castellan`.
pub fn main() -> anyhow::Result<()> {
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
    let role = match command {
        Command::Operator(_) => Some(Role::Operator),
        Command::Agent(_) => Some(Role::Agent),
        _ => None,
    };
    if let Some(role) = role {
        // `castellan <role> ARGS`: the subcommand is the first argument (the command
        // line has no global options).
        start_as(role, std::env::args_os().skip(2).collect());
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
            runtime()?.block_on(instance::run(*args))
        }
        Command::Agent(args) => agent::run(args),
        Command::Operator(args) => run_operator(args),
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

#[cfg(test)]
pub(crate) mod tests {
    use std::path::{Path, PathBuf};

    use super::{Role, role_binary, runtime};

    /// Set in the environment of a test binary run again by [`run_again`].
    const CHILD: &str = "CASTELLAN_TEST_CHILD";

    /// Whether this is the test binary run again by [`run_again`].
    pub(crate) fn is_run_again() -> bool {
        std::env::var_os(CHILD).is_some()
    }

    /// Runs this test binary again, the test at `path` alone, with `env` added, for what
    /// is fixed when a process starts (its allocator's options, tokio's default); the
    /// test sees [`is_run_again`]. Fails unless that one test passed.
    pub(crate) fn run_again(path: &str, env: &[(&str, &str)]) -> std::process::Output {
        let exe = std::env::current_exe().expect("the test binary's path");
        let output = std::process::Command::new(&exe)
            .args(["--exact", path])
            .envs(env.iter().copied())
            .env(CHILD, "1")
            .output()
            .unwrap_or_else(|e| panic!("running {} again: {e}", exe.display()));
        assert!(output.status.success(), "{output:?}");
        assert!(
            String::from_utf8_lossy(&output.stdout).contains("1 passed"),
            "{path} did not run: {output:?}"
        );
        output
    }

    #[test]
    fn the_runtime_has_two_workers_whatever_the_cores() {
        let workers = |runtime: tokio::runtime::Runtime| runtime.metrics().num_workers();
        if is_run_again() {
            // Run by this test, with tokio's default set to 7 workers, as a 7-core
            // machine would have it.
            let default = tokio::runtime::Runtime::new().expect("tokio's default runtime");
            assert_eq!(workers(default), 7, "TOKIO_WORKER_THREADS is not honoured");
            assert_eq!(workers(runtime().expect("runtime")), 2);
            return;
        }
        run_again(
            "tests::the_runtime_has_two_workers_whatever_the_cores",
            &[("TOKIO_WORKER_THREADS", "7")],
        );
    }

    fn binary(exe: &str, installed: &[&str]) -> Option<PathBuf> {
        let installed: Vec<PathBuf> = installed.iter().map(PathBuf::from).collect();
        role_binary(Role::Operator, Path::new(exe), |path| {
            installed.iter().any(|p| p == path)
        })
    }

    #[test]
    fn the_full_binary_hands_a_role_to_its_binary_beside_it() {
        assert_eq!(
            binary(
                "/usr/local/bin/castellan",
                &["/usr/local/bin/castellan-operator"]
            )
            .as_deref(),
            Some(Path::new("/usr/local/bin/castellan-operator"))
        );
    }

    #[test]
    fn without_the_role_binary_the_role_runs_in_the_full_one() {
        // Another directory's role binary does not count: only the one beside it.
        assert_eq!(
            binary("/opt/castellan", &["/usr/local/bin/castellan-operator"]),
            None
        );
    }

    #[test]
    fn the_role_binary_does_not_execute_itself() {
        assert_eq!(
            binary(
                "/usr/local/bin/castellan-operator",
                &["/usr/local/bin/castellan-operator"]
            ),
            None
        );
    }
}

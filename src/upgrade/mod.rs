//! `castellan upgrade`: the instance side of a PostgreSQL major upgrade, run by the
//! operator in a pod (`<cluster>-upgrade`) on the stopped primary's volume.
//!
//! - `export` (init container, OLD image): copies the old installation into a shared
//!   directory (`export`).
//! - `run` (main container, NEW image): pre-flight, initdb and `pg_upgrade` into
//!   `pgdata-next`, then swaps it in and keeps the old cluster as `pgdata-previous`
//!   (`shell`, deciding with `layout` and `preflight`).
//! - `rollback` puts `pgdata-previous` back; `forget-previous` removes it when the
//!   rollback window ends.
//!
//! Each ends with one JSON line on stdout, the last of the pod's log (`report`), and
//! exits 0 only when it did what it was asked. Each can be run again after being
//! killed at any point: it resumes, or cleans up and starts over, and never removes
//! the live data directory. docs/upgrade-pod.md has the whole contract.

mod export;
pub mod layout;
mod libraries;
pub mod preflight;
pub mod report;
mod shell;

use std::path::PathBuf;
use std::time::Instant;

use tracing::Instrument;

use crate::instance::bootstrap::Binaries;
use layout::Layout;
use report::{Outcome, Report};

pub use shell::ANALYZE_MARKER;

/// `castellan upgrade …`
#[derive(Debug, clap::Args)]
pub struct UpgradeArgs {
    #[command(subcommand)]
    command: UpgradeCommand,
}

#[derive(Debug, clap::Subcommand)]
enum UpgradeCommand {
    /// Copy this image's PostgreSQL installation into DIR (absolute paths kept under
    /// it) and write DIR/bindir naming the copied bin directory.
    Export {
        /// The shared directory (the upgrade pod's `/old`).
        #[arg(long)]
        to: PathBuf,
        /// The installation's bin directory; default: where `postgres` is on PATH.
        #[arg(long, env = "PG_BIN_DIR")]
        pg_bin_dir: Option<PathBuf>,
    },
    /// Upgrade DATA/pgdata from major FROM to TO with pg_upgrade, keeping the old
    /// cluster as DATA/pgdata-previous.
    Run {
        /// The volume's mount directory, which holds `pgdata`.
        #[arg(long)]
        data: PathBuf,
        /// The file `export` wrote (an absolute path in it is used as is, a relative
        /// one from the file's directory).
        #[arg(long)]
        old_bindir_file: PathBuf,
        #[arg(long)]
        from: String,
        #[arg(long)]
        to: String,
        /// The `postgres` superuser's password, for the new cluster's initdb.
        #[arg(long, env = "CASTELLAN_SUPERUSER_PASSWORD_FILE")]
        superuser_password_file: PathBuf,
        /// The new binaries' directory; default: PATH.
        #[arg(long, env = "PG_BIN_DIR")]
        pg_bin_dir: Option<PathBuf>,
    },
    /// Put DATA/pgdata-previous (major TO) back in place of DATA/pgdata (major FROM);
    /// what was written under FROM is lost.
    Rollback {
        #[arg(long)]
        data: PathBuf,
        /// The major `pgdata` holds now (the upgrade's target).
        #[arg(long)]
        from: String,
        /// The major to go back to (`pgdata-previous`'s).
        #[arg(long)]
        to: String,
    },
    /// Remove DATA/pgdata-previous: the rollback window ended.
    ForgetPrevious {
        #[arg(long)]
        data: PathBuf,
    },
}

impl UpgradeCommand {
    fn name(&self) -> &'static str {
        match self {
            UpgradeCommand::Export { .. } => "export",
            UpgradeCommand::Run { .. } => "run",
            UpgradeCommand::Rollback { .. } => "rollback",
            UpgradeCommand::ForgetPrevious { .. } => "forget-previous",
        }
    }
}

/// Runs the subcommand, prints its report as the last line of stdout and returns the
/// exit code: 0 only when it succeeded.
pub fn main(args: UpgradeArgs) -> i32 {
    let started = Instant::now();
    let step = args.command.name();
    let report = {
        // Dropped (traces flushed, which may print) before the report is printed.
        let _telemetry =
            crate::telemetry::init("castellan-upgrade", crate::telemetry::LogFormat::Json, &[]);
        let report = match tokio::runtime::Runtime::new() {
            Ok(runtime) => {
                let span = tracing::info_span!("upgrade", step);
                // A panic is a bug, but the operator still gets its line.
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    runtime.block_on(execute(args.command, started).instrument(span))
                }))
                .unwrap_or_else(|_| {
                    Report::new(
                        Outcome::Failed,
                        None,
                        started.elapsed(),
                        format!("castellan upgrade {step} panicked (a bug; its message is above)"),
                    )
                })
            }
            Err(error) => Report::new(
                Outcome::Failed,
                None,
                started.elapsed(),
                format!("starting the async runtime: {error}"),
            ),
        };
        if report.succeeded() {
            tracing::info!(outcome = ?report.outcome, message = %report.message, seconds = report.seconds, "upgrade {step} finished");
        } else {
            tracing::error!(message = %report.message, seconds = report.seconds, "upgrade {step} failed");
        }
        report
    };
    println!("{}", report.line());
    if report.succeeded() { 0 } else { 1 }
}

async fn execute(command: UpgradeCommand, started: Instant) -> Report {
    let failed = |method, error: anyhow::Error| {
        Report::new(
            Outcome::Failed,
            method,
            started.elapsed(),
            format!("{error:#}"),
        )
    };
    match command {
        UpgradeCommand::Export { to, pg_bin_dir } => {
            match export::export(&to, pg_bin_dir.as_deref()).await {
                Ok(message) => Report::new(Outcome::Exported, None, started.elapsed(), message),
                Err(error) => failed(
                    None,
                    error.context("exporting the old PostgreSQL installation"),
                ),
            }
        }
        UpgradeCommand::Run {
            data,
            old_bindir_file,
            from,
            to,
            superuser_password_file,
            pg_bin_dir,
        } => {
            let layout = Layout::new(&data);
            let binaries = Binaries {
                bin_dir: pg_bin_dir,
            };
            let settings = shell::RunSettings {
                layout: &layout,
                old_bindir_file: &old_bindir_file,
                from: &from,
                to: &to,
                superuser_password_file: &superuser_password_file,
                binaries: &binaries,
            };
            match shell::upgrade(&settings, started).await {
                Ok(report) => report,
                Err(failure) => failed(
                    failure.method,
                    failure.error.context(format!(
                        "upgrading {} from PostgreSQL {from} to {to}",
                        layout.live().display()
                    )),
                ),
            }
        }
        UpgradeCommand::Rollback { data, from, to } => {
            let layout = Layout::new(&data);
            shell::rollback(&layout, &from, &to, started)
                .await
                .unwrap_or_else(|error| {
                    failed(
                        None,
                        error.context(format!(
                            "rolling {} back from PostgreSQL {from} to {to}",
                            layout.live().display()
                        )),
                    )
                })
        }
        UpgradeCommand::ForgetPrevious { data } => {
            let layout = Layout::new(&data);
            shell::forget_previous(&layout, started)
                .await
                .unwrap_or_else(|error| {
                    failed(
                        None,
                        error.context(format!("removing {}", layout.previous().display())),
                    )
                })
        }
    }
}

//! The acting half of `upgrade run`, `rollback` and `forget-previous`: looks at the
//! volume, lets `layout` and `preflight` decide, and carries it out with PostgreSQL's
//! programs, renames and fsyncs. Every step is logged; an error says what was being
//! done to what.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail};

use super::layout::{Holds, Layout, RollbackPlan, Seen, UpgradePlan, forget_refusal};
use super::layout::{plan_rollback, plan_upgrade};
use super::libraries::{self, LIBRARIES_DIR, PROGRAMS_DIR};
use super::preflight;
use super::report::{Method, Outcome, Record, Report};
use crate::instance::bootstrap::{self, Binaries, BootstrapError};
use crate::instance::private_dir;

/// The marker `upgrade run` leaves in the new data directory: the instance manager
/// analyzes the databases after the first start (`instance::analyze`).
pub const ANALYZE_MARKER: &str = "castellan-analyze";

/// What `upgrade run` needs.
pub struct RunSettings<'a> {
    pub layout: &'a Layout,
    /// The file `upgrade export` wrote, naming the old binaries' directory.
    pub old_bindir_file: &'a Path,
    pub from: &'a str,
    pub to: &'a str,
    pub superuser_password_file: &'a Path,
    /// The new binaries.
    pub binaries: &'a Binaries,
}

/// A failure, with the method when it was chosen already.
pub struct Failure {
    pub method: Option<Method>,
    pub error: anyhow::Error,
}

impl From<anyhow::Error> for Failure {
    fn from(error: anyhow::Error) -> Self {
        Self {
            method: None,
            error,
        }
    }
}

/// `upgrade run`: see `layout` for the states it resumes from.
pub async fn upgrade(settings: &RunSettings<'_>, started: Instant) -> Result<Report, Failure> {
    let layout = settings.layout;
    let (from, to) = (settings.from, settings.to);
    let seen = look(layout).await?;
    let plan = plan_upgrade(&seen, from, to);
    tracing::info!(?seen, ?plan, from, to, "upgrade: looked at the volume");
    let record = match plan {
        UpgradePlan::Refuse(reason) => return Err(anyhow::anyhow!(reason).into()),
        UpgradePlan::Done => {
            tracing::info!("upgrade: already done; reporting it again");
            finish(layout, None).await?
        }
        UpgradePlan::FinishSwap => {
            tracing::info!("upgrade: a run stopped between the renames; finishing the swap");
            let record = read_record(&layout.complete()).await?;
            if seen.live == Holds::Empty {
                remove(&layout.live()).await?;
            }
            rename(&layout.next(), &layout.live()).await?;
            sync_dir(layout.root()).await?;
            finish(layout, Some(record)).await?
        }
        UpgradePlan::Upgrade { leftover_next } => {
            if leftover_next {
                tracing::info!(next = %layout.next().display(), "upgrade: removing what a stopped run left");
                remove_next(layout).await?;
            }
            let method = build(settings, started).await?;
            swap(layout).await.map_err(|error| Failure {
                method: Some(method),
                error,
            })?;
            finish(layout, None).await.map_err(|error| Failure {
                method: Some(method),
                error,
            })?
        }
    };
    let how = record.as_ref().map_or_else(String::new, |record| {
        format!(
            " with pg_upgrade {} in {:.1} s",
            record.method.flag(),
            record.seconds
        )
    });
    Ok(Report::new(
        Outcome::Upgraded,
        record.map(|record| record.method),
        started.elapsed(),
        format!(
            "pgdata holds PostgreSQL {to}, upgraded from {from}{how}; the {from} data \
             directory is kept as pgdata-previous for a rollback"
        ),
    ))
}

/// Pre-flight, initdb and pg_upgrade into `pgdata-next`, marked complete at the end.
/// On a failure `pgdata-next` is removed again and `pgdata` was never written to.
async fn build(settings: &RunSettings<'_>, started: Instant) -> Result<Method, Failure> {
    let layout = settings.layout;
    let (live, next) = (layout.live(), layout.next());
    let (from, to) = (settings.from, settings.to);
    if live.join("standby.signal").exists() {
        return Err(anyhow::anyhow!(
            "{} holds a standby's data (standby.signal): upgrade the primary's volume",
            live.display()
        )
        .into());
    }
    let old_programs = old_programs(settings.old_bindir_file).await?;
    let old = Binaries {
        bin_dir: Some(old_programs.clone()),
    };
    check_binaries(&old, "old", from).await?;
    // A primary whose lease ended while no operator renewed it (one being replaced,
    // say) was stopped at once, not cleanly: crash recovery, as its own server would
    // run at its next start, brings it to the clean shutdown pg_upgrade needs. A
    // standby's data was refused above.
    let recovered = bootstrap::finish_crash_recovery(&old, &live)
        .await
        .with_context(|| format!("running crash recovery on {}", live.display()))?;
    if recovered {
        tracing::info!(data = %live.display(), "upgrade: the old cluster was not shut down cleanly; crash recovery ran first");
    }
    let report = bootstrap::controldata(&old, &live)
        .await
        .with_context(|| format!("reading the control file of {}", live.display()))?;
    let control = preflight::read_control(&report).map_err(|reason| {
        anyhow::anyhow!("reading the control file of {}: {reason}", live.display())
    })?;
    if let Some(reason) = preflight::shutdown_refusal(&control) {
        return Err(anyhow::anyhow!("{reason}; nothing was changed").into());
    }
    let (logical, unreadable) = slots(&live).await?;
    if let Some(reason) = preflight::logical_slots_refusal(from, &logical, &unreadable) {
        return Err(anyhow::anyhow!("{reason}; nothing was changed").into());
    }
    check_binaries(settings.binaries, "new", to).await?;
    let method = choose_method(layout).await?;
    tracing::info!(
        ?method,
        checksums = control.checksum_version,
        "upgrade: pre-flight passed"
    );
    let failed = |error: anyhow::Error| Failure {
        method: Some(method),
        error,
    };
    let result = build_next(settings, &old_programs, method, &control).await;
    if let Err(error) = result {
        // pgdata-next is only ever made again; pgdata was only read.
        if let Err(cleanup) = remove_next(layout).await {
            tracing::error!(error = %format!("{cleanup:#}"), "removing the failed pgdata-next");
        }
        return Err(failed(error));
    }
    let record = Record {
        from: from.to_owned(),
        to: to.to_owned(),
        method,
        seconds: Report::new(Outcome::Upgraded, None, started.elapsed(), "").seconds,
        finished_at: None,
        rolled_back_at: None,
    };
    write_record(&layout.complete(), &record)
        .await
        .map_err(failed)?;
    sync_dir(layout.root()).await.map_err(failed)?;
    tracing::info!(next = %next.display(), "upgrade: pgdata-next is complete");
    Ok(method)
}

async fn build_next(
    settings: &RunSettings<'_>,
    old_programs: &Path,
    method: Method,
    control: &preflight::Control,
) -> anyhow::Result<()> {
    let layout = settings.layout;
    let next = layout.next();
    let checksums = preflight::checksums_for(control, settings.to);
    tracing::info!(next = %next.display(), ?checksums, "upgrade: initdb of the new cluster");
    bootstrap::create_cluster(
        settings.binaries,
        &next,
        settings.superuser_password_file,
        checksums,
    )
    .await
    .with_context(|| {
        format!(
            "running initdb of PostgreSQL {} in {}",
            settings.to,
            next.display()
        )
    })?;
    let sockets = layout.sockets();
    private_dir(&sockets).await?;
    let outcome = async {
        for check in [true, false] {
            tracing::info!(check, method = method.flag(), "upgrade: running pg_upgrade");
            pg_upgrade(settings, old_programs, method, check).await?;
        }
        anyhow::Ok(())
    }
    .await;
    let _ = tokio::fs::remove_dir_all(&sockets).await;
    outcome?;
    // What the instance manager's initdb makes too: castellan.conf, written at the
    // first start, wins over the defaults. Only now: during pg_upgrade the new
    // directory must not say `ssl = on` (the dev nodes' 18 tools are built without
    // OpenSSL, docs/operations.md).
    bootstrap::include_castellan_conf(&next)
        .await
        .with_context(|| format!("including castellan.conf in {}", next.display()))?;
    let script = layout.root().join("delete_old_cluster.sh");
    match tokio::fs::remove_file(&script).await {
        Ok(()) => {}
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => {
            return Err(error).with_context(|| format!("removing {}", script.display()));
        }
    }
    let extensions = layout.root().join("update_extensions.sql");
    if let Ok(sql) = tokio::fs::read_to_string(&extensions).await {
        tracing::warn!(file = %extensions.display(), %sql, "pg_upgrade says extensions need ALTER EXTENSION … UPDATE after the upgrade");
    }
    let marker = next.join(ANALYZE_MARKER);
    bootstrap::write_private(&marker, "")
        .await
        .with_context(|| format!("writing {}", marker.display()))?;
    Ok(())
}

/// Runs pg_upgrade (with `--check` first), in the volume's directory (it writes
/// `delete_old_cluster.sh` into its working directory), with its sockets on the
/// volume.
///
/// Without `-B`: pg_upgrade's default new bindir is its own (symlinks resolved), the
/// only one certain to hold programs of exactly its version (on the dev nodes' 18 the
/// server beside the tools is another minor: docs/operations.md).
async fn pg_upgrade(
    settings: &RunSettings<'_>,
    old_bindir: &Path,
    method: Method,
    check: bool,
) -> anyhow::Result<()> {
    let layout = settings.layout;
    let (live, next, sockets) = (layout.live(), layout.next(), layout.sockets());
    let (old_bindir, live_s, next_s, sockets_s) = (
        old_bindir.to_string_lossy(),
        live.to_string_lossy(),
        next.to_string_lossy(),
        sockets.to_string_lossy(),
    );
    let jobs = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .to_string();
    let mut args = vec![
        "--old-bindir",
        &*old_bindir,
        "--old-datadir",
        &*live_s,
        "--new-datadir",
        &*next_s,
        "--username",
        "postgres",
        "--socketdir",
        &*sockets_s,
        "--jobs",
        &*jobs,
        // The old server as pg_upgrade starts it: without TLS (the certificates are
        // the instance's, not the upgrade pod's), without archiving (nothing listens
        // on the instance manager's archive socket), without waiting for standbys, and
        // without JIT (export left out the JIT provider's LLVM, libraries::is_jit_provider),
        // and logging to pg_upgrade's files, not into the instance manager's log pipes
        // (nobody reads them here: the collector would wait on them forever).
        "--old-options",
        "-c ssl=off -c archive_mode=off -c synchronous_standby_names='' -c jit=off -c logging_collector=off",
        method.flag(),
    ];
    if check {
        args.push("--check");
    }
    match settings
        .binaries
        .run_in(layout.root(), "pg_upgrade", &args, &[])
        .await
    {
        Ok(output) => {
            tracing::info!(output = %tail(&output, 3), check, "pg_upgrade finished");
            Ok(())
        }
        Err(BootstrapError::Failed { stdout, stderr, .. }) => {
            let logs = pg_upgrade_logs(&next).await;
            bail!(
                "pg_upgrade{} from PostgreSQL {} ({}) to {} ({}) failed, pgdata is unchanged: {}{}",
                if check { " --check" } else { "" },
                settings.from,
                live.display(),
                settings.to,
                next.display(),
                complaint(&format!("{stdout}\n{stderr}"), 12),
                logs
            )
        }
        Err(error) => Err(error).context("running pg_upgrade"),
    }
}

/// What pg_upgrade left in `pgdata-next/pg_upgrade_output.d` after a failure, for the
/// error (it is removed with pgdata-next): the reports its checks wrote (`*.txt`:
/// which databases and tables use what), and the errors in its servers' and dumps'
/// logs (its own log repeats what it printed).
async fn pg_upgrade_logs(next: &Path) -> String {
    let mut files = Vec::new();
    let mut dirs = vec![next.join("pg_upgrade_output.d")];
    while let Some(dir) = dirs.pop() {
        let Ok(mut entries) = tokio::fs::read_dir(&dir).await else {
            continue;
        };
        while let Ok(Some(entry)) = entries.next_entry().await {
            let path = entry.path();
            if entry.file_type().await.is_ok_and(|t| t.is_dir()) {
                dirs.push(path);
            } else {
                files.push(path);
            }
        }
    }
    files.sort();
    let mut said = String::new();
    for file in files {
        let name = file.file_name().unwrap_or_default().to_string_lossy();
        let Ok(text) = tokio::fs::read_to_string(&file).await else {
            continue;
        };
        let kept = if name.ends_with(".txt") {
            tail(&text, 10)
        } else if name == "pg_upgrade_server.log" || name.starts_with("pg_upgrade_dump_") {
            let errors: String = text
                .lines()
                .filter(|line| {
                    ["FATAL", "ERROR", "error:"]
                        .iter()
                        .any(|tag| line.contains(tag))
                })
                .collect::<Vec<_>>()
                .join("\n");
            tail(&errors, 3)
        } else {
            continue;
        };
        if !kept.is_empty() {
            said.push_str(&format!(" [{name}: {kept}]"));
        }
    }
    said
}

/// What pg_upgrade printed, without the checks that passed: its last `lines` lines
/// that say something.
fn complaint(output: &str, lines: usize) -> String {
    let said: String = output
        .lines()
        .filter(|line| !line.trim_end().ends_with(" ok"))
        .collect::<Vec<_>>()
        .join("\n");
    tail(&said, lines)
}

/// The last `lines` non-empty lines of `text`, joined with " | ".
fn tail(text: &str, lines: usize) -> String {
    let kept: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .collect();
    kept[kept.len().saturating_sub(lines)..].join(" | ")
}

/// Renames `pgdata` to `pgdata-previous` and `pgdata-next` to `pgdata`, each synced.
async fn swap(layout: &Layout) -> anyhow::Result<()> {
    tracing::info!("upgrade: pgdata → pgdata-previous, pgdata-next → pgdata");
    rename(&layout.live(), &layout.previous()).await?;
    sync_dir(layout.root()).await?;
    rename(&layout.next(), &layout.live()).await?;
    sync_dir(layout.root()).await
}

/// Writes `upgrade.json` (from the completion marker, or the record already there)
/// and removes the marker. Returns the record (none when neither is there: an upgrade
/// done, whose record someone removed).
async fn finish(layout: &Layout, record: Option<Record>) -> anyhow::Result<Option<Record>> {
    let marker = layout.complete();
    let record = match record {
        Some(record) => Some(record),
        None if marker.exists() => Some(read_record(&marker).await?),
        None => None,
    };
    let record = match record {
        Some(mut record) => {
            record.finished_at = Some(jiff::Timestamp::now().to_string());
            write_record(&layout.record(), &record).await?;
            Some(record)
        }
        None => read_record(&layout.record()).await.ok(),
    };
    remove(&marker).await?;
    sync_dir(layout.root()).await?;
    Ok(record)
}

/// `upgrade rollback`.
pub async fn rollback(
    layout: &Layout,
    from: &str,
    to: &str,
    started: Instant,
) -> anyhow::Result<Report> {
    let seen = look(layout).await?;
    let plan = plan_rollback(&seen, from, to);
    tracing::info!(?seen, ?plan, from, to, "rollback: looked at the volume");
    match plan {
        RollbackPlan::Refuse(reason) => bail!(reason),
        RollbackPlan::Done => tracing::info!("rollback: already done; reporting it again"),
        RollbackPlan::Swap { live_present } => {
            // A stopped upgrade's pgdata-next must never be swapped in after this: the
            // old server will write to pgdata from now on.
            remove_next(layout).await?;
            if live_present {
                tracing::info!("rollback: pgdata → pgdata-rolled-back");
                rename(&layout.live(), &layout.rolled_back()).await?;
            } else if seen.live == Holds::Empty {
                remove(&layout.live()).await?;
            }
            tracing::info!("rollback: pgdata-previous → pgdata");
            rename(&layout.previous(), &layout.live()).await?;
            sync_dir(layout.root()).await?;
            if let Ok(mut record) = read_record(&layout.record()).await {
                record.rolled_back_at = Some(jiff::Timestamp::now().to_string());
                write_record(&layout.record(), &record).await?;
            }
        }
    }
    remove_next(layout).await?;
    remove(&layout.rolled_back()).await?;
    sync_dir(layout.root()).await?;
    Ok(Report::new(
        Outcome::RolledBack,
        None,
        started.elapsed(),
        format!(
            "pgdata holds PostgreSQL {to} again, as it was before the upgrade to {from}; \
             what was written under {from} is gone"
        ),
    ))
}

/// `upgrade forget-previous`.
pub async fn forget_previous(layout: &Layout, started: Instant) -> anyhow::Result<Report> {
    let seen = look(layout).await?;
    if let Some(reason) = forget_refusal(&seen) {
        bail!(reason);
    }
    let previous = layout.previous();
    let message = if seen.previous == Holds::Missing {
        "there is no pgdata-previous (forgotten already)".to_owned()
    } else {
        tracing::info!(previous = %previous.display(), "removing the previous data directory");
        remove(&previous).await?;
        sync_dir(layout.root()).await?;
        "removed pgdata-previous: a rollback is no longer possible".to_owned()
    };
    Ok(Report::new(
        Outcome::Forgotten,
        None,
        started.elapsed(),
        message,
    ))
}

/// What the directories of the volume hold.
/// The logical replication slots in `data`'s `pg_replslot`, and the slots whose kind
/// could not be read.
async fn slots(data: &Path) -> anyhow::Result<(Vec<String>, Vec<String>)> {
    let dir = data.join("pg_replslot");
    let (mut logical, mut unreadable) = (Vec::new(), Vec::new());
    let mut entries = match tokio::fs::read_dir(&dir).await {
        Ok(entries) => entries,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            return Ok((logical, unreadable));
        }
        Err(error) => return Err(error).with_context(|| format!("listing {}", dir.display())),
    };
    while let Some(entry) = entries
        .next_entry()
        .await
        .with_context(|| format!("listing {}", dir.display()))?
    {
        let name = entry.file_name().to_string_lossy().into_owned();
        match tokio::fs::read(entry.path().join("state")).await {
            Ok(state) => match preflight::is_logical_slot(&state) {
                Some(true) => logical.push(name),
                Some(false) => {}
                None => unreadable.push(name),
            },
            // A slot being made or dropped when the server stopped (no state file).
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(_) => unreadable.push(name),
        }
    }
    logical.sort();
    unreadable.sort();
    Ok((logical, unreadable))
}

async fn look(layout: &Layout) -> anyhow::Result<Seen> {
    Ok(Seen {
        live: holds(&layout.live()).await?,
        next: holds(&layout.next()).await?,
        next_complete: layout.complete().exists(),
        previous: holds(&layout.previous()).await?,
    })
}

async fn holds(dir: &Path) -> anyhow::Result<Holds> {
    let mut entries = match tokio::fs::read_dir(dir).await {
        Ok(entries) => entries,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(Holds::Missing),
        Err(error) => return Err(error).with_context(|| format!("listing {}", dir.display())),
    };
    match tokio::fs::read_to_string(dir.join("PG_VERSION")).await {
        Ok(version) => Ok(Holds::Major(version.trim().to_owned())),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            let first = entries
                .next_entry()
                .await
                .with_context(|| format!("listing {}", dir.display()))?;
            Ok(if first.is_none() {
                Holds::Empty
            } else {
                Holds::Other
            })
        }
        Err(error) => Err(error).with_context(|| format!("reading {}/PG_VERSION", dir.display())),
    }
}

/// The old binaries' directory from the file `upgrade export` wrote: an absolute path,
/// or one relative to the file's own directory.
async fn old_bindir(file: &Path) -> anyhow::Result<PathBuf> {
    let named = tokio::fs::read_to_string(file).await.with_context(|| {
        format!(
            "reading the old binaries' directory from {}",
            file.display()
        )
    })?;
    let named = named.trim();
    if named.is_empty() {
        bail!(
            "{} names no directory (is the export complete?)",
            file.display()
        );
    }
    let dir = file.parent().unwrap_or(Path::new("/")).join(named);
    if !dir.join("postgres").is_file() {
        bail!(
            "the old binaries' directory {} (named in {}) has no postgres: did `castellan \
             upgrade export` run in the old image into this directory?",
            dir.display(),
            file.display()
        );
    }
    Ok(dir)
}

/// The old programs as this container runs them: the directory of scripts
/// (`DIR/programs`, beside the bindir file) that run each program `export` copied with
/// the libraries it copied (`DIR/lib`) on its library path. It is the old bindir for
/// this process and for pg_upgrade, which passes its environment on to every program it
/// starts, the new ones too; so the old libraries are named in the scripts only.
async fn old_programs(file: &Path) -> anyhow::Result<PathBuf> {
    let bin_dir = old_bindir(file).await?;
    let dir = file.parent().unwrap_or(Path::new("/"));
    let (libraries, programs) = (dir.join(LIBRARIES_DIR), dir.join(PROGRAMS_DIR));
    let written = programs.clone();
    let count =
        tokio::task::spawn_blocking(move || libraries::wrap(&bin_dir, &libraries, &written))
            .await
            .context("writing the old programs' scripts")??;
    tracing::info!(count, programs = %programs.display(), "upgrade: the old programs run with their own image's libraries");
    Ok(programs)
}

/// Refuses binaries of another major than `expected` (or none at all).
async fn check_binaries(binaries: &Binaries, role: &str, expected: &str) -> anyhow::Result<()> {
    let where_ = binaries
        .bin_dir
        .as_ref()
        .map_or_else(|| "PATH".to_owned(), |dir| dir.display().to_string());
    let output = binaries
        .run("postgres", &["--version"], &[])
        .await
        .with_context(|| {
            format!("running the {role} binaries' postgres --version (from {where_})")
        })?;
    if let Some(reason) = preflight::binaries_refusal(role, &output, expected) {
        bail!("{reason} (from {where_}); nothing was changed");
    }
    Ok(())
}

/// `--clone` on btrfs, else `--copy` when the space allows it.
async fn choose_method(layout: &Layout) -> anyhow::Result<Method> {
    let root = layout.root().to_path_buf();
    let live = layout.live();
    tokio::task::spawn_blocking(move || -> anyhow::Result<Method> {
        let stat = nix::sys::statfs::statfs(&root)
            .with_context(|| format!("asking which filesystem {} is (statfs)", root.display()))?;
        // f_type's width differs between platforms; the magic fits in either.
        #[allow(clippy::useless_conversion, clippy::unnecessary_cast)]
        let magic = stat.filesystem_type().0 as i64;
        let method = preflight::method_for(magic);
        if method == Method::Copy {
            let data = disk_usage(&live)?;
            let space = nix::sys::statvfs::statvfs(&root).with_context(|| {
                format!("asking how much space {} has (statvfs)", root.display())
            })?;
            // Both are 64-bit on Linux (fsblkcnt_t, unsigned long).
            let free = space
                .blocks_available()
                .saturating_mul(space.fragment_size());
            tracing::info!(
                data_bytes = data,
                free_bytes = free,
                "upgrade: the volume is not btrfs; copying"
            );
            if let Some(reason) = preflight::space_refusal(data, free) {
                bail!("{reason}; nothing was changed");
            }
        }
        Ok(method)
    })
    .await
    .context("choosing how to carry the data files")?
}

/// The bytes the files under `dir` occupy (allocated blocks, as `du`).
fn disk_usage(dir: &Path) -> anyhow::Result<u64> {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0u64;
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in
            std::fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))?
        {
            let entry = entry.with_context(|| format!("listing {}", dir.display()))?;
            let meta = entry
                .metadata()
                .with_context(|| format!("inspecting {}", entry.path().display()))?;
            total = total.saturating_add(meta.blocks().saturating_mul(512));
            if meta.is_dir() {
                dirs.push(entry.path());
            }
        }
    }
    Ok(total)
}

/// Removes the completion marker, then `pgdata-next` (in that order: a marker never
/// vouches for a half-removed directory).
async fn remove_next(layout: &Layout) -> anyhow::Result<()> {
    remove(&layout.complete()).await?;
    sync_dir(layout.root()).await?;
    remove(&layout.next()).await
}

/// Removes a file or a directory tree; nothing to remove is fine.
async fn remove(path: &Path) -> anyhow::Result<()> {
    let result = match tokio::fs::symlink_metadata(path).await {
        Ok(meta) if meta.is_dir() => tokio::fs::remove_dir_all(path).await,
        Ok(_) => tokio::fs::remove_file(path).await,
        Err(error) => Err(error),
    };
    match result {
        Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
            Err(error).with_context(|| format!("removing {}", path.display()))
        }
        _ => Ok(()),
    }
}

async fn rename(from: &Path, to: &Path) -> anyhow::Result<()> {
    tokio::fs::rename(from, to)
        .await
        .with_context(|| format!("renaming {} to {}", from.display(), to.display()))
}

/// Makes the renames and files in `dir` durable.
pub(super) async fn sync_dir(dir: &Path) -> anyhow::Result<()> {
    let path = dir.to_path_buf();
    tokio::task::spawn_blocking(move || std::fs::File::open(&path)?.sync_all())
        .await
        .map_err(std::io::Error::other)
        .and_then(|synced| synced)
        .with_context(|| format!("syncing {}", dir.display()))
}

async fn read_record(path: &Path) -> anyhow::Result<Record> {
    let text = tokio::fs::read_to_string(path)
        .await
        .with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

async fn write_record(path: &Path, record: &Record) -> anyhow::Result<()> {
    let json = serde_json::to_string_pretty(record).context("serialising the upgrade record")?;
    bootstrap::write_atomically(path, &format!("{json}\n"), 0o644)
        .await
        .with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tail_keeps_the_last_lines_that_say_something() {
        assert_eq!(tail("a\n\n b \nc\n", 2), "b | c");
        assert_eq!(tail("a\n", 5), "a");
        assert_eq!(tail("", 3), "");
    }

    #[test]
    fn pg_upgrades_complaint_leaves_out_the_checks_that_passed() {
        let output = "Checking for prepared transactions                            ok\n\
                      Checking data type usage                                      failed check\n\
                      Your installation contains the \"aclitem\" data type in user tables.\n\
                      Failure, exiting\n";
        assert_eq!(
            complaint(output, 12),
            "Checking data type usage                                      failed check | \
             Your installation contains the \"aclitem\" data type in user tables. | Failure, exiting"
        );
    }
}

//! Making a data directory: `initdb` for a cluster's first instance, a base backup of
//! the current primary for every other, and the files Castellan owns inside it
//! (`castellan.conf`, `pg_hba.conf`, `standby.signal`). Runs PostgreSQL's own programs.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tokio::process::Command;

use super::config::{Role, Upstream};
use crate::instance_api::TOGETHER;

#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("running {program}: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    #[error("{program} failed ({status}): {stderr}")]
    Failed {
        program: String,
        status: std::process::ExitStatus,
        /// What it printed on stdout (pg_upgrade says why it failed there).
        stdout: String,
        stderr: String,
    },
}

/// Locates PostgreSQL's programs: in `bin_dir` when given, else on `PATH`.
#[derive(Clone, Debug)]
pub struct Binaries {
    pub bin_dir: Option<PathBuf>,
}

impl Binaries {
    pub fn program(&self, name: &str) -> PathBuf {
        match &self.bin_dir {
            Some(dir) => dir.join(name),
            None => PathBuf::from(name),
        }
    }

    /// Runs a PostgreSQL program to completion, returning its output (stdout, then
    /// stderr).
    pub async fn run(
        &self,
        name: &str,
        args: &[&str],
        env: &[(&str, &Path)],
    ) -> Result<String, BootstrapError> {
        self.run_with(None, name, args, env).await
    }

    /// [`Binaries::run`] in the working directory `cwd` (pg_upgrade writes its scripts
    /// there).
    pub(crate) async fn run_in(
        &self,
        cwd: &Path,
        name: &str,
        args: &[&str],
        env: &[(&str, &Path)],
    ) -> Result<String, BootstrapError> {
        self.run_with(Some(cwd), name, args, env).await
    }

    async fn run_with(
        &self,
        cwd: Option<&Path>,
        name: &str,
        args: &[&str],
        env: &[(&str, &Path)],
    ) -> Result<String, BootstrapError> {
        let program = self.program(name);
        let mut command = Command::new(&program);
        // Programs that connect (pg_basebackup, pg_rewind, psql) give up on a server
        // that accepts the connection but never answers (a frozen one) rather than hang.
        command
            .args(args)
            .env("PGCONNECT_TIMEOUT", "10")
            .kill_on_drop(true);
        if let Some(cwd) = cwd {
            command.current_dir(cwd);
        }
        for (key, value) in env {
            command.env(key, value);
        }
        let output = command
            .output()
            .await
            .map_err(|source| BootstrapError::Spawn {
                program: program.display().to_string(),
                source,
            })?;
        if !output.status.success() {
            return Err(BootstrapError::Failed {
                program: name.to_owned(),
                status: output.status,
                stdout: String::from_utf8_lossy(&output.stdout).trim().to_owned(),
                stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
            });
        }
        // Some programs (pg_rewind) report on stderr even when they succeed.
        Ok(format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}

pub(super) fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> BootstrapError {
    let path = path.to_path_buf();
    move |source| BootstrapError::Io { what, path, source }
}

/// Writes a file readable by the instance's user only.
pub async fn write_private(path: &Path, contents: &str) -> Result<(), BootstrapError> {
    write_atomically(path, contents, 0o600).await
}

/// Writes a file with `mode`, atomically and synced: a crash in the middle leaves the
/// old file, never half of the new one.
pub(crate) async fn write_atomically(
    path: &Path,
    contents: &str,
    mode: u32,
) -> Result<(), BootstrapError> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true).mode(mode);
    let path_buf = path.to_path_buf();
    let contents = contents.to_owned();
    // A truncated castellan.conf would stop the server from starting.
    tokio::task::spawn_blocking(move || {
        use std::io::Write;
        let mut name = path_buf.file_name().unwrap_or_default().to_os_string();
        name.push(".new");
        let temporary = path_buf.with_file_name(name);
        let mut file = options.open(&temporary)?;
        file.write_all(contents.as_bytes())?;
        file.sync_all()?;
        std::fs::rename(&temporary, &path_buf)?;
        // The rename is durable only once the directory is: a crash right after it
        // could otherwise bring back the old file, or none.
        match path_buf.parent().filter(|dir| !dir.as_os_str().is_empty()) {
            Some(dir) => std::fs::File::open(dir)?.sync_all(),
            None => Ok(()),
        }
    })
    .await
    .map_err(|join| BootstrapError::Io {
        what: "writing",
        path: path.to_path_buf(),
        source: std::io::Error::other(join),
    })?
    .map_err(io("writing", path))
}

/// PostgreSQL's own verdict on `parameters` for the server in `data_dir`: `postgres -C`
/// reads the configuration with them on its command line and fails as a start would
/// (an unknown setting, a value of the wrong type, out of range, not in the enum, or
/// one that cannot be changed), in about 30 ms, whether the server runs or not. Returns
/// PostgreSQL's reason for each refused parameter; empty when all are good.
pub async fn refused_parameters(
    binaries: &Binaries,
    data_dir: &Path,
    parameters: &BTreeMap<String, String>,
) -> Result<BTreeMap<String, String>, BootstrapError> {
    if parameters.is_empty() {
        return Ok(BTreeMap::new());
    }
    // All at once first (the usual case: all good, one run); one at a time only to
    // name the culprits.
    let Some(together) = check(binaries, data_dir, parameters.iter()).await? else {
        return Ok(BTreeMap::new());
    };
    let mut refused = BTreeMap::new();
    for (name, value) in parameters {
        if let Some(reason) = check(binaries, data_dir, [(name, value)]).await? {
            refused.insert(name.clone(), reason);
        }
    }
    if refused.is_empty() {
        // Each is good alone; together they are not (or the files are not).
        refused.insert(TOGETHER.to_owned(), together);
    }
    Ok(refused)
}

/// `postgres -C` with `parameters` on its command line: `None` when PostgreSQL takes
/// them, else its complaint.
async fn check<'a>(
    binaries: &Binaries,
    data_dir: &Path,
    parameters: impl IntoIterator<Item = (&'a String, &'a String)>,
) -> Result<Option<String>, BootstrapError> {
    let mut args: Vec<String> = vec![
        "-D".into(),
        data_dir.to_string_lossy().into_owned(),
        "-C".into(),
        "server_version".into(),
    ];
    for (name, value) in parameters {
        args.push("-c".into());
        args.push(format!("{name}={value}"));
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    match binaries.run("postgres", &args, &[]).await {
        Ok(_) => Ok(None),
        Err(BootstrapError::Failed { stderr, .. }) => Ok(Some(postgres_complaint(&stderr))),
        Err(error) => Err(error),
    }
}

/// The FATAL line of a PostgreSQL program's complaint and its HINT, without the log
/// prefix: `invalid value for parameter "work_mem": "banana"`.
fn postgres_complaint(stderr: &str) -> String {
    let mut said = Vec::new();
    for line in stderr.lines() {
        for tag in ["FATAL:", "ERROR:", "DETAIL:", "HINT:"] {
            if let Some((_, rest)) = line.split_once(tag) {
                said.push(rest.trim().to_owned());
            }
        }
    }
    if said.is_empty() {
        stderr.trim().to_owned()
    } else {
        said.join(" ")
    }
}

/// Whether `data_dir` already holds a cluster (then nothing is bootstrapped: a pod that
/// restarts on its volume keeps its data).
pub fn initialised(data_dir: &Path) -> bool {
    data_dir.join("PG_VERSION").exists()
}

/// Creates an empty cluster with data checksums (pg_rewind and upgrades rely on them)
/// and the superuser password from `superuser_password_file`.
pub async fn initdb(
    binaries: &Binaries,
    data_dir: &Path,
    superuser_password_file: &Path,
) -> Result<(), BootstrapError> {
    create_cluster(binaries, data_dir, superuser_password_file, Checksums::On).await?;
    include_castellan_conf(data_dir).await
}

/// Whether initdb turns data checksums on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Checksums {
    On,
    /// Off, said explicitly (`--no-data-checksums`, PostgreSQL 18 and later, where
    /// on is the default).
    Off,
    /// initdb's default: off before PostgreSQL 18, which has no flag to say so.
    Default,
}

/// Runs initdb as every Castellan cluster is made (the superuser `postgres` with the
/// password from `superuser_password_file`, local connections trusted, SCRAM over the
/// network, UTF8 with the C locale), without Castellan's configuration: a major
/// upgrade's new cluster (`crate::upgrade`) must be made the same way, or pg_upgrade
/// refuses it.
pub(crate) async fn create_cluster(
    binaries: &Binaries,
    data_dir: &Path,
    superuser_password_file: &Path,
    checksums: Checksums,
) -> Result<(), BootstrapError> {
    let data = data_dir.to_string_lossy();
    let pwfile = superuser_password_file.to_string_lossy();
    let mut args = vec![
        "--pgdata",
        &*data,
        "--username",
        "postgres",
        "--pwfile",
        &*pwfile,
        "--auth-local",
        "trust",
        "--auth-host",
        "scram-sha-256",
        "--encoding",
        "UTF8",
        "--locale",
        "C",
    ];
    match checksums {
        Checksums::On => args.push("--data-checksums"),
        Checksums::Off => args.push("--no-data-checksums"),
        Checksums::Default => {}
    }
    binaries.run("initdb", &args, &[]).await.map(|_| ())
}

/// Copies the current primary with `pg_basebackup`, streaming the WAL it needs, and
/// creates this replica's slot on the primary so WAL is kept for it from then on.
pub async fn base_backup(
    binaries: &Binaries,
    data_dir: &Path,
    upstream: &Upstream,
    passfile: &Path,
) -> Result<(), BootstrapError> {
    let data = data_dir.to_string_lossy();
    let connection = upstream.conninfo(passfile, None);
    let common = [
        "--pgdata",
        &*data,
        "--dbname",
        &connection,
        "--wal-method",
        "stream",
        "--checkpoint",
        "fast",
        "--no-password",
        "--slot",
        &upstream.slot,
    ];
    let mut with_create = common.to_vec();
    with_create.push("--create-slot");
    let env = [("PGPASSFILE", passfile)];
    match binaries.run("pg_basebackup", &with_create, &env).await {
        Ok(_) => {}
        // A rebuilt replica finds its slot still there: reuse it.
        Err(BootstrapError::Failed { stderr, .. }) if stderr.contains("already exists") => {
            clear_dir(data_dir).await?;
            binaries.run("pg_basebackup", &common, &env).await?;
        }
        Err(other) => return Err(other),
    }
    include_castellan_conf(data_dir).await
}

/// Empties a directory, keeping the directory itself (its owner and mode).
pub async fn clear_dir(dir: &Path) -> Result<(), BootstrapError> {
    let mut entries = tokio::fs::read_dir(dir).await.map_err(io("listing", dir))?;
    while let Some(entry) = entries.next_entry().await.map_err(io("listing", dir))? {
        let path = entry.path();
        let result = if entry
            .file_type()
            .await
            .map_err(io("inspecting", &path))?
            .is_dir()
        {
            tokio::fs::remove_dir_all(&path).await
        } else {
            tokio::fs::remove_file(&path).await
        };
        result.map_err(io("removing", &path))?;
    }
    Ok(())
}

/// Makes `postgresql.conf` include `castellan.conf` last, once.
pub(crate) async fn include_castellan_conf(data_dir: &Path) -> Result<(), BootstrapError> {
    let path = data_dir.join("postgresql.conf");
    let mut conf = tokio::fs::read_to_string(&path)
        .await
        .map_err(io("reading", &path))?;
    let include = "include_if_exists = 'castellan.conf'";
    if !conf.lines().any(|line| line.trim() == include) {
        conf.push_str("\n# Castellan's settings, last so that they win.\n");
        conf.push_str(include);
        conf.push('\n');
        tokio::fs::write(&path, conf)
            .await
            .map_err(io("writing", &path))?;
    }
    Ok(())
}

/// Writes the files Castellan owns in the data directory for the given role. A replica
/// gets `standby.signal`; a primary must not have one.
pub async fn write_role_files(
    data_dir: &Path,
    castellan_conf: &str,
    pg_hba: &str,
    role: &Role,
) -> Result<(), BootstrapError> {
    write_private(&data_dir.join("castellan.conf"), castellan_conf).await?;
    write_private(&data_dir.join("pg_hba.conf"), pg_hba).await?;
    let signal = data_dir.join("standby.signal");
    match role {
        Role::Replica(_) => write_private(&signal, "").await,
        Role::Primary => match tokio::fs::remove_file(&signal).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(BootstrapError::Io {
                what: "removing",
                path: signal,
                source: e,
            }),
        },
    }
}

/// Makes sure this replica's slot exists on its primary. Slots are not replicated, so
/// after a failover the new primary has none for the replicas that now follow it.
pub async fn ensure_slot(
    binaries: &Binaries,
    upstream: &Upstream,
    passfile: &Path,
) -> Result<(), BootstrapError> {
    let connection = upstream.conninfo(passfile, None);
    binaries
        .run(
            "pg_receivewal",
            &[
                "--create-slot",
                "--if-not-exists",
                "--slot",
                &upstream.slot,
                "--dbname",
                &connection,
                "--no-password",
            ],
            &[("PGPASSFILE", passfile)],
        )
        .await
        .map(|_| ())
}

/// The location of the last checkpoint in the control file (`pg_controldata`): for a
/// primary stopped cleanly, its shutdown checkpoint, which its standbys have received
/// once they are past it.
pub async fn checkpoint_lsn(
    binaries: &Binaries,
    data_dir: &Path,
) -> Result<Option<String>, BootstrapError> {
    control_value(binaries, data_dir, "Latest checkpoint location:").await
}

/// The timeline of the last checkpoint in the control file.
pub async fn checkpoint_timeline(
    binaries: &Binaries,
    data_dir: &Path,
) -> Result<Option<u32>, BootstrapError> {
    Ok(
        control_value(binaries, data_dir, "Latest checkpoint's TimeLineID:")
            .await?
            .and_then(|tli| tli.parse().ok()),
    )
}

/// The cluster's system identifier: the same on every instance of one cluster (base
/// backups copy it), different for every initdb.
pub async fn system_identifier(
    binaries: &Binaries,
    data_dir: &Path,
) -> Result<Option<String>, BootstrapError> {
    control_value(binaries, data_dir, "Database system identifier:").await
}

/// One line of `pg_controldata`'s report, by its label.
async fn control_value(
    binaries: &Binaries,
    data_dir: &Path,
    label: &str,
) -> Result<Option<String>, BootstrapError> {
    Ok(control_field(
        &controldata(binaries, data_dir).await?,
        label,
    ))
}

/// `pg_controldata`'s whole report on `data_dir`. It must be the pg_controldata of
/// the data directory's own major: another reads the control file as garbage.
pub(crate) async fn controldata(
    binaries: &Binaries,
    data_dir: &Path,
) -> Result<String, BootstrapError> {
    let data = data_dir.to_string_lossy();
    binaries.run("pg_controldata", &["-D", &data], &[]).await
}

/// The value of one line of a `pg_controldata` report, by its label (with the colon:
/// `Database cluster state:`).
pub(crate) fn control_field(report: &str, label: &str) -> Option<String> {
    report
        .lines()
        .find_map(|line| line.strip_prefix(label))
        .map(|value| value.trim().to_owned())
}

/// The timeline the server at `upstream` writes on, or `None` while it is not (yet) a
/// primary.
pub async fn primary_timeline(
    binaries: &Binaries,
    upstream: &Upstream,
    passfile: &Path,
) -> Result<Option<u32>, BootstrapError> {
    let output = binaries
        .run(
            "psql",
            &[
                "--no-psqlrc",
                "--tuples-only",
                "--no-align",
                "--dbname",
                &upstream.conninfo(passfile, Some("postgres")),
                "--command",
                "select case when pg_is_in_recovery() then '' \
                 else substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8) end",
            ],
            &[("PGPASSFILE", passfile)],
        )
        .await?;
    Ok(u32::from_str_radix(output.trim(), 16).ok())
}

/// Whether a data directory in `state` (`pg_controldata`'s "Database cluster state")
/// was not shut down cleanly, so that crash recovery must run before pg_rewind reads
/// it: pg_rewind's own rule.
fn needs_crash_recovery(state: &str) -> bool {
    !matches!(state, "shut down" | "shut down in recovery")
}

/// Runs crash recovery on a data directory that was not shut down cleanly (a server
/// killed, or stopped at once when its lease ended), single-user with fsync off as
/// pg_rewind does, so that it ends with a clean shutdown; says whether it ran. Only
/// while no server runs on it: the operator's pods make sure of that.
pub async fn finish_crash_recovery(
    binaries: &Binaries,
    data_dir: &Path,
) -> Result<bool, BootstrapError> {
    let state = control_value(binaries, data_dir, "Database cluster state:").await?;
    if !state.as_deref().is_some_and(needs_crash_recovery) {
        return Ok(false);
    }
    let data = data_dir.to_string_lossy();
    binaries
        .run(
            "postgres",
            &["--single", "-F", "-D", &data, "template1"],
            &[],
        )
        .await?;
    Ok(true)
}

/// Rewinds a former primary onto the new primary's timeline so it can follow it.
pub async fn rewind(
    binaries: &Binaries,
    data_dir: &Path,
    upstream: &Upstream,
    passfile: &Path,
) -> Result<String, BootstrapError> {
    let data = data_dir.to_string_lossy();
    // A former primary that crashed must finish crash recovery first. pg_rewind would
    // run it itself, with the `postgres` beside pg_rewind: where the tools and the
    // server are different builds (the dev nodes' 18: the tools have no OpenSSL and
    // refuse `ssl = on`), that server cannot start the data directory. So it runs here,
    // the same way, with the server the instance runs.
    finish_crash_recovery(binaries, data_dir).await?;
    // As the replication role, which may read what pg_rewind reads (the grants of
    // migrations/0002_rewind.sql), not as the superuser.
    let source = upstream.conninfo(passfile, Some("postgres"));
    binaries
        .run(
            "pg_rewind",
            &[
                "--target-pgdata",
                &data,
                "--source-server",
                &source,
                "--progress",
            ],
            &[("PGPASSFILE", passfile)],
        )
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_fields_are_read_by_their_label() {
        let report = "pg_control version number:            1300\n\
                      Database cluster state:               shut down\n\
                      Data page checksum version:           1\n";
        assert_eq!(
            control_field(report, "Database cluster state:").as_deref(),
            Some("shut down")
        );
        assert_eq!(
            control_field(report, "Data page checksum version:").as_deref(),
            Some("1")
        );
        assert_eq!(control_field(report, "Latest checkpoint location:"), None);
    }

    #[test]
    fn only_a_cleanly_stopped_directory_skips_crash_recovery_before_a_rewind() {
        assert!(!needs_crash_recovery("shut down"));
        assert!(!needs_crash_recovery("shut down in recovery"));
        for state in ["in production", "in crash recovery", "in archive recovery"] {
            assert!(needs_crash_recovery(state), "{state}");
        }
    }

    #[test]
    fn complaints_lose_the_log_prefix_and_keep_the_hint() {
        let stderr = "2026-12-02 05:13:05.604 GMT [12876] FATAL:  invalid value for parameter \"wal_level\": \"bogus\"\n\
                      2026-12-02 05:13:05.604 GMT [12876] HINT:  Available values: minimal, replica, logical.\n";
        assert_eq!(
            postgres_complaint(stderr),
            "invalid value for parameter \"wal_level\": \"bogus\" Available values: minimal, replica, logical."
        );
        assert_eq!(postgres_complaint("no tags here\n"), "no tags here");
    }
}

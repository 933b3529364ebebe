//! `castellan upgrade` against real PostgreSQL: Debian's 15 as the old major and the
//! composed 18 (`deploy/local/postgres.sh 18.4`) as the new one, no cluster needed.
//! Each test makes a 15 cluster the way the instance manager's initdb does (checksums
//! on, UTF8, C), loads data (pgbench at scale 2 and a table of its own), stops it, and
//! plays the operator's upgrade pod: `upgrade export` of the 15 installation into a
//! scratch `old/` (standing in for the pod's `/old`; the `bindir` file it writes names
//! the copy by its absolute path, so it is used as is), then `upgrade run` with the 18
//! programs on PATH. Everything runs as the `postgres` user (pg_upgrade and the
//! servers refuse root); the servers listen on a Unix socket only.

mod support;

use support::disks::{Loops, MIB, Unmount, run, sparse_file};
use support::postgres::postgres_ids;

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Instant;

use serde_json::Value;

const PG15: &str = "/usr/lib/postgresql/15/bin";
const PASSWORD: &str = "upgrade-secret-1";
/// The port in the socket's name; the servers listen on no TCP port.
const PORT: &str = "5432";

/// The composed PostgreSQL 18's bin directory, composed first when missing.
fn pg18() -> PathBuf {
    let out = Command::new(support::repo().join("deploy/local/postgres.sh"))
        .arg("18.4")
        .output()
        .expect("running deploy/local/postgres.sh");
    assert!(
        out.status.success(),
        "deploy/local/postgres.sh 18.4: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()).join("bin")
}

/// A scratch directory owned by `postgres`: `vol/` is the volume (what the upgrade pod
/// mounts at /var/lib/postgresql/data), `old/` the shared directory, `sock/` the
/// servers' sockets. Removed at the end.
struct Scratch {
    dir: PathBuf,
    pg18: PathBuf,
}

impl Scratch {
    fn new(name: &str) -> Self {
        // Short: unix socket paths are limited to 107 bytes.
        let dir = PathBuf::from(format!("/tmp/cu-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for sub in ["vol", "old", "sock"] {
            std::fs::create_dir_all(dir.join(sub)).expect("creating the scratch directory");
        }
        std::fs::write(dir.join("superuser"), format!("{PASSWORD}\n")).expect("password file");
        std::fs::set_permissions(
            dir.join("superuser"),
            std::fs::Permissions::from_mode(0o600),
        )
        .expect("chmod");
        let scratch = Self { dir, pg18: pg18() };
        scratch.chown(&scratch.dir);
        scratch
    }

    fn chown(&self, path: &Path) {
        let (uid, gid) = postgres_ids();
        run(
            "chown",
            &["-R", &format!("{uid}:{gid}"), &path.to_string_lossy()],
        );
    }

    fn vol(&self) -> PathBuf {
        self.dir.join("vol")
    }

    fn pgdata(&self) -> PathBuf {
        self.vol().join("pgdata")
    }

    /// Runs a program as `postgres` with `path` first on PATH.
    fn as_postgres(&self, program: &Path, args: &[&str], path: &Path) -> Output {
        let (uid, gid) = postgres_ids();
        Command::new(program)
            .args(args)
            .env_clear()
            .env("PATH", format!("{}:/usr/bin:/bin", path.display()))
            .env("RUST_LOG", "info")
            .current_dir(&self.dir)
            .uid(uid)
            .gid(gid)
            .output()
            .unwrap_or_else(|e| panic!("running {}: {e}", program.display()))
    }

    /// Runs a PostgreSQL program from `bin` to success; its stdout.
    fn pg(&self, bin: &Path, program: &str, args: &[&str]) -> String {
        let out = self.as_postgres(&bin.join(program), args, bin);
        assert!(
            out.status.success(),
            "{program} {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// A 15 cluster as the instance manager makes one, with castellan.conf saying
    /// what it says on an instance that archives (the upgrade must not depend on it).
    fn initdb15(&self) {
        let data = self.pgdata().to_string_lossy().into_owned();
        let pwfile = self.dir.join("superuser").to_string_lossy().into_owned();
        self.pg(
            Path::new(PG15),
            "initdb",
            &[
                "--pgdata",
                &data,
                "--username",
                "postgres",
                "--pwfile",
                &pwfile,
                "--auth-local",
                "trust",
                "--auth-host",
                "scram-sha-256",
                "--data-checksums",
                "--encoding",
                "UTF8",
                "--locale",
                "C",
            ],
        );
        let conf = self.pgdata().join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf).expect("postgresql.conf");
        text.push_str("\ninclude_if_exists = 'castellan.conf'\n");
        std::fs::write(&conf, text).expect("postgresql.conf");
        std::fs::write(
            self.pgdata().join("castellan.conf"),
            "archive_mode = 'always'\narchive_command = '/bin/false'\nwal_level = 'replica'\n",
        )
        .expect("castellan.conf");
        self.chown(&self.pgdata());
    }

    fn start(&self, bin: &Path) {
        let data = self.pgdata().to_string_lossy().into_owned();
        let log = self.dir.join("server.log").to_string_lossy().into_owned();
        let options = format!(
            "-c listen_addresses='' -c port={PORT} -c unix_socket_directories='{}'",
            self.dir.join("sock").display()
        );
        self.pg(
            bin,
            "pg_ctl",
            &["-D", &data, "-l", &log, "-o", &options, "-w", "start"],
        );
    }

    fn stop(&self, bin: &Path, mode: &str) {
        let data = self.pgdata().to_string_lossy().into_owned();
        self.pg(bin, "pg_ctl", &["-D", &data, "-m", mode, "-w", "stop"]);
    }

    /// One query's result, unaligned.
    fn psql(&self, bin: &Path, sql: &str) -> String {
        let sock = self.dir.join("sock").to_string_lossy().into_owned();
        self.pg(
            bin,
            "psql",
            &[
                "-X", "-qAt", "-h", &sock, "-p", PORT, "-U", "postgres", "-d", "postgres", "-c",
                sql,
            ],
        )
        .trim()
        .to_owned()
    }

    /// Loads the data: pgbench's tables at scale 2 and a table of the test's own.
    fn load(&self) {
        let sock = self.dir.join("sock").to_string_lossy().into_owned();
        self.pg(
            Path::new(PG15),
            "pgbench",
            &[
                "-i", "-s", "2", "-q", "-h", &sock, "-p", PORT, "-U", "postgres", "postgres",
            ],
        );
        self.psql(
            Path::new(PG15),
            "CREATE TABLE kept AS SELECT g AS id, md5(g::text) AS digest \
             FROM generate_series(1, 10000) g",
        );
    }

    /// What must survive: every table's row count and a digest of every row.
    fn fingerprint(&self, bin: &Path) -> String {
        self.psql(
            bin,
            "SELECT (SELECT count(*) FROM pgbench_accounts) || ' ' || \
                    (SELECT sum(abalance) + sum(aid) FROM pgbench_accounts) || ' ' || \
                    (SELECT count(*) FROM pgbench_branches) || ' ' || \
                    (SELECT count(*) FROM pgbench_tellers) || ' ' || \
                    (SELECT md5(string_agg(id || ':' || digest, ',' ORDER BY id)) FROM kept)",
        )
    }

    /// `castellan upgrade …` as postgres with `path` first on PATH: the last line of
    /// stdout as JSON, whether it succeeded, and the whole output for messages.
    fn castellan(&self, args: &[&str], path: &Path) -> (Value, bool, String) {
        let began = Instant::now();
        let out = self.as_postgres(Path::new(env!("CARGO_BIN_EXE_castellan")), args, path);
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let said = format!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
        let last = stdout.lines().last().unwrap_or_default();
        let report: Value = serde_json::from_str(last)
            .unwrap_or_else(|e| panic!("the last line of stdout is not JSON ({e}): {said}"));
        eprintln!(
            "castellan {} → {} in {:.1} s",
            args.join(" "),
            last,
            began.elapsed().as_secs_f64()
        );
        (report, out.status.success(), said)
    }

    fn export(&self) -> (Value, bool, String) {
        let old = self.dir.join("old").to_string_lossy().into_owned();
        // The old image has its programs on PATH.
        self.castellan(&["upgrade", "export", "--to", &old], Path::new(PG15))
    }

    fn bindir_file(&self) -> PathBuf {
        self.dir.join("old/bindir")
    }

    fn upgrade_with(&self, bindir_file: &Path) -> (Value, bool, String) {
        let vol = self.vol().to_string_lossy().into_owned();
        let file = bindir_file.to_string_lossy().into_owned();
        let pwfile = self.dir.join("superuser").to_string_lossy().into_owned();
        self.castellan(
            &[
                "upgrade",
                "run",
                "--data",
                &vol,
                "--old-bindir-file",
                &file,
                "--from",
                "15",
                "--to",
                "18",
                "--superuser-password-file",
                &pwfile,
            ],
            &self.pg18,
        )
    }

    fn upgrade(&self) -> (Value, bool, String) {
        self.upgrade_with(&self.bindir_file())
    }

    fn rollback(&self) -> (Value, bool, String) {
        let vol = self.vol().to_string_lossy().into_owned();
        self.castellan(
            &[
                "upgrade", "rollback", "--data", &vol, "--from", "18", "--to", "15",
            ],
            Path::new(PG15),
        )
    }

    fn forget(&self) -> (Value, bool, String) {
        let vol = self.vol().to_string_lossy().into_owned();
        self.castellan(&["upgrade", "forget-previous", "--data", &vol], &self.pg18)
    }

    fn version_of(&self, dir: &str) -> Option<String> {
        std::fs::read_to_string(self.vol().join(dir).join("PG_VERSION"))
            .ok()
            .map(|v| v.trim().to_owned())
    }

    /// A 15 cluster with data, stopped cleanly; its fingerprint.
    fn old_cluster(&self) -> String {
        self.initdb15();
        self.start(Path::new(PG15));
        self.load();
        let fingerprint = self.fingerprint(Path::new(PG15));
        self.stop(Path::new(PG15), "fast");
        fingerprint
    }

    /// The whole upgrade, then the 18 server on the result, then a rollback.
    fn upgrade_and_roll_back(&self, method: &str) {
        let before = self.old_cluster();
        let (report, ok, said) = self.export();
        assert!(ok && report["outcome"] == "exported", "{said}");
        assert!(
            self.dir.join("old/usr/share/postgresql/15").is_dir(),
            "Debian's share directory is copied under its absolute path"
        );
        let (report, ok, said) = self.export();
        assert!(
            ok && report["outcome"] == "exported",
            "export again: {said}"
        );

        let (report, ok, said) = self.upgrade();
        assert!(ok, "upgrade run failed: {said}");
        assert_eq!(report["outcome"], "upgraded", "{said}");
        assert_eq!(report["method"], method, "{said}");
        assert!(report["seconds"].as_f64().is_some(), "{report}");
        assert_eq!(self.version_of("pgdata").as_deref(), Some("18"));
        assert_eq!(self.version_of("pgdata-previous").as_deref(), Some("15"));
        assert!(!self.vol().join("pgdata-next").exists());
        assert!(!self.vol().join("pgdata-next.complete").exists());
        assert!(!self.vol().join("delete_old_cluster.sh").exists());
        assert!(
            self.pgdata().join("castellan-analyze").exists(),
            "the analyze marker"
        );
        let conf = std::fs::read_to_string(self.pgdata().join("postgresql.conf")).expect("conf");
        assert!(
            conf.contains("include_if_exists = 'castellan.conf'"),
            "{conf}"
        );
        let record: Value = serde_json::from_str(
            &std::fs::read_to_string(self.vol().join("upgrade.json")).expect("upgrade.json"),
        )
        .expect("upgrade.json is JSON");
        assert_eq!(record["from"], "15");
        assert_eq!(record["to"], "18");
        assert_eq!(record["method"], method);
        assert!(record["finishedAt"].is_string(), "{record}");

        self.start(&self.pg18);
        let version: u32 = self
            .psql(&self.pg18, "SHOW server_version_num")
            .parse()
            .expect("a number");
        assert!(version >= 180_000, "server_version_num {version}");
        assert_eq!(self.psql(&self.pg18, "SHOW data_checksums"), "on");
        assert_eq!(
            self.fingerprint(&self.pg18),
            before,
            "every row carried over"
        );
        self.psql(
            &self.pg18,
            "INSERT INTO kept VALUES (10001, 'written under 18')",
        );
        self.stop(&self.pg18, "fast");

        // Again: a no-op that reports the upgrade.
        let (report, ok, said) = self.upgrade();
        assert!(ok && report["outcome"] == "upgraded", "re-run: {said}");
        assert_eq!(report["method"], method, "{said}");
        assert_eq!(self.version_of("pgdata").as_deref(), Some("18"));

        let (report, ok, said) = self.rollback();
        assert!(ok && report["outcome"] == "rolled-back", "rollback: {said}");
        assert_eq!(self.version_of("pgdata").as_deref(), Some("15"));
        assert!(!self.vol().join("pgdata-previous").exists());
        assert!(!self.vol().join("pgdata-rolled-back").exists());
        let (report, ok, said) = self.rollback();
        assert!(
            ok && report["outcome"] == "rolled-back",
            "rollback again: {said}"
        );
        self.start(Path::new(PG15));
        assert_eq!(
            self.fingerprint(Path::new(PG15)),
            before,
            "the pre-upgrade rows, without what 18 wrote"
        );
        self.stop(Path::new(PG15), "fast");
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // A server a failed assertion left running.
        let data = self.pgdata().to_string_lossy().into_owned();
        for bin in [Path::new(PG15), self.pg18.as_path()] {
            let _ = self.as_postgres(
                &bin.join("pg_ctl"),
                &["-D", &data, "-m", "immediate", "stop"],
                bin,
            );
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn a_copy_upgrade_carries_every_row_to_18_and_rolls_back_to_15() {
    let scratch = Scratch::new("copy");
    scratch.upgrade_and_roll_back("copy");
}

#[test]
fn on_btrfs_the_upgrade_clones() {
    let mut loops = Loops::default();
    let scratch = Scratch::new("clone");
    let file = sparse_file(&scratch.dir, "btrfs.img", 1024 * MIB);
    let device = loops.attach(&file);
    run("mkfs.btrfs", &["-q", "-f", &device]);
    let unmount = Unmount {
        root: scratch.vol(),
    };
    run("mount", &[&device, &scratch.vol().to_string_lossy()]);
    scratch.chown(&scratch.vol());
    scratch.upgrade_and_roll_back("clone");
    // Unmounted before the scratch directory goes, or its mount point stays.
    drop(unmount);
    drop(scratch);
}

#[test]
fn a_failed_upgrade_leaves_pgdata_as_it_was_and_says_why() {
    let scratch = Scratch::new("fail");
    scratch.initdb15();
    scratch.start(Path::new(PG15));
    scratch.load();
    // A type whose on-disk format changed in 16: pg_upgrade --check refuses it.
    scratch.psql(
        Path::new(PG15),
        "CREATE TABLE acl_holder (a aclitem); INSERT INTO acl_holder VALUES ('postgres=r/postgres')",
    );
    let before = scratch.fingerprint(Path::new(PG15));
    scratch.stop(Path::new(PG15), "fast");
    let (report, ok, said) = scratch.export();
    assert!(ok, "{said}");
    let listing = |scratch: &Scratch| {
        let mut names: Vec<String> = std::fs::read_dir(scratch.vol())
            .expect("ls")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    assert_eq!(report["outcome"], "exported");

    // pg_upgrade --check fails: its report is in the message, pgdata-next is gone.
    let (report, ok, said) = scratch.upgrade();
    assert!(!ok, "{said}");
    assert_eq!(report["outcome"], "failed");
    let message = report["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("pg_upgrade --check") && message.contains("aclitem"),
        "{message}"
    );
    assert!(
        message.contains("acl_holder"),
        "the check's list of tables: {message}"
    );
    assert_eq!(report["method"], "copy");
    assert_eq!(listing(&scratch), vec!["pgdata"], "{said}");

    // A broken old bindir file: refused before anything is read or made, even with
    // pgdata not shut down cleanly.
    scratch.start(Path::new(PG15));
    scratch.psql(Path::new(PG15), "DROP TABLE acl_holder");
    scratch.stop(Path::new(PG15), "immediate");
    let broken = scratch.dir.join("broken-bindir");
    std::fs::write(&broken, "/nonexistent/postgresql/15/bin\n").expect("write");
    scratch.chown(&broken);
    let (report, ok, said) = scratch.upgrade_with(&broken);
    assert!(!ok, "{said}");
    let message = report["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("/nonexistent/postgresql/15/bin") && message.contains("old binaries"),
        "{message}"
    );
    assert_eq!(listing(&scratch), vec!["pgdata"]);
    assert_eq!(scratch.version_of("pgdata").as_deref(), Some("15"));

    // The data is as it was, less the table dropped on purpose.
    scratch.start(Path::new(PG15));
    let after = scratch.fingerprint(Path::new(PG15));
    assert_eq!(after, before);

    // A logical replication slot, which pg_upgrade would drop without a word from 15:
    // refused, and named.
    scratch.psql(Path::new(PG15), "ALTER SYSTEM SET wal_level = logical");
    scratch.stop(Path::new(PG15), "fast");
    scratch.start(Path::new(PG15));
    scratch.psql(
        Path::new(PG15),
        "SELECT pg_create_logical_replication_slot('shop_sub', 'pgoutput')",
    );
    scratch.stop(Path::new(PG15), "fast");
    let (report, ok, said) = scratch.upgrade();
    assert!(!ok, "{said}");
    let message = report["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("logical replication slots (shop_sub)"),
        "{message}"
    );
    assert_eq!(listing(&scratch), vec!["pgdata"]);
    scratch.start(Path::new(PG15));
    scratch.psql(
        Path::new(PG15),
        "SELECT pg_drop_replication_slot('shop_sub')",
    );

    // Not shut down cleanly (a primary stopped at once when its lease ended): crash
    // recovery runs first, then the upgrade.
    scratch.stop(Path::new(PG15), "immediate");
    let (report, ok, said) = scratch.upgrade();
    assert!(ok && report["outcome"] == "upgraded", "{said}");
    assert!(said.contains("crash recovery ran first"), "{said}");
    assert_eq!(scratch.version_of("pgdata").as_deref(), Some("18"));
}

#[test]
fn an_upgrade_stopped_between_its_renames_finishes() {
    let scratch = Scratch::new("swap");
    let before = scratch.old_cluster();
    let (_, ok, said) = scratch.export();
    assert!(ok, "{said}");
    let (_, ok, said) = scratch.upgrade();
    assert!(ok, "{said}");
    // The state after `pgdata → pgdata-previous` and before `pgdata-next → pgdata`:
    // pgdata-next complete (its marker holds the record), pgdata gone, or made empty
    // by an instance manager that started meanwhile.
    let vol = scratch.vol();
    std::fs::rename(vol.join("pgdata"), vol.join("pgdata-next")).expect("rename");
    std::fs::rename(vol.join("upgrade.json"), vol.join("pgdata-next.complete")).expect("rename");
    std::fs::create_dir(vol.join("pgdata")).expect("mkdir");
    scratch.chown(&vol);
    let (report, ok, said) = scratch.upgrade();
    assert!(ok && report["outcome"] == "upgraded", "{said}");
    assert_eq!(
        report["method"], "copy",
        "the method of the run that did it"
    );
    assert_eq!(scratch.version_of("pgdata").as_deref(), Some("18"));
    assert!(!vol.join("pgdata-next").exists() && !vol.join("pgdata-next.complete").exists());
    assert!(vol.join("upgrade.json").exists());
    scratch.start(&scratch.pg18);
    assert_eq!(scratch.fingerprint(&scratch.pg18), before);
    scratch.stop(&scratch.pg18, "fast");

    // The rollback window ends.
    let (report, ok, said) = scratch.forget();
    assert!(ok && report["outcome"] == "forgotten", "{said}");
    assert!(!vol.join("pgdata-previous").exists());
    let (report, ok, said) = scratch.forget();
    assert!(ok && report["outcome"] == "forgotten", "again: {said}");
    // Without the previous data there is nothing to roll back to.
    let (report, ok, said) = scratch.rollback();
    assert!(!ok && report["outcome"] == "failed", "{said}");
    assert_eq!(scratch.version_of("pgdata").as_deref(), Some("18"));
}

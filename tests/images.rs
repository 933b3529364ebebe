//! The container images of `make images` (deploy/images/build.sh), run for real: each
//! OCI archive is unpacked into a runtime bundle by umoci and its programs run under
//! runc, Debian's OCI runtime, in their own namespaces, as the user a pod would run
//! them as. The operator image runs `castellan` as uid 65532 and carries the agent's
//! tools and PostgreSQL 15 (today's operator runs database pods from it); each
//! instance image runs `castellan instance`, has PostgreSQL's whole tool set of the
//! right major on PATH, initialises a data directory as postgres (uid 26) and was
//! built with OpenSSL.
//!
//! The images are built from the dev-profile binary these tests come with (a release
//! build would add a cold release compile to `make test`); `make images` builds the same
//! recipe from the release binary. The Debian layers are cached, so after the first run
//! only the binary's layer is made again. A missing tool (mmdebstrap, umoci, runc) fails
//! the test: no image is ever skipped.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

use serde_json::{Value, json};
use support::disks::run;

/// uid and gid of postgres in the instance images (the operator's
/// CASTELLAN_POSTGRES_UID/GID default).
const POSTGRES_ID: u32 = 26;
/// uid the operator's Deployment runs as (deploy/operator/operator.yaml).
const OPERATOR_UID: u32 = 65532;
/// PostgreSQL's programs the instance manager runs (src/instance), and pg_upgrade.
const POSTGRES_PROGRAMS: &[&str] = &[
    "postgres",
    "initdb",
    "pg_ctl",
    "pg_isready",
    "pg_basebackup",
    "pg_receivewal",
    "pg_controldata",
    "pg_rewind",
    "pg_upgrade",
    "psql",
];

/// The archives build.sh printed, built once per test binary.
fn archives() -> &'static Vec<PathBuf> {
    static ARCHIVES: OnceLock<Vec<PathBuf>> = OnceLock::new();
    ARCHIVES.get_or_init(|| {
        let script = support::repo().join("deploy/images/build.sh");
        let output = Command::new(&script)
            .env("CASTELLAN_BINARY", env!("CARGO_BIN_EXE_castellan"))
            .output()
            .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
        assert!(
            output.status.success(),
            "{} failed: {}",
            script.display(),
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .map(PathBuf::from)
            .collect()
    })
}

/// An image unpacked into an OCI runtime bundle (rootfs and config.json) in a
/// directory of its own, removed when dropped.
struct Bundle {
    dir: PathBuf,
    /// The runtime config umoci derived from the image config (entrypoint, cmd, user,
    /// environment); each run starts from it.
    config: Value,
}

impl Bundle {
    fn unpack(image: &str) -> Self {
        let archive = archives()
            .iter()
            .find(|path| {
                path.file_name().and_then(|n| n.to_str()) == Some(&format!("{image}.oci.tar"))
            })
            .unwrap_or_else(|| panic!("build.sh printed no {image}.oci.tar: {:?}", archives()))
            .clone();
        let dir =
            std::env::temp_dir().join(format!("castellan-image-{image}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let layout = dir.join("layout");
        std::fs::create_dir_all(&layout).expect("creating the bundle directory");
        run("tar", &["-xf", path(&archive), "-C", path(&layout)]);
        let index: Value = serde_json::from_slice(
            &std::fs::read(layout.join("index.json")).expect("reading the archive's index.json"),
        )
        .expect("index.json is JSON");
        let tag = index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"]
            .as_str()
            .unwrap_or_else(|| panic!("{image}: the index names no tag: {index}"))
            .to_owned();
        let bundle = dir.join("bundle");
        run(
            "umoci",
            &[
                "unpack",
                "--image",
                &format!("{}:{tag}", path(&layout)),
                path(&bundle),
            ],
        );
        let config: Value = serde_json::from_slice(
            &std::fs::read(bundle.join("config.json")).expect("reading the bundle's config.json"),
        )
        .expect("config.json is JSON");
        Bundle { dir, config }
    }

    /// Runs `args` in a new container of this bundle as `uid:gid`, with runc, and
    /// returns what it printed (stdout, then stderr) and whether it exited 0.
    fn run(&self, uid: u32, gid: u32, args: &[&str]) -> (bool, String) {
        static RUNS: AtomicU32 = AtomicU32::new(0);
        let mut config = self.config.clone();
        config["process"]["args"] = json!(args);
        config["process"]["user"] = json!({"uid": uid, "gid": gid});
        config["process"]["terminal"] = json!(false);
        // initdb writes under /var/lib/postgresql: the rootfs is this test's own copy.
        config["root"]["readonly"] = json!(false);
        let bundle = self.dir.join("bundle");
        std::fs::write(
            bundle.join("config.json"),
            serde_json::to_vec(&config).expect("serialising config.json"),
        )
        .expect("writing config.json");
        let id = format!(
            "castellan-images-{}-{}",
            std::process::id(),
            RUNS.fetch_add(1, Ordering::Relaxed)
        );
        let state = self.dir.join("runc");
        let output = Command::new("runc")
            .args([
                "--root",
                path(&state),
                "run",
                "--bundle",
                path(&bundle),
                &id,
            ])
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "running runc (Debian's package runc; deploy/local/deps.sh installs it): {e}"
                )
            });
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        (output.status.success(), text)
    }

    /// Like `run`, failing the test unless the command succeeded; returns its output.
    fn run_ok(&self, uid: u32, gid: u32, args: &[&str]) -> String {
        let (ok, text) = self.run(uid, gid, args);
        assert!(
            ok,
            "{} as {uid}:{gid} failed in the container: {text}",
            args.join(" ")
        );
        text
    }

    /// The image's entrypoint and cmd, as the runtime would start them.
    fn default_args(&self) -> Vec<String> {
        serde_json::from_value(self.config["process"]["args"].clone())
            .expect("process.args is a list of strings")
    }

    fn default_user(&self) -> (u64, u64) {
        let user = &self.config["process"]["user"];
        (
            user["uid"].as_u64().unwrap_or(0),
            user["gid"].as_u64().unwrap_or(0),
        )
    }
}

impl Drop for Bundle {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn path(p: &Path) -> &str {
    p.to_str().expect("temporary paths are UTF-8")
}

#[test]
fn operator_image_runs_castellan_as_the_operator_and_has_the_agents_tools() {
    let image = Bundle::unpack("castellan");
    assert_eq!(image.default_args(), ["/usr/local/bin/castellan"]);

    let version = image.run_ok(
        OPERATOR_UID,
        OPERATOR_UID,
        &["/usr/local/bin/castellan", "version"],
    );
    assert!(
        version.starts_with(&format!("castellan {} ", env!("CARGO_PKG_VERSION"))),
        "castellan version in the image printed: {version}"
    );
    let id = image.run_ok(OPERATOR_UID, OPERATOR_UID, &["id"]);
    assert!(
        id.starts_with("uid=65532(nonroot) gid=65532(nonroot)"),
        "the operator's uid has a name in the image: {id}"
    );
    for subcommand in ["operator", "agent"] {
        let help = image.run_ok(
            OPERATOR_UID,
            OPERATOR_UID,
            &["/usr/local/bin/castellan", subcommand, "--help"],
        );
        assert!(
            help.contains("Usage: castellan"),
            "castellan {subcommand} --help: {help}"
        );
    }

    // The agent runs these as root (privileged) on the host's disks: each must be
    // there and start (its libraries present), printing its version.
    for (tool, says) in [
        ("btrfs", "btrfs-progs v"),
        ("mkfs.btrfs", "mkfs.btrfs, part of btrfs-progs v"),
        ("blkid", "blkid from util-linux"),
        ("lsblk", "lsblk from util-linux"),
        ("wipefs", "wipefs from util-linux"),
        ("nsenter", "nsenter from util-linux"),
        ("mount", "mount from util-linux"),
        ("umount", "umount from util-linux"),
    ] {
        let out = image.run_ok(0, 0, &[tool, "--version"]);
        assert!(
            out.contains(says),
            "{tool} --version in the image printed: {out}"
        );
    }

    // Today's operator starts database pods from this image at its own tag
    // (src/operator/build.rs): PostgreSQL 15 is on its PATH.
    runs_postgresql(&image, "castellan", "15");
}

#[test]
fn postgresql_15_image_initialises_a_cluster_as_postgres_with_openssl() {
    instance_image("pg15", "15");
}

#[test]
fn postgresql_18_image_initialises_a_cluster_as_postgres_with_openssl() {
    instance_image("pg18", "18");
}

fn instance_image(name: &str, major: &str) {
    let image = Bundle::unpack(name);
    assert_eq!(
        image.default_args(),
        ["/usr/local/bin/castellan", "instance"]
    );
    assert_eq!(
        image.default_user(),
        (u64::from(POSTGRES_ID), u64::from(POSTGRES_ID)),
        "{name} runs as postgres by default"
    );
    runs_postgresql(&image, name, major);
}

/// What a database pod needs of an image, run as postgres the way the operator's pods
/// run: `castellan instance`, PostgreSQL `major`'s programs on PATH, initdb, OpenSSL.
fn runs_postgresql(image: &Bundle, name: &str, major: &str) {
    let (id, gid) = (POSTGRES_ID, POSTGRES_ID);
    let help = image.run_ok(id, gid, &["/usr/local/bin/castellan", "instance", "--help"]);
    assert!(
        help.contains("Usage: castellan instance"),
        "castellan instance --help in {name}: {help}"
    );

    let version = image.run_ok(id, gid, &["postgres", "--version"]);
    assert!(
        version.starts_with(&format!("postgres (PostgreSQL) {major}.")),
        "postgres --version in {name}: {version}"
    );
    for program in POSTGRES_PROGRAMS {
        let found = image.run_ok(id, gid, &["sh", "-c", &format!("command -v {program}")]);
        assert!(
            found.trim() == format!("/usr/lib/postgresql/{major}/bin/{program}"),
            "{program} on PATH in {name}: {found}"
        );
    }

    // initdb as the instance manager calls it (src/instance/bootstrap.rs), as uid 26,
    // into the home the image gives postgres; then the server reads its configuration
    // and says which TLS library it was built with ("" without one).
    let data = "/var/lib/postgresql/data";
    let script = format!(
        "set -e; id; echo secret >/tmp/pw; \
         initdb --pgdata {data} --username postgres --pwfile /tmp/pw --auth-local trust \
         --auth-host scram-sha-256 --data-checksums --encoding UTF8 --locale C >/dev/null; \
         stat -c 'owner %u:%g' {data}/PG_VERSION; echo \"major $(cat {data}/PG_VERSION)\"; \
         echo \"ssl_library $(postgres -D {data} -C ssl_library)\""
    );
    let out = image.run_ok(id, gid, &["sh", "-c", &script]);
    assert!(
        out.starts_with("uid=26(postgres) gid=26(postgres)"),
        "id in {name}: {out}"
    );
    assert!(
        out.contains("owner 26:26"),
        "the data directory belongs to postgres in {name}: {out}"
    );
    assert!(
        out.contains(&format!("major {major}\n")),
        "initdb made a {major} cluster in {name}: {out}"
    );
    assert!(
        out.contains("ssl_library OpenSSL\n"),
        "{name} was built with OpenSSL: {out}"
    );
}

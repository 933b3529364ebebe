//! The container images of `make images` (deploy/images/build.sh), run for real: each
//! OCI archive is unpacked into a runtime bundle by umoci and its programs run under
//! runc, Debian's OCI runtime, in their own namespaces, as the user a pod would run
//! them as. The operator image runs `castellan` as uid 65532 and carries the agent's
//! tools and PostgreSQL 15 (today's operator runs database pods from it); each
//! instance image runs `castellan instance`, has PostgreSQL's whole tool set of the
//! right major on PATH, initialises a data directory as postgres (uid 26) and was
//! built with OpenSSL. And a major upgrade runs as the upgrade pod runs it: `upgrade
//! export` in the 15 image (bookworm), `upgrade run` in the 18 image (forky) on the same
//! volume, the 18 server on the result.
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
        // Tests run side by side, two of them on one image: a directory each.
        static UNPACKED: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "castellan-image-{image}-{}-{}",
            std::process::id(),
            UNPACKED.fetch_add(1, Ordering::Relaxed)
        ));
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

    /// Runs `args` in a new container of this bundle as `uid:gid`, with runc, host
    /// directories bind-mounted (read-write) at the paths paired with them as a pod's
    /// volumes, and returns what it printed (stdout, then stderr) and whether it exited 0.
    fn run_mounted(
        &self,
        uid: u32,
        gid: u32,
        args: &[&str],
        mounts: &[(&Path, &str)],
    ) -> (bool, String) {
        static RUNS: AtomicU32 = AtomicU32::new(0);
        let mut config = self.config.clone();
        if let Some(list) = config["mounts"].as_array_mut() {
            for (source, destination) in mounts {
                list.push(json!({
                    "destination": destination,
                    "type": "bind",
                    "source": path(source),
                    "options": ["rbind", "rw"],
                }));
            }
        }
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

    /// Like `run_mounted` without volumes, failing the test unless the command
    /// succeeded; returns its output.
    fn run_ok(&self, uid: u32, gid: u32, args: &[&str]) -> String {
        self.run_mounted_ok(uid, gid, args, &[])
    }

    fn run_mounted_ok(
        &self,
        uid: u32,
        gid: u32,
        args: &[&str],
        mounts: &[(&Path, &str)],
    ) -> String {
        let (ok, text) = self.run_mounted(uid, gid, args, mounts);
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
            help.contains(&format!("Usage: castellan {subcommand}")),
            "castellan {subcommand} --help: {help}"
        );
        // The role's own binary, which `castellan <role>` executes, is beside it and runs
        // with the same options.
        let binary = format!("/usr/local/bin/castellan-{subcommand}");
        let own = image.run_ok(OPERATOR_UID, OPERATOR_UID, &[&binary, "--help"]);
        assert!(
            own.contains(&format!("Usage: castellan-{subcommand}")) && own.contains("--log-format"),
            "{binary} --help: {own}"
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

/// A major upgrade as the upgrade pod runs it, in the real images: bookworm's 15
/// initialises and fills a cluster on a volume, `castellan upgrade export` in the 15
/// image copies its installation into a directory both containers mount at /old,
/// `castellan upgrade run` in forky's 18 image runs pg_upgrade there with the old
/// programs, and the 18 server starts on the result with the rows intact. The 18 image
/// lacks the libraries bookworm's 15 links (libicu72, libxml2.so.2, libldap-2.5 …): the
/// old programs run with the ones `export` copied, and with nothing else.
#[test]
fn postgresql_15_data_is_upgraded_to_18_across_the_images() {
    let started = std::time::Instant::now();
    let (old, new) = (Bundle::unpack("pg15"), Bundle::unpack("pg18"));
    let scratch = Scratch::new("upgrade");
    let (volume, shared) = (scratch.0.join("volume"), scratch.0.join("old"));
    for dir in [&volume, &shared] {
        std::fs::create_dir_all(dir).expect("creating the pod's volumes");
        std::os::unix::fs::chown(dir, Some(POSTGRES_ID), Some(POSTGRES_ID))
            .expect("chown to postgres");
    }
    let mount = "/var/lib/postgresql/data";
    let mounts = [(volume.as_path(), mount), (shared.as_path(), "/old")];
    let (id, gid) = (POSTGRES_ID, POSTGRES_ID);
    let pgdata = format!("{mount}/pgdata");
    // A server on a socket only, its rows counted, then stopped cleanly (the operator
    // stops the primary with a fast shutdown before the upgrade pod runs).
    let with_server = |sql: &str| {
        format!(
            "set -e; \
             pg_ctl --pgdata {pgdata} --wait --silent --log /tmp/server.log \
             --options \"-c listen_addresses='' -c unix_socket_directories=/tmp\" start; \
             psql --host /tmp --username postgres --dbname postgres --no-psqlrc --quiet \
             --tuples-only --no-align --set ON_ERROR_STOP=1 --command \"{sql}\"; \
             pg_ctl --pgdata {pgdata} --wait --silent --mode fast stop"
        )
    };
    let rows = "SELECT count(*), sum(id), current_setting('server_version_num') FROM orders";
    // The 15 of this image (15.20-0+deb12u1) stores an attribute option `pg_attver=<n>`
    // on every column made by DDL, which 18.6's pg_dump carries into the new cluster and
    // its server refuses (`unrecognized parameter "pg_attver"`; RESET does not remove
    // it): an incompatibility of these two builds, not of the libraries this test is
    // about. Removed from the table by hand until it is dealt with (docs/upgrade-pod.md).
    const PG_ATTVER: &str =
        "UPDATE pg_attribute SET attoptions = NULL WHERE attrelid = 'orders'::regclass;";

    // The 15 cluster, as the instance manager's initdb makes it.
    let script = format!(
        "set -e; echo secret >/tmp/pw; \
         initdb --pgdata {pgdata} --username postgres --pwfile /tmp/pw --auth-local trust \
         --auth-host scram-sha-256 --data-checksums --encoding UTF8 --locale C >/dev/null; {}",
        with_server(&format!(
            "CREATE TABLE orders AS SELECT g AS id, md5(g::text) AS note \
             FROM generate_series(1, 10000) AS g; {PG_ATTVER} {rows}"
        ))
    );
    let before = old.run_mounted_ok(id, gid, &["sh", "-c", &script], &mounts);
    assert!(
        before
            .lines()
            .any(|line| line.starts_with("10000|50005000|15")),
        "the 15 cluster's rows: {before}"
    );

    // The init container: the old image's installation and its libraries into /old.
    let said = old.run_mounted_ok(
        id,
        gid,
        &[
            "/usr/local/bin/castellan",
            "upgrade",
            "export",
            "--to",
            "/old",
        ],
        &mounts,
    );
    let exported = report(&said);
    assert_eq!(exported["outcome"], "exported", "{said}");
    eprintln!("export: {}", exported["message"]);
    assert!(
        shared.join("lib/libicuuc.so.72").is_file(),
        "bookworm's ICU is among the copied libraries: {said}"
    );
    assert!(
        !shared.join("lib/libc.so.6").exists(),
        "glibc's own libraries are the new image's"
    );

    // What the export's libraries are for: the copied postgres does not start in the 18
    // image on that image's libraries.
    let (ok, said) = new.run_mounted(
        id,
        gid,
        &["/old/usr/lib/postgresql/15/bin/postgres", "--version"],
        &mounts,
    );
    assert!(
        !ok && said.contains("error while loading shared libraries"),
        "bookworm's postgres in the forky image without its libraries: {said}"
    );

    // The main container: pg_upgrade in the new image.
    let said = new.run_mounted_ok(
        id,
        gid,
        &[
            "sh",
            "-c",
            "echo secret >/tmp/pw && exec /usr/local/bin/castellan upgrade run \
             --data /var/lib/postgresql/data --old-bindir-file /old/bindir --from 15 --to 18 \
             --superuser-password-file /tmp/pw",
        ],
        &mounts,
    );
    let outcome = report(&said);
    assert_eq!(outcome["outcome"], "upgraded", "{said}");
    assert_eq!(
        outcome["method"], "copy",
        "the scratch volume is not btrfs: {said}"
    );

    // The instance on the new image: PostgreSQL 18 with the same rows.
    let after = new.run_mounted_ok(id, gid, &["sh", "-c", &with_server(rows)], &mounts);
    let line = after
        .lines()
        .find(|line| line.starts_with("10000|50005000|"))
        .unwrap_or_else(|| panic!("the upgraded cluster's rows: {after}"));
    let version: u32 = line
        .rsplit('|')
        .next()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("server_version_num in {line}"));
    assert!(version >= 180_000, "server_version_num {version}");
    eprintln!(
        "15 → 18 across the images in {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

/// The report `castellan upgrade` printed: its last line of JSON.
fn report(output: &str) -> Value {
    output
        .lines()
        .rev()
        .find_map(|line| {
            serde_json::from_str::<Value>(line)
                .ok()
                // The report, not a JSON log line (which has a level, and may name the
                // outcome too).
                .filter(|v| v.get("outcome").is_some() && v.get("level").is_none())
        })
        .unwrap_or_else(|| panic!("no report in: {output}"))
}

/// A scratch directory of the host, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("castellan-images-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

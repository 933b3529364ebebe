//! The instance manager against real PostgreSQL servers: a primary made by initdb and a
//! replica made by a base backup, streaming; status, sync quorum, parameter reloads
//! and restarts, heartbeat lag, promotion and demotion with pg_rewind; the primary
//! lease (no server without it, stopped when it ends), fencing, and an empty volume
//! that is never initialised again; and an API that only the operator may call. Runs
//! `castellan instance` as the `postgres` user (PostgreSQL refuses root) on loopback
//! addresses of its own, with certificates made by `castellan pki` (the code the
//! operator issues them with), playing the operator's part (lease renewals, promotion,
//! demotion) with curl.

mod support;

use support::eventually;
use support::postgres::{connect, pg_bin_dir, postgres_ids};

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;
use sqlx::ConnectOptions;
use sqlx::postgres::PgConnectOptions;

const SUPERUSER_PASSWORD: &str = "super-secret-1";
const REPLICATION_PASSWORD: &str = "repl-secret-2";
const APP_PASSWORD: &str = "app-secret-3";
const ROTATED_APP_PASSWORD: &str = "app-secret-4";

/// The cluster and namespace the test instances' certificate is issued for.
const SERVER_NAME: &str = "it.test.instance.castellan.io";

/// Runs `castellan pki` (CA and certificates as files, as the operator makes them).
fn pki(args: &[&str]) {
    let output = Command::new(env!("CARGO_BIN_EXE_castellan"))
        .arg("pki")
        .args(args)
        .output()
        .expect("running castellan pki");
    assert!(
        output.status.success(),
        "castellan pki {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A scratch directory owned by `postgres`, removed at the end, with a CA (`ca/`), the
/// instances' certificate (`tls/`, as in the cluster's Secret) and the operator's
/// (`operator/`).
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        // Short: unix socket paths are limited to 107 bytes.
        let dir = PathBuf::from(format!("/tmp/ci-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("creating the scratch directory");
        let (uid, gid) = postgres_ids();
        for (file, secret) in [
            ("superuser", SUPERUSER_PASSWORD),
            ("replication", REPLICATION_PASSWORD),
            ("app", APP_PASSWORD),
        ] {
            let path = dir.join(file);
            std::fs::write(&path, format!("{secret}\n")).expect("writing a secret file");
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        }
        let at = |sub: &str| dir.join(sub).display().to_string();
        pki(&["ca", "--out", &at("ca")]);
        // The certificates of the instance API and of PostgreSQL, as the pods mount
        // <cluster>-instance-tls, -server-tls and -replication-tls: the instances serve
        // TLS and replicas stream with their client certificate, as in a cluster.
        for (kind, out) in [
            ("instance", "tls"),
            ("postgres", "server-tls"),
            ("replication", "replication-tls"),
        ] {
            pki(&[
                kind,
                "--ca",
                &at("ca"),
                "--cluster",
                "it",
                "--namespace",
                "test",
                "--out",
                &at(out),
            ]);
        }
        pki(&["operator", "--ca", &at("ca"), "--out", &at("operator")]);
        chown_tree(&dir, uid, gid);
        Self(dir)
    }
}

fn chown_tree(dir: &Path, uid: u32, gid: u32) {
    let status = Command::new("chown")
        .arg("-R")
        .arg(format!("{uid}:{gid}"))
        .arg(dir)
        .status()
        .expect("chown");
    assert!(status.success());
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running `castellan instance`; killed (with its server) when dropped.
struct Instance {
    name: String,
    data_dir: PathBuf,
    address: String,
    child: Option<Child>,
    log: PathBuf,
    /// The operator's certificate, which calls are made with.
    operator: PathBuf,
}

impl Instance {
    fn start(scratch: &Scratch, name: &str, address: &str, replica_of: Option<&str>) -> Self {
        Self::start_with(scratch, name, address, replica_of, "{}")
    }

    /// Starts on an empty volume as a primary that may not run initdb (a cluster that
    /// already had data), following `upstream` once demoted.
    fn start_without_initdb(scratch: &Scratch, name: &str, address: &str, upstream: &str) -> Self {
        Self::launch(
            scratch,
            name,
            address,
            "{}",
            &[
                "--role",
                "primary",
                "--allow-initdb",
                "false",
                "--upstream-host",
                upstream,
            ],
        )
    }

    /// Starts with the cluster's server parameters, as the operator passes them.
    fn start_with(
        scratch: &Scratch,
        name: &str,
        address: &str,
        replica_of: Option<&str>,
        parameters: &str,
    ) -> Self {
        match replica_of {
            Some(primary) => Self::launch(
                scratch,
                name,
                address,
                parameters,
                &["--role", "replica", "--upstream-host", primary],
            ),
            None => Self::launch(
                scratch,
                name,
                address,
                parameters,
                &["--role", "primary", "--allow-initdb", "true"],
            ),
        }
    }

    fn launch(
        scratch: &Scratch,
        name: &str,
        address: &str,
        parameters: &str,
        role_args: &[&str],
    ) -> Self {
        let (uid, gid) = postgres_ids();
        let dir = scratch.0.join(name);
        std::fs::create_dir_all(&dir).expect("instance directory");
        chown_tree(&dir, uid, gid);
        let log = scratch.0.join(format!("{name}.log"));
        let log_file = std::fs::File::create(&log).expect("log file");
        let mut command = Command::new(env!("CARGO_BIN_EXE_castellan"));
        command
            .arg("instance")
            .args(["--cluster-name", "it", "--instance-name", name])
            .arg("--data-dir")
            .arg(dir.join("pgdata"))
            .args([
                "--listen-address",
                address,
                "--port",
                "5432",
                "--http-port",
                "8000",
            ])
            .arg("--pg-bin-dir")
            .arg(pg_bin_dir())
            .arg("--superuser-password-file")
            .arg(scratch.0.join("superuser"))
            // These tests read and write as the superuser over TCP.
            .args(["--superuser-access", "true"])
            .arg("--replication-password-file")
            .arg(scratch.0.join("replication"))
            .arg("--app-password-file")
            .arg(scratch.0.join("app"))
            .arg("--tls-cert-file")
            .arg(scratch.0.join("tls/tls.crt"))
            .arg("--tls-key-file")
            .arg(scratch.0.join("tls/tls.key"))
            .arg("--tls-ca-file")
            .arg(scratch.0.join("tls/ca.crt"))
            .args(["--probe-port", "8001"])
            .arg("--server-tls-dir")
            .arg(scratch.0.join("server-tls"))
            .arg("--replication-tls-dir")
            .arg(scratch.0.join("replication-tls"))
            .args(["--upstream-server-name", "it-rw.test.svc"])
            .args([
                "--app-database",
                "shop",
                "--app-owner",
                "shop",
                "--parameters",
                parameters,
            ])
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("RUST_LOG", "info")
            .stdout(log_file.try_clone().expect("log file"))
            .stderr(log_file)
            .uid(uid)
            .gid(gid)
            .process_group(0);
        command.args(role_args);
        let child = command.spawn().expect("starting castellan instance");
        Self {
            name: name.to_owned(),
            data_dir: dir.join("pgdata"),
            address: address.to_owned(),
            child: Some(child),
            log,
            operator: scratch.0.join("operator"),
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// curl's arguments for a call to the API over TLS with the client certificate in
    /// `client` (a directory with tls.crt and tls.key), or none; the instance is
    /// verified as the cluster's, at its IP.
    fn tls_args(&self, client: Option<&Path>, path: &str) -> Vec<String> {
        let mut args = vec![
            "--cacert".to_owned(),
            self.operator.join("ca.crt").display().to_string(),
            "--resolve".to_owned(),
            format!("{SERVER_NAME}:8000:{}", self.address),
        ];
        if let Some(client) = client {
            args.extend([
                "--cert".to_owned(),
                client.join("tls.crt").display().to_string(),
                "--key".to_owned(),
                client.join("tls.key").display().to_string(),
            ]);
        }
        args.push(format!("https://{SERVER_NAME}:8000{path}"));
        args
    }

    /// GET as the operator.
    fn get(&self, path: &str) -> (u16, Value) {
        let args = self.tls_args(Some(&self.operator), path);
        let mut all = vec!["-s", "-w", "\n%{http_code}"];
        all.extend(args.iter().map(String::as_str));
        curl(&all)
    }

    /// POST as the operator.
    fn post(&self, path: &str, body: &str) -> (u16, Value) {
        self.post_as(Some(&self.operator), path, body)
    }

    /// POST with the client certificate in `client`, or none.
    fn post_as(&self, client: Option<&Path>, path: &str, body: &str) -> (u16, Value) {
        let args = self.tls_args(client, path);
        let mut all = vec![
            "-s",
            "-w",
            "\n%{http_code}",
            "-X",
            "POST",
            "-H",
            "content-type: application/json",
            "-d",
            body,
        ];
        all.extend(args.iter().map(String::as_str));
        curl(&all)
    }

    /// A plain-HTTP request to the probe port, as the kubelet makes them.
    fn probe(&self, method: &str, path: &str) -> (u16, Value) {
        curl(&[
            "-s",
            "-w",
            "\n%{http_code}",
            "-X",
            method,
            &format!("http://{}:8001{path}", self.address),
        ])
    }

    /// Renews this instance's primary lease every second, as the operator does, until
    /// the returned keeper is dropped.
    fn keep_lease(&self) -> LeaseKeeper {
        let stop = Arc::new(AtomicBool::new(false));
        let target = self.tls_args(Some(&self.operator), "/lease");
        let stopped = stop.clone();
        std::thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                let body = lease(4000);
                let mut args = vec![
                    "-s",
                    "-w",
                    "\n%{http_code}",
                    "-X",
                    "POST",
                    "-H",
                    "content-type: application/json",
                    "-d",
                    &body,
                ];
                args.extend(target.iter().map(String::as_str));
                let _ = curl(&args);
                std::thread::sleep(Duration::from_secs(1));
            }
        });
        LeaseKeeper(stop)
    }

    /// A former primary that came back: waits until it holds primary data and runs no
    /// server for want of a lease, demotes it, and waits until it serves as a replica.
    async fn demote_former_primary(&self) -> Value {
        eventually(
            "the former primary waits for a lease",
            Duration::from_secs(30),
            || async {
                let (_, status) = self.get("/status");
                if status["role"] == "primary"
                    && status["ready"] == false
                    && status.get("server").is_none()
                {
                    Ok(())
                } else {
                    Err(status.to_string())
                }
            },
        )
        .await;
        let (code, demoted) = self.post("/demote", "{}");
        assert_eq!(code, 200, "{demoted}");
        let body = self.wait_ready(Duration::from_secs(60));
        assert_eq!(body["role"], "replica", "{body}");
        body
    }

    /// Waits for the readiness probe to pass, then returns the instance's status.
    fn wait_ready(&self, timeout: Duration) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let (code, body) = self.probe("GET", "/readyz");
            if code == 200 {
                let (code, status) = self.get("/status");
                assert_eq!(code, 200, "{} answers the operator: {status}", self.name);
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "{} not ready within {timeout:?}: {body}\n{}",
                self.name,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// SIGTERM, as the kubelet sends: the manager stops PostgreSQL and exits 0.
    fn terminate(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("running");
        let _ = Command::new("kill")
            .args(["-s", "TERM", "--", &child.id().to_string()])
            .status();
        child.wait().expect("waiting for castellan instance")
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        // Politely first: the manager stops its server. Then by force, including the
        // server, which runs in a session of its own (the postmaster calls setsid).
        let pid = child.id().to_string();
        let _ = Command::new("kill")
            .args(["-s", "TERM", "--", &pid])
            .status();
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline && matches!(child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = Command::new("kill")
            .args(["-s", "KILL", "--", &pid])
            .stderr(Stdio::null())
            .status();
        let _ = child.wait();
        let postmaster_pid =
            std::fs::read_to_string(self.data_dir.join("postmaster.pid")).unwrap_or_default();
        if let Some(postmaster) = postmaster_pid
            .lines()
            .next()
            .filter(|line| !line.is_empty())
        {
            let _ = Command::new("kill")
                .args(["-s", "KILL", "--", postmaster])
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// Stops renewing a lease when dropped.
struct LeaseKeeper(Arc<AtomicBool>);

impl Drop for LeaseKeeper {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// A lease grant of `millis` from now, as JSON.
fn lease(millis: u64) -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64;
    format!(
        r#"{{"validUntilMs": {}, "durationMs": {millis}}}"#,
        now + millis
    )
}

fn curl(args: &[&str]) -> (u16, Value) {
    let out = Command::new("curl")
        .args(["--max-time", "10"])
        .args(args)
        .stderr(Stdio::null())
        .output()
        .expect("running curl");
    let text = String::from_utf8_lossy(&out.stdout);
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (
        code.trim().parse().unwrap_or(0),
        serde_json::from_str(body).unwrap_or(Value::Null),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn primary_and_replica_stream_report_and_promote() {
    let scratch = Scratch::new("inst");
    let primary = Instance::start(&scratch, "it-1", "127.0.50.1", None);
    // Without a lease the primary's server does not start.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, status) = primary.get("/status");
        if status["role"] == "primary" {
            assert_eq!(
                status["ready"], false,
                "no server without a lease: {status}"
            );
            assert!(status.get("server").is_none(), "{status}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "initdb within 60s:\n{}",
            primary.log()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    let primary_lease = primary.keep_lease();
    let body = primary.wait_ready(Duration::from_secs(60));
    assert_eq!(body["role"], "primary", "{body}");
    assert_eq!(body["server"]["inRecovery"], false);
    assert!(body["leaseRemainingMs"].as_u64().is_some(), "{body}");
    assert!(
        body["server"]["serverVersion"]
            .as_str()
            .unwrap_or_default()
            .starts_with("15"),
        "{body}"
    );

    // The application's role and database exist, with the password from its file.
    let mut app = connect("127.0.50.1", "shop", APP_PASSWORD, "shop").await;
    sqlx::query("create table orders (id int primary key, item text)")
        .execute(&mut app)
        .await
        .expect("create table");
    sqlx::query("insert into orders values (1, 'before the replica')")
        .execute(&mut app)
        .await
        .expect("insert");
    // Castellan's schema is installed by its migrator.
    let mut superuser = connect("127.0.50.1", "postgres", SUPERUSER_PASSWORD, "postgres").await;
    let migrated: i64 = sqlx::query_scalar("select count(*) from _sqlx_migrations where success")
        .fetch_one(&mut superuser)
        .await
        .expect("reading migrations");
    assert_eq!(migrated, 2, "both of migrations/ applied");
    // Over TCP a wrong password is refused.
    let wrong = PgConnectOptions::new()
        .host("127.0.50.1")
        .username("shop")
        .password("nope")
        .database("shop")
        .connect()
        .await;
    assert!(wrong.is_err(), "a wrong password is refused");

    let mut replica = Instance::start(&scratch, "it-2", "127.0.50.2", Some("127.0.50.1"));
    let body = replica.wait_ready(Duration::from_secs(60));
    assert_eq!(body["role"], "replica", "{body}");
    assert_eq!(body["server"]["inRecovery"], true);

    // Rows written before and after the base backup arrive on the replica.
    sqlx::query("insert into orders values (2, 'after the replica')")
        .execute(&mut app)
        .await
        .expect("insert");
    let mut on_replica = connect("127.0.50.2", "shop", APP_PASSWORD, "shop").await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while sqlx::query_scalar::<_, i64>("select count(*) from orders")
        .fetch_one(&mut on_replica)
        .await
        .unwrap_or(0)
        != 2
    {
        assert!(Instant::now() < deadline, "both rows replicate within 10s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The primary reports the standby streaming from its slot; the replica reports its
    // lag in seconds from the heartbeat.
    eventually(
        "the primary sees its streaming standby and the replica its lag",
        Duration::from_secs(10),
        || async {
            let (_, status) = primary.get("/status");
            let (_, replica_status) = replica.get("/status");
            let streaming = status["server"]["standbys"][0]["name"] == "it-2"
                && status["server"]["standbys"][0]["state"] == "streaming"
                && replica_status["server"]["streaming"] == true
                && replica_status["server"]["lagSeconds"]
                    .as_f64()
                    .is_some_and(|lag| lag < 5.0);
            if streaming {
                Ok(())
            } else {
                Err(format!("primary: {status}; replica: {replica_status}"))
            }
        },
    )
    .await;
    let slot: Option<bool> = sqlx::query_scalar(
        "select active from pg_replication_slots where slot_name = 'castellan_it_2'",
    )
    .fetch_optional(&mut superuser)
    .await
    .expect("reading slots");
    assert_eq!(slot, Some(true), "the replica streams from its own slot");

    // Replication runs over TLS, authenticated by the replication role's client
    // certificate (pg_hba's `cert` for it), and the clients' connections are TLS.
    let (ssl, client_dn): (bool, Option<String>) = sqlx::query_as(
        "select ssl.ssl, ssl.client_dn from pg_stat_ssl ssl \
         join pg_stat_replication r using (pid) where r.application_name = 'it-2'",
    )
    .fetch_one(&mut superuser)
    .await
    .expect("reading the standby's connection");
    assert!(ssl, "the standby streams over TLS");
    assert!(
        client_dn
            .as_deref()
            .is_some_and(|dn| dn.contains("CN=streaming_replica")),
        "with the replication certificate: {client_dn:?}"
    );
    let own_ssl: bool =
        sqlx::query_scalar("select ssl from pg_stat_ssl where pid = pg_backend_pid()")
            .fetch_one(&mut superuser)
            .await
            .expect("reading this connection");
    assert!(own_ssl, "clients connect over TLS");
    // Plain TCP is refused (spec.tls.allowPlaintext is off), with pg_hba's reason.
    let plain = PgConnectOptions::new()
        .host("127.0.50.1")
        .username("shop")
        .password(APP_PASSWORD)
        .database("shop")
        .ssl_mode(sqlx::postgres::PgSslMode::Disable)
        .connect()
        .await
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        plain.contains("pg_hba.conf rejects connection") && plain.contains("no encryption"),
        "plain TCP refused: {plain:?}"
    );
    // And the primary's certificate verifies for the -rw Service's name with the CA.
    let verified = PgConnectOptions::new()
        .host("127.0.50.1")
        .username("shop")
        .password(APP_PASSWORD)
        .database("shop")
        .ssl_mode(sqlx::postgres::PgSslMode::VerifyCa)
        .ssl_root_cert(scratch.0.join("server-tls/ca.crt"))
        .connect()
        .await;
    assert!(
        verified.is_ok(),
        "the server's certificate chains to the cluster's CA: {:?}",
        verified.err()
    );

    // A sync quorum through reload: the standby becomes a quorum member, and a commit
    // with remote_apply is visible on it the moment the commit returns.
    let (code, reloaded) = primary.post(
        "/reload",
        r#"{"synchronousStandbyNames": "ANY 1 (\"it-2\")"}"#,
    );
    assert_eq!(code, 200, "{reloaded}");
    eventually(
        "the standby is a quorum member",
        Duration::from_secs(10),
        || async {
            let status = primary.get("/status").1;
            if status["server"]["standbys"][0]["syncState"] == "quorum" {
                Ok(())
            } else {
                Err(status.to_string())
            }
        },
    )
    .await;
    sqlx::query("set synchronous_commit = remote_apply")
        .execute(&mut app)
        .await
        .expect("set");
    sqlx::query("insert into orders values (3, 'synchronous')")
        .execute(&mut app)
        .await
        .expect("sync insert");
    let seen: i64 = sqlx::query_scalar("select count(*) from orders where id = 3")
        .fetch_one(&mut on_replica)
        .await
        .expect("reading on the replica");
    assert_eq!(
        seen, 1,
        "a synchronously committed row is on the standby at commit time"
    );

    // A reloadable parameter applies at once; a restart-only one is reported pending
    // until the restart. Replicas go first: a standby refuses to replay WAL from a
    // primary with a larger max_connections (the rolling order the operator follows).
    let (code, reloaded) = replica.post(
        "/reload",
        r#"{"parameters": {"work_mem": "8MB", "max_connections": "150"}}"#,
    );
    assert_eq!(code, 200, "{reloaded}");
    assert_eq!(
        reloaded["pendingRestart"],
        serde_json::json!(["max_connections"]),
        "{reloaded}"
    );
    let (code, restarted) = replica.post("/restart", "{}");
    assert_eq!(code, 200, "{restarted}");
    replica.wait_ready(Duration::from_secs(30));
    let (code, reloaded) = primary.post("/reload", r#"{"parameters": {"work_mem": "8MB", "max_connections": "150"}, "synchronousStandbyNames": ""}"#);
    assert_eq!(code, 200, "{reloaded}");
    assert_eq!(
        reloaded["pendingRestart"],
        serde_json::json!(["max_connections"]),
        "{reloaded}"
    );
    let mut fresh = connect("127.0.50.1", "postgres", SUPERUSER_PASSWORD, "postgres").await;
    let work_mem: String = sqlx::query_scalar("show work_mem")
        .fetch_one(&mut fresh)
        .await
        .expect("show");
    assert_eq!(work_mem, "8MB");
    drop(fresh);
    let (code, restarted) = primary.post("/restart", "{}");
    assert_eq!(code, 200, "{restarted}");
    primary.wait_ready(Duration::from_secs(30));
    let mut fresh = connect("127.0.50.1", "postgres", SUPERUSER_PASSWORD, "postgres").await;
    let max_connections: String = sqlx::query_scalar("show max_connections")
        .fetch_one(&mut fresh)
        .await
        .expect("show");
    assert_eq!(max_connections, "150");
    drop(fresh);

    // Promotion: the old primary stops first (its lease ends), then the replica is
    // promoted with a lease of its own, moves to a new timeline and takes writes.
    drop(app);
    drop(superuser);
    let timeline_before = replica.get("/status").1["server"]["timeline"]
        .as_i64()
        .unwrap_or_default();
    let mut primary = primary;
    drop(primary_lease);
    assert!(
        primary.terminate().success(),
        "SIGTERM stops the manager cleanly:\n{}",
        primary.log()
    );
    // The application's password rotated after the primary went (as if the primary had
    // applied it and failed before the replica received it): the replica's password
    // file follows, but a replica cannot set it.
    std::fs::write(scratch.0.join("app"), format!("{ROTATED_APP_PASSWORD}\n"))
        .expect("rotating the app password");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !replica
        .log()
        .contains("a password changed: the password file follows")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the replica reads the rotated password:\n{}",
            replica.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (code, promoted) = replica.post(
        "/promote",
        &format!(r#"{{"lease": {}, "slots": ["it-1"]}}"#, lease(4000)),
    );
    assert_eq!(code, 200, "{promoted}");
    assert_eq!(promoted["changed"], true);
    let replica_lease = replica.keep_lease();
    let body = replica.wait_ready(Duration::from_secs(30));
    assert_eq!(body["role"], "primary");
    assert_eq!(body["server"]["inRecovery"], false);
    assert!(
        body["server"]["timeline"].as_i64().unwrap_or_default() > timeline_before,
        "promotion starts a new timeline: {body}"
    );
    assert!(
        body["server"]["slots"]
            .as_array()
            .is_some_and(|slots| slots.iter().any(|s| s["name"] == "castellan_it_1")),
        "the promoted primary keeps a slot for the instance that will follow it: {body}"
    );
    // Promoted, it sets the passwords the Secrets hold: the rotated one works, the old
    // one no longer does.
    let stale = PgConnectOptions::new()
        .host("127.0.50.2")
        .username("shop")
        .password(APP_PASSWORD)
        .database("shop")
        .connect()
        .await;
    assert!(
        stale.is_err(),
        "the password from before the rotation is refused"
    );
    let mut app = connect("127.0.50.2", "shop", ROTATED_APP_PASSWORD, "shop").await;
    sqlx::query("insert into orders values (4, 'after failover')")
        .execute(&mut app)
        .await
        .expect("writes on the new primary");
    let count: i64 = sqlx::query_scalar("select count(*) from orders")
        .fetch_one(&mut app)
        .await
        .expect("count");
    assert_eq!(count, 4, "no acknowledged row was lost");
    drop(app);
    // The former primary returns holding primary data: it waits for a lease it never
    // gets, and runs no server. Demoted, it is rewound onto the new timeline and
    // receives what was written after the failover.
    let old_primary_log = primary.log();
    drop(primary);
    let rejoined = Instance::start_with(
        &scratch,
        "it-1",
        "127.0.50.1",
        Some("127.0.50.2"),
        r#"{"work_mem": "8MB", "max_connections": "150"}"#,
    );
    rejoined.demote_former_primary().await;
    assert!(
        rejoined.log().contains("pg_rewind finished"),
        "{}",
        rejoined.log()
    );
    let mut on_rejoined = connect("127.0.50.1", "shop", ROTATED_APP_PASSWORD, "shop").await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while sqlx::query_scalar::<_, i64>("select count(*) from orders where id = 4")
        .fetch_one(&mut on_rejoined)
        .await
        .unwrap_or(0)
        != 1
    {
        assert!(
            Instant::now() < deadline,
            "the rejoined replica receives post-failover writes:\n{}",
            rejoined.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(on_rejoined);

    let secrets_logged = [
        SUPERUSER_PASSWORD,
        REPLICATION_PASSWORD,
        APP_PASSWORD,
        ROTATED_APP_PASSWORD,
    ]
    .iter()
    .any(|secret| {
        replica.log().contains(secret)
            || old_primary_log.contains(secret)
            || rejoined.log().contains(secret)
    });
    assert!(
        !secrets_logged,
        "no password appears in the instance managers' logs"
    );
    drop(replica_lease);
    assert!(replica.terminate().success());
}

/// The lease: a primary whose lease is not renewed stops its server within the lease
/// (closing open sessions), and starts again when it is renewed; a grant that arrives
/// after its end grants nothing; fencing stops a server and keeps it stopped across a
/// restart of the manager.
#[tokio::test(flavor = "multi_thread")]
async fn a_primary_stops_when_its_lease_ends_and_fencing_holds() {
    let scratch = Scratch::new("lease");
    let primary = Instance::start(&scratch, "ls-1", "127.0.51.1", None);
    let keeper = primary.keep_lease();
    primary.wait_ready(Duration::from_secs(60));
    let mut session = connect("127.0.51.1", "shop", APP_PASSWORD, "shop").await;
    sqlx::query("create table t (id int)")
        .execute(&mut session)
        .await
        .expect("writes while the lease is held");

    // A stale grant is refused.
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64;
    let (code, body) = primary.post(
        "/lease",
        &format!(r#"{{"validUntilMs": {}, "durationMs": 4000}}"#, now - 1000),
    );
    assert_eq!(code, 409, "{body}");

    // Renewals stop: within the lease (4 s) and a margin the server is down and the
    // open session is gone.
    drop(keeper);
    let stopped_by = Instant::now() + Duration::from_secs(6);
    eventually(
        "the server stops when the lease ends",
        Duration::from_secs(8),
        || async {
            let (code, status) = primary.get("/readyz");
            if code == 503 && status.get("server").is_none() {
                Ok(())
            } else {
                Err(status.to_string())
            }
        },
    )
    .await;
    assert!(
        Instant::now() <= stopped_by,
        "stopped within the lease and a margin"
    );
    assert!(
        sqlx::query("insert into t values (1)")
            .execute(&mut session)
            .await
            .is_err(),
        "a session open before the lease ended can write no more"
    );
    assert!(primary.log().contains("lease ran out"), "{}", primary.log());

    // Renewed, it runs again.
    let keeper = primary.keep_lease();
    primary.wait_ready(Duration::from_secs(30));

    // Fenced: stopped, and still stopped after the manager restarts.
    let (code, fenced) = primary.post("/fence", r#"{"fenced": true}"#);
    assert_eq!(code, 200, "{fenced}");
    assert!(fenced["checkpointLsn"].as_str().is_some(), "{fenced}");
    let (code, status) = primary.get("/readyz");
    assert_eq!(code, 503);
    assert_eq!(status["fenced"], true, "{status}");
    let mut primary = primary;
    assert!(primary.terminate().success());
    drop(primary);
    let primary = Instance::start(&scratch, "ls-1", "127.0.51.1", None);
    let _keeper2 = primary.keep_lease();
    eventually(
        "fencing survives a restart",
        Duration::from_secs(30),
        || async {
            let (_, status) = primary.get("/status");
            if status["fenced"] == true && status["role"] == "primary" {
                Ok(())
            } else {
                Err(status.to_string())
            }
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        primary.get("/readyz").0,
        503,
        "a fenced primary does not start, lease or not"
    );
    let (code, _) = primary.post("/fence", r#"{"fenced": false}"#);
    assert_eq!(code, 200);
    primary.wait_ready(Duration::from_secs(30));
    drop(keeper);
}

/// A primary's volume that lost its data is never initialised again: the instance
/// waits and says why, and once demoted it is filled from the current primary.
#[tokio::test(flavor = "multi_thread")]
async fn an_empty_volume_is_filled_from_the_primary_never_initialised() {
    let scratch = Scratch::new("empty");
    let primary = Instance::start(&scratch, "ev-1", "127.0.52.1", None);
    let _keeper = primary.keep_lease();
    primary.wait_ready(Duration::from_secs(60));
    let mut app = connect("127.0.52.1", "shop", APP_PASSWORD, "shop").await;
    sqlx::raw_sql("create table kept (id int); insert into kept values (42)")
        .execute(&mut app)
        .await
        .expect("writing");

    let lost = Instance::start_without_initdb(&scratch, "ev-2", "127.0.52.2", "127.0.52.1");
    eventually(
        "the empty volume waits with a reason",
        Duration::from_secs(30),
        || async {
            let (_, status) = lost.get("/status");
            let problem = status["problem"].as_str().unwrap_or_default();
            if problem.contains("never had data") && status["ready"] == false {
                Ok(())
            } else {
                Err(status.to_string())
            }
        },
    )
    .await;
    assert!(
        !lost.data_dir.join("PG_VERSION").exists(),
        "nothing was initialised on the empty volume"
    );
    let (code, demoted) = lost.post("/demote", "{}");
    assert_eq!(code, 200, "{demoted}");
    let body = lost.wait_ready(Duration::from_secs(60));
    assert_eq!(body["role"], "replica", "{body}");
    let mut on_lost = connect("127.0.52.2", "shop", APP_PASSWORD, "shop").await;
    let kept: i64 = sqlx::query_scalar("select count(*) from kept where id = 42")
        .fetch_one(&mut on_lost)
        .await
        .expect("reading the copied data");
    assert_eq!(
        kept, 1,
        "the volume holds the primary's data, not an empty database"
    );
}

/// Only the operator may call the instance API: plain HTTP, TLS without a client
/// certificate, a client certificate of another CA and the cluster's own server
/// certificate are all refused at the handshake, and the replica stays a replica; the
/// probe port serves probes only; the operator's certificate works; and `/reload`
/// refuses settings Castellan owns even from the operator.
#[tokio::test(flavor = "multi_thread")]
async fn only_the_operator_may_call_the_instance_api() {
    let scratch = Scratch::new("auth");
    let primary = Instance::start(&scratch, "it-1", "127.0.53.1", None);
    let _lease = primary.keep_lease();
    primary.wait_ready(Duration::from_secs(60));
    let replica = Instance::start(&scratch, "it-2", "127.0.53.2", Some("127.0.53.1"));
    let body = replica.wait_ready(Duration::from_secs(60));
    assert_eq!(body["role"], "replica", "{body}");

    // Plain HTTP to the API port: no TLS, no answer.
    let (code, answer) = curl(&[
        "-s",
        "-w",
        "\n%{http_code}",
        "-X",
        "POST",
        "http://127.0.53.2:8000/promote",
    ]);
    assert_eq!(code, 0, "plain HTTP is not answered: {answer}");
    // The probe port has the probes and nothing else, and tells only the verdict.
    for (method, path) in [
        ("POST", "/promote"),
        ("POST", "/reload"),
        ("GET", "/status"),
    ] {
        let (code, answer) = replica.probe(method, path);
        assert_eq!(code, 404, "{method} {path} on the probe port: {answer}");
    }
    let (code, verdict) = replica.probe("GET", "/readyz");
    assert_eq!(code, 200, "{verdict}");
    let mut keys: Vec<&str> = verdict
        .as_object()
        .map(|o| o.keys().map(String::as_str).collect())
        .unwrap_or_default();
    keys.sort_unstable();
    assert_eq!(keys, vec!["instance", "ready", "role"], "{verdict}");

    // TLS, but not the operator.
    let other_ca = scratch.0.join("other-ca");
    let other_operator = scratch.0.join("other-operator");
    pki(&["ca", "--out", &other_ca.display().to_string()]);
    pki(&[
        "operator",
        "--ca",
        &other_ca.display().to_string(),
        "--out",
        &other_operator.display().to_string(),
    ]);
    let own_server_certificate = scratch.0.join("tls");
    for (who, client) in [
        ("no client certificate", None),
        (
            "an operator certificate of another CA",
            Some(other_operator.as_path()),
        ),
        (
            "the cluster's own server certificate",
            Some(own_server_certificate.as_path()),
        ),
    ] {
        let (code, answer) = replica.post_as(client, "/promote", "{}");
        assert_eq!(code, 0, "{who}: refused at the handshake, got {answer}");
    }
    let (code, status) = replica.get("/status");
    assert_eq!(code, 200, "{status}");
    assert_eq!(
        (&status["role"], &status["server"]["inRecovery"]),
        (&Value::from("replica"), &Value::from(true)),
        "nothing got through: {status}"
    );
    // Each refusal is logged with rustls' reason; the server certificate's is its usage.
    let log = replica.log();
    let refusals: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("refused a connection to the instance API"))
        .collect();
    assert_eq!(refusals.len(), 4, "every refused caller is logged:\n{log}");
    assert!(
        refusals
            .iter()
            .any(|line| line.contains("extended key usage")),
        "{refusals:#?}"
    );

    // The operator: settings Castellan owns are refused, however they are spelt, and
    // so are names that are no setting names (a space would smuggle one in).
    let (code, refused) = replica.post(
        "/reload",
        r#"{"parameters": {"work_mem": "8MB", "Archive_Command": "touch /tmp/castellan-pwned", " restore_command ": "touch /tmp/castellan-pwned"}}"#,
    );
    assert_eq!(code, 400, "{refused}");
    let message = refused["error"].as_str().unwrap_or_default();
    assert!(
        message.contains("parameter Archive_Command is managed by Castellan")
            && message.contains("parameter \" restore_command \" is not a PostgreSQL setting name"),
        "{refused}"
    );
    let (_, status) = replica.get("/status");
    assert!(
        status["parameters"].get("work_mem").is_none(),
        "a refused reload changes nothing: {status}"
    );
    let (code, reloaded) = replica.post("/reload", r#"{"parameters": {"work_mem": "8MB"}}"#);
    assert_eq!(code, 200, "{reloaded}");
    let (code, promoted) = replica.post(
        "/promote",
        &format!(r#"{{"lease": {}, "slots": []}}"#, lease(4000)),
    );
    assert_eq!(code, 200, "the operator may promote: {promoted}");
    assert_eq!(promoted["changed"], true);
}

/// Two replicas promoted each on its own from the same primary both move to timeline 2
/// (neither sees the other's). pg_rewind compares only timeline numbers and would call
/// the loser "no rewind required", leaving it diverged and streaming nothing; the
/// instance manager sees the fork and copies the current primary afresh instead.
#[tokio::test(flavor = "multi_thread")]
async fn a_former_primary_forked_on_the_same_timeline_is_copied_afresh() {
    let scratch = Scratch::new("fork");
    let mut first = Instance::start(&scratch, "fk-1", "127.0.54.1", None);
    let first_lease = first.keep_lease();
    first.wait_ready(Duration::from_secs(60));
    let mut app = connect("127.0.54.1", "shop", APP_PASSWORD, "shop").await;
    sqlx::raw_sql("create table orders (id int primary key, item text); insert into orders values (1, 'before')")
        .execute(&mut app)
        .await
        .expect("writing");
    drop(app);
    let winner = Instance::start(&scratch, "fk-2", "127.0.54.2", Some("127.0.54.1"));
    let mut loser = Instance::start(&scratch, "fk-3", "127.0.54.3", Some("127.0.54.1"));
    winner.wait_ready(Duration::from_secs(60));
    loser.wait_ready(Duration::from_secs(60));
    drop(first_lease);
    assert!(first.terminate().success(), "{}", first.log());

    // Both promoted, each writing a row the other does not have.
    let mut timelines = Vec::new();
    let mut leases = Vec::new();
    for (instance, row) in [(&winner, "on the winner"), (&loser, "on the loser only")] {
        let (code, promoted) = instance.post(
            "/promote",
            &format!(r#"{{"lease": {}, "slots": []}}"#, lease(4000)),
        );
        assert_eq!(code, 200, "{promoted}");
        leases.push(instance.keep_lease());
        let status = instance.wait_ready(Duration::from_secs(30));
        timelines.push(status["server"]["timeline"].as_i64().unwrap_or_default());
        let mut app = connect(&instance.address, "shop", APP_PASSWORD, "shop").await;
        sqlx::query("insert into orders values (2, $1)")
            .bind(row)
            .execute(&mut app)
            .await
            .expect("writing after promotion");
    }
    assert_eq!(
        timelines,
        vec![2, 2],
        "both promoted to the same timeline number"
    );

    // The loser stops (its lease is not renewed) and returns following the winner.
    drop(leases.pop());
    assert!(loser.terminate().success(), "{}", loser.log());
    drop(loser);
    let rejoined = Instance::start(&scratch, "fk-3", "127.0.54.3", Some("127.0.54.2"));
    rejoined.demote_former_primary().await;
    assert!(
        rejoined
            .log()
            .contains("forked from the primary on the same timeline"),
        "{}",
        rejoined.log()
    );
    // It holds the winner's history and follows it.
    let mut on_winner = connect("127.0.54.2", "shop", APP_PASSWORD, "shop").await;
    sqlx::query("insert into orders values (3, 'after the rejoin')")
        .execute(&mut on_winner)
        .await
        .expect("writing on the winner");
    let mut on_rejoined = connect("127.0.54.3", "shop", APP_PASSWORD, "shop").await;
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let rows: Vec<(i32, String)> = sqlx::query_as("select id, item from orders order by id")
            .fetch_all(&mut on_rejoined)
            .await
            .unwrap_or_default();
        if rows.len() == 3 {
            assert_eq!(rows[1].1, "on the winner", "{rows:?}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the rejoined instance streams from the winner: {rows:?}\n{}",
            rejoined.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(leases);
}

/// A primary whose synchronous standbys are not streaming still starts and becomes
/// ready: its standbys reconnect through `-rw` only once it is ready, so the instance
/// manager's own writes when it prepares the primary (the roles' passwords) must not
/// wait for them, while the clients' commits still do. Here the manager restarts with a
/// quorum whose standby never comes; in the fault-injection suite it was a promoted
/// primary's server killed and restarted in place, and the supervisor hung in that
/// commit, silent, with the pod not ready.
#[tokio::test(flavor = "multi_thread")]
async fn a_primary_prepares_without_waiting_for_its_synchronous_standbys() {
    let scratch = Scratch::new("quorum");
    let mut primary = Instance::start(&scratch, "sq-1", "127.0.55.1", None);
    let keeper = primary.keep_lease();
    primary.wait_ready(Duration::from_secs(60));
    drop(keeper);
    assert!(primary.terminate().success(), "{}", primary.log());
    drop(primary);

    let primary = Instance::launch(
        &scratch,
        "sq-1",
        "127.0.55.1",
        "{}",
        &[
            "--role",
            "primary",
            "--synchronous-standby-names",
            r#"ANY 1 ("ghost")"#,
        ],
    );
    let _keeper = primary.keep_lease();
    let status = primary.wait_ready(Duration::from_secs(30));
    assert_eq!(
        status["server"]["synchronousStandbyNames"], r#"ANY 1 ("ghost")"#,
        "{status}"
    );
    let mut app = connect("127.0.55.1", "shop", APP_PASSWORD, "shop").await;
    let committed = tokio::time::timeout(
        Duration::from_secs(3),
        sqlx::query("create table orders (id int)").execute(&mut app),
    )
    .await;
    assert!(
        committed.is_err(),
        "a client's commit waits for the quorum: {committed:?}"
    );
}

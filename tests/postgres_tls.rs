//! PostgreSQL's TLS end to end (issue #12), as a client and an administrator meet it:
//! the operator runs with a CA the user brings (`--ca-secret`, the way a cert-manager
//! CA is handed over); a cluster serves TLS with a certificate from it for its
//! Services' names, which a client verifies with the application Secret's `ca.crt`
//! and the `uri`'s `sslmode=verify-full`; plain TCP is refused until
//! `spec.tls.allowPlaintext` is set, and again when it is unset; the superuser logs in
//! over the network only once `spec.enableSuperuserAccess` says so, and `spec.pgHba`
//! lines take effect and are taken back on the running servers; replicas stream with
//! their client certificate; certificates the operator issues again (here: their
//! Secrets deleted) are served without a restart, the replica's at its next
//! connection. An operator told to use a CA Secret that does not exist says so and
//! stops instead of making one. Castellan's own CA rotates when asked, under a writer
//! that sees no failed write and through an operator stopped mid-rotation.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use support::cluster::{
    LocalVolumes, Operator, apply_cluster, condition, condition_message, describe, events_with,
    jsonpath, secret_value, try_superuser, wait_for,
};
use support::faults::{Writer, postmaster_pid};
use support::postgres::pg_bin_dir;
use support::{TestNamespace, client, eventually, kubectl_ok};

const METRICS_ADDRESS: &str = "127.0.74.1:8080";
const MISSING_CA_ADDRESS: &str = "127.0.74.2:8080";
const ROTATION_ADDRESS: &str = "127.0.74.3:8080";
const ROTATION_ADDRESS_2: &str = "127.0.74.4:8080";

/// Runs `sql` with psql on `conninfo` (a URI or key=value string) with `env` set;
/// the output, or psql's complaint.
fn psql(conninfo: &str, env: &[(&str, &str)], sql: &str) -> Result<String, String> {
    let output = Command::new(pg_bin_dir().join("psql"))
        .args(["--no-psqlrc", "--tuples-only", "--no-align", "--dbname"])
        .arg(conninfo)
        .args(["--command", sql])
        .env_clear()
        .env("PGCONNECT_TIMEOUT", "10")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("running psql");
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
    } else {
        Err(String::from_utf8_lossy(&output.stderr).trim().to_owned())
    }
}

/// `openssl` with `args`, `input` on its standard input; its standard output.
fn openssl(args: &[&str], input: &[u8]) -> String {
    use std::io::Write;
    let mut child = Command::new("openssl")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("running openssl");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input)
        .expect("writing to openssl");
    let output = child.wait_with_output().expect("openssl");
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The SHA-256 fingerprint of the first certificate in `pem`.
fn fingerprint(pem: &str) -> String {
    openssl(
        &["x509", "-noout", "-fingerprint", "-sha256"],
        pem.as_bytes(),
    )
    .trim()
    .to_owned()
}

/// The fingerprint of the certificate PostgreSQL at `address` serves.
fn served_fingerprint(address: &str) -> String {
    let served = openssl(
        &[
            "s_client",
            "-starttls",
            "postgres",
            "-connect",
            &format!("{address}:5432"),
        ],
        b"",
    );
    fingerprint(&served)
}

/// Runs `sql` with the application Secret's `uri` as it is, dialling `address` (the
/// local cluster resolves no Service names) and verifying the server with the CA in
/// `ca_file`.
fn psql_as_app(uri: &str, address: &str, ca_file: &str, sql: &str) -> Result<String, String> {
    psql(
        uri,
        &[("PGHOSTADDR", address), ("PGSSLROOTCERT", ca_file)],
        sql,
    )
}

/// Waits until a connection with `conninfo` is refused with `reason` (`what` is
/// refused, for the failure message).
async fn refused_with(what: &str, conninfo: &str, reason: &str) {
    eventually(
        &format!("{what} is refused"),
        Duration::from_secs(60),
        || async {
            match psql(conninfo, &[], "select 1") {
                Err(refusal) if refusal.contains(reason) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
}

/// Waits until PostgreSQL at `address` serves the certificate with `fingerprint`
/// (`what`, for the failure message).
async fn serves(address: &str, what: &str, fingerprint: &str) {
    eventually(
        &format!("{address} serves {what}"),
        Duration::from_secs(60),
        || async {
            let served = served_fingerprint(address);
            if served == fingerprint {
                Ok(())
            } else {
                Err(served)
            }
        },
    )
    .await;
}

/// The serial number of the first certificate in `pem`, in decimal, as
/// `pg_stat_ssl.client_serial` shows it.
fn serial(pem: &str) -> String {
    let hex = openssl(&["x509", "-noout", "-serial"], pem.as_bytes());
    let hex = hex.trim().trim_start_matches("serial=");
    // Long division of the hex digits by ten, most significant first.
    let mut digits: Vec<u32> = hex.chars().filter_map(|c| c.to_digit(16)).collect();
    let mut decimal = Vec::new();
    while digits.iter().any(|d| *d != 0) {
        let mut remainder = 0;
        for digit in &mut digits {
            let value = remainder * 16 + *digit;
            *digit = value / 10;
            remainder = value % 10;
        }
        decimal.push(char::from_digit(remainder, 10).expect("a digit"));
    }
    if decimal.is_empty() {
        "0".to_owned()
    } else {
        decimal.iter().rev().collect()
    }
}

/// A new CA made by `castellan pki ca` in a fresh temporary directory `name`.
fn new_ca(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(name);
    let _ = std::fs::remove_dir_all(&dir);
    let status = Command::new(env!("CARGO_BIN_EXE_castellan"))
        .args(["pki", "ca", "--out"])
        .arg(&dir)
        .status()
        .expect("castellan pki ca");
    assert!(status.success());
    dir
}

/// Makes a CA with `castellan pki ca` (standing in for one cert-manager made) and
/// stores it as the `kubernetes.io/tls` Secret `name`; its directory.
fn user_ca(namespace: &str, name: &str) -> PathBuf {
    let dir = new_ca(&format!("{namespace}-{name}"));
    let path = |file: &str| dir.join(file).display().to_string();
    kubectl_ok(&[
        "create",
        "secret",
        "tls",
        name,
        "-n",
        namespace,
        &format!("--cert={}", path("tls.crt")),
        &format!("--key={}", path("tls.key")),
    ]);
    dir
}

/// Deletes the certificate Secret `name` and waits for the operator to issue it again;
/// the new certificate (PEM).
async fn issued_again(namespace: &str, name: &str) -> String {
    let before = secret_value(namespace, name, "tls.crt");
    kubectl_ok(&["delete", "secret", name, "-n", namespace]);
    eventually(
        &format!("the operator issues {name} again"),
        Duration::from_secs(60),
        || async {
            let pem = secret_value(namespace, name, "tls.crt");
            if !pem.is_empty() && pem != before {
                Ok(pem)
            } else {
                Err("not yet".to_owned())
            }
        },
    )
    .await
}

fn write_file(path: &Path, contents: &str) {
    std::fs::write(path, contents).expect("writing a file");
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_serves_tls_from_the_users_ca_and_admits_only_whom_the_spec_names() {
    let client = client().await;
    let namespace = TestNamespace::create(&client, "tls").await;
    let ns = namespace.name.clone();
    let volumes = LocalVolumes::create("tls-local", 1);
    let ca_dir = user_ca(&ns, "company-ca");
    let operator = Operator::start_with(&ns, METRICS_ADDRESS, &["--ca-secret", "company-ca"]);
    let logs = vec![operator.log.clone()];
    let diagnostics = || describe(&ns, &logs);
    apply_cluster(&ns, "vault", 2, &volumes.class, "");
    wait_for(
        "the cluster is Ready with 2 ready instances",
        Duration::from_secs(180),
        || {
            jsonpath(
                "dbc",
                "vault",
                &ns,
                "{.status.phase}/{.status.readyInstances}",
            ) == "Ready/2"
        },
        diagnostics,
    );
    assert!(
        jsonpath("secret", "castellan-ca", &ns, "{.metadata.name}").is_empty(),
        "with --ca-secret the operator makes no CA of its own"
    );

    // The application Secret: a verify-full URI and the CA to verify with, which is
    // the user's.
    let uri = secret_value(&ns, "vault-app", "uri");
    assert!(uri.ends_with("?sslmode=verify-full"), "{uri}");
    assert!(uri.contains(&format!("@vault-rw.{ns}.svc:5432/")), "{uri}");
    let ca_pem = secret_value(&ns, "vault-app", "ca.crt");
    let user_ca_pem = std::fs::read_to_string(ca_dir.join("tls.crt")).expect("the user's CA");
    assert_eq!(fingerprint(&ca_pem), fingerprint(&user_ca_pem));
    let ca_file = ca_dir.join("from-secret.crt");
    write_file(&ca_file, &ca_pem);
    let ca_path = ca_file.display().to_string();

    // A client uses the URI as it is: the Service's name is verified against the
    // server's certificate (PGHOSTADDR only dials the Service's address, since the
    // local cluster resolves no Service names).
    let rw = jsonpath("svc", "vault-rw", &ns, "{.spec.clusterIP}");
    assert_eq!(
        psql_as_app(
            &uri,
            &rw,
            &ca_path,
            "select ssl from pg_stat_ssl where pid = pg_backend_pid()"
        ),
        Ok("t".to_owned()),
        "the URI connects over verified TLS"
    );
    let password = secret_value(&ns, "vault-app", "password");
    let other_name = format!(
        "host=vault-evil.{ns}.svc hostaddr={rw} user=clerk dbname=shop password={password} \
         sslmode=verify-full sslrootcert={ca_path}"
    );
    let refused = psql(&other_name, &[], "select 1").expect_err("a name the certificate lacks");
    assert!(refused.contains("does not match host name"), "{refused}");
    let other_ca = new_ca(&format!("{ns}-other-ca"));
    let wrong_ca = format!(
        "host=vault-rw.{ns}.svc hostaddr={rw} user=clerk dbname=shop password={password} \
         sslmode=verify-full sslrootcert={}",
        other_ca.join("tls.crt").display()
    );
    let refused = psql(&wrong_ca, &[], "select 1").expect_err("another CA");
    assert!(refused.contains("certificate verify failed"), "{refused}");

    // Plain TCP is refused, with pg_hba's reason; allowed once the spec says so, and
    // refused again when it no longer does.
    let plain = format!("host={rw} user=clerk dbname=shop password={password} sslmode=disable");
    let refused = psql(&plain, &[], "select 1").expect_err("plain TCP");
    assert!(
        refused.contains("pg_hba.conf rejects connection") && refused.contains("no encryption"),
        "{refused}"
    );
    let patch = |spec: &str| {
        kubectl_ok(&[
            "patch",
            "dbc",
            "vault",
            "-n",
            &ns,
            "--type",
            "merge",
            "-p",
            &format!("{{\"spec\":{spec}}}"),
        ]);
    };
    patch("{\"tls\":{\"allowPlaintext\":true}}");
    eventually(
        "plain TCP is accepted with allowPlaintext",
        Duration::from_secs(60),
        || async {
            psql(
                &plain,
                &[],
                "select ssl from pg_stat_ssl where pid = pg_backend_pid()",
            )
        },
    )
    .await;
    patch("{\"tls\":{\"allowPlaintext\":false}}");
    refused_with("plain TCP without allowPlaintext", &plain, "no encryption").await;

    // The superuser: refused over the network by default (over verified TLS, with the
    // right password), admitted once the spec allows it, by a reload.
    let superuser_password = secret_value(&ns, "vault-superuser", "password");
    let as_user = |user: &str, password: &str| {
        format!(
            "host=vault-rw.{ns}.svc hostaddr={rw} user={user} dbname=shop password={password} \
             sslmode=verify-full sslrootcert={ca_path}"
        )
    };
    let superuser = as_user("postgres", &superuser_password);
    let app = as_user("clerk", &password);
    let refused = psql(&superuser, &[], "select 1").expect_err("the superuser by default");
    assert!(
        refused.contains("pg_hba.conf rejects connection") && refused.contains("\"postgres\""),
        "{refused}"
    );
    let primary = jsonpath("dbc", "vault", &ns, "{.status.currentPrimary}");
    let postmaster = postmaster_pid(&ns, &primary);
    assert!(
        postmaster.is_some(),
        "the primary {primary:?} runs a postmaster"
    );
    patch("{\"enableSuperuserAccess\":true}");
    eventually(
        "the superuser logs in once enableSuperuserAccess is set",
        Duration::from_secs(60),
        || async { psql(&superuser, &[], "select current_user") },
    )
    .await;
    // The user's own lines: one refusing the application's user in its database takes
    // effect, and is taken back; the superuser is not touched by it.
    patch("{\"pgHba\":[\"hostssl shop clerk 0.0.0.0/0 reject\"]}");
    refused_with(
        "clerk by a pgHba line",
        &app,
        "pg_hba.conf rejects connection",
    )
    .await;
    assert_eq!(
        psql(&superuser, &[], "select current_user"),
        Ok("postgres".to_owned())
    );
    patch("{\"pgHba\":null}");
    eventually(
        "clerk is admitted again once the line is gone",
        Duration::from_secs(60),
        || async { psql(&app, &[], "select current_user") },
    )
    .await;
    assert_eq!(
        postmaster_pid(&ns, &primary),
        postmaster,
        "access follows the spec by reloads, not restarts"
    );

    // Replication runs over TLS with the replication role's client certificate.
    let standby_ssl = || async {
        let mut superuser = try_superuser(&ns, "vault", "vault-1").await?;
        sqlx::query_as::<_, (bool, Option<String>, Option<String>)>(
            "select s.ssl, s.client_dn, s.client_serial::text from pg_stat_ssl s \
             join pg_stat_replication r using (pid) where r.application_name = 'vault-2'",
        )
        .fetch_optional(&mut superuser)
        .await
        .map_err(|e| e.to_string())?
        .ok_or_else(|| "vault-2 does not stream".to_owned())
    };
    let (ssl, client_dn, _) = eventually(
        "vault-2 streams from vault-1",
        Duration::from_secs(30),
        standby_ssl,
    )
    .await;
    assert!(ssl, "the standby streams over TLS");
    assert!(
        client_dn
            .as_deref()
            .is_some_and(|dn| dn.contains("CN=streaming_replica")),
        "{client_dn:?}"
    );

    // The server certificate issued again (its Secret deleted) is served without a
    // restart.
    let primary_address = jsonpath("pod", "vault-1", &ns, "{.status.podIP}");
    let before = served_fingerprint(&primary_address);
    assert_eq!(
        before,
        fingerprint(&secret_value(&ns, "vault-server-tls", "tls.crt")),
        "the server serves its Secret's certificate"
    );
    let postmaster = postmaster_pid(&ns, "vault-1");
    let renewed = fingerprint(&issued_again(&ns, "vault-server-tls").await);
    serves(&primary_address, "the new certificate", &renewed).await;
    assert_eq!(
        postmaster_pid(&ns, "vault-1"),
        postmaster,
        "served after a reload, not a restart"
    );
    assert_eq!(
        psql_as_app(&uri, &rw, &ca_path, "select 1"),
        Ok("1".to_owned()),
        "the URI still verifies"
    );

    // The replication certificate issued again: the replica connects with it next
    // time (its connection cut here), and streams.
    let (_, _, old_serial) = standby_ssl().await.expect("streaming");
    let new_serial = serial(&issued_again(&ns, "vault-replication-tls").await);
    assert_ne!(
        Some(&new_serial),
        old_serial.as_ref(),
        "a new certificate, not the one it streams with"
    );
    eventually(
        "vault-2 streams with the new certificate",
        Duration::from_secs(60),
        || async {
            let (_, _, serial) = standby_ssl().await?;
            if serial.as_deref() == Some(new_serial.as_str()) {
                return Ok(());
            }
            // Cut the walsender: the replica reconnects (reading its files again).
            let mut superuser = try_superuser(&ns, "vault", "vault-1").await?;
            sqlx::query(
                "select pg_terminate_backend(pid) from pg_stat_replication \
                 where application_name = 'vault-2'",
            )
            .execute(&mut superuser)
            .await
            .map_err(|e| e.to_string())?;
            Err(format!("serial {serial:?}, waiting for {new_serial}"))
        },
    )
    .await;

    // A server certificate the user brings, in cert-manager's layout (tls.crt, tls.key,
    // ca.crt), from a CA that is not the operator's. One made for another cluster's
    // name is refused with the reason, and nothing served changes.
    let web_ca = new_ca(&format!("{ns}-web-ca"));
    let bring = |secret: &str, cluster: &str| -> PathBuf {
        let dir = std::env::temp_dir().join(format!("{ns}-{secret}"));
        let _ = std::fs::remove_dir_all(&dir);
        let status = Command::new(env!("CARGO_BIN_EXE_castellan"))
            .args(["pki", "postgres", "--ca"])
            .arg(&web_ca)
            .args(["--cluster", cluster, "--namespace", &ns, "--out"])
            .arg(&dir)
            .status()
            .expect("castellan pki postgres");
        assert!(status.success());
        let file = |key: &str| format!("--from-file={key}={}", dir.join(key).display());
        kubectl_ok(&[
            "create",
            "secret",
            "generic",
            secret,
            "-n",
            &ns,
            "--type=kubernetes.io/tls",
            &file("tls.crt"),
            &file("tls.key"),
            &file("ca.crt"),
        ]);
        dir
    };
    let wrong = bring("other-name-tls", "other");
    patch("{\"tls\":{\"serverCertificate\":{\"secretName\":\"other-name-tls\"}}}");
    wait_for(
        "a certificate for another name is refused",
        Duration::from_secs(60),
        || condition(&ns, "vault", "ServerCertificate") == "False/CertificateRefused",
        diagnostics,
    );
    let refusal = condition_message(&ns, "vault", "ServerCertificate");
    assert!(
        refusal.contains(&format!("vault-rw.{ns}.svc")) && refusal.contains("keeps serving"),
        "{refusal}"
    );
    assert!(!events_with(&ns, "CertificateRefused", "").is_empty());
    assert_eq!(served_fingerprint(&primary_address), renewed);

    // One for its name is served without a restart; the application Secret's ca.crt
    // becomes the user's CA, which clients verify with, and the replica follows its
    // primary verified with it.
    let right = bring("web-tls", "vault");
    let web_certificate =
        fingerprint(&std::fs::read_to_string(right.join("tls.crt")).expect("the certificate"));
    patch("{\"tls\":{\"serverCertificate\":{\"secretName\":\"web-tls\"}}}");
    serves(
        &primary_address,
        "the certificate the user brought",
        &web_certificate,
    )
    .await;
    assert_eq!(condition(&ns, "vault", "ServerCertificate"), "True/Brought");
    let web_ca_pem = std::fs::read_to_string(web_ca.join("tls.crt")).expect("the web CA");
    eventually(
        "the application Secret carries the user's CA",
        Duration::from_secs(30),
        || async {
            let ca = secret_value(&ns, "vault-app", "ca.crt");
            if fingerprint(&ca) == fingerprint(&web_ca_pem) {
                Ok(ca)
            } else {
                Err("not yet".to_owned())
            }
        },
    )
    .await;
    let web_ca_file = ca_dir.join("web-ca.crt");
    write_file(&web_ca_file, &web_ca_pem);
    let web_ca_path = web_ca_file.display().to_string();
    assert_eq!(
        psql_as_app(&uri, &rw, &web_ca_path, "select 1"),
        Ok("1".to_owned()),
        "the URI verifies the user's certificate with the Secret's CA"
    );
    assert_eq!(
        postmaster_pid(&ns, "vault-1"),
        postmaster,
        "served after a reload, not a restart"
    );
    eventually(
        "vault-2 streams again, verifying its primary with the user's CA",
        Duration::from_secs(60),
        || async {
            let mut superuser = try_superuser(&ns, "vault", "vault-1").await?;
            let cut: Vec<i32> = sqlx::query_scalar(
                "select pid from pg_stat_replication where application_name = 'vault-2' \
                 and backend_start < now() - interval '2 seconds'",
            )
            .fetch_all(&mut superuser)
            .await
            .map_err(|e| e.to_string())?;
            if cut.is_empty() && standby_ssl().await.is_ok() {
                return Ok(());
            }
            // Cut its older connections: the one it makes next verifies the new
            // certificate.
            sqlx::query(
                "select pg_terminate_backend(pid) from pg_stat_replication \
                 where application_name = 'vault-2' and backend_start < now() - interval '2 seconds'",
            )
            .execute(&mut superuser)
            .await
            .map_err(|e| e.to_string())?;
            Err("reconnecting".to_owned())
        },
    )
    .await;

    // Taken back: Castellan issues its own again.
    patch("{\"tls\":{\"serverCertificate\":null}}");
    eventually(
        "the primary serves Castellan's certificate again",
        Duration::from_secs(60),
        || async {
            let served = served_fingerprint(&primary_address);
            let issued = fingerprint(&secret_value(&ns, "vault-server-tls", "tls.crt"));
            if served != web_certificate && served == issued {
                Ok(())
            } else {
                Err(served)
            }
        },
    )
    .await;
    assert_eq!(condition(&ns, "vault", "ServerCertificate"), "/");
    drop(operator);
    for dir in [&ca_dir, &other_ca, &web_ca, &wrong, &right] {
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_operator_told_to_use_a_missing_ca_says_so_and_makes_none() {
    let client = client().await;
    let namespace = TestNamespace::create(&client, "tlsca").await;
    let ns = namespace.name.clone();
    let mut operator = Operator::start_with(&ns, MISSING_CA_ADDRESS, &["--ca-secret", "not-there"]);
    let log = operator.log.clone();
    eventually(
        "the operator stops for want of its CA",
        Duration::from_secs(60),
        || {
            let running = operator.running();
            async move {
                if running {
                    Err("still running".to_owned())
                } else {
                    Ok(())
                }
            }
        },
    )
    .await;
    let said = std::fs::read_to_string(&log).expect("the operator's log");
    assert!(
        said.contains(&format!(
            "the CA Secret {ns}/not-there named by --ca-secret does not exist"
        )),
        "{said}"
    );
    assert!(
        jsonpath("secret", "not-there", &ns, "{.metadata.name}").is_empty(),
        "it made none"
    );
}

/// How many certificates a PEM text holds.
fn certificates_in(pem: &str) -> usize {
    pem.matches("-----BEGIN CERTIFICATE-----").count()
}

/// Whether `leaf` (PEM) verifies with `ca` (PEM) alone, as `openssl verify` sees it.
fn signed_by(leaf: &str, ca: &str, dir: &Path) -> bool {
    let (leaf_file, ca_file) = (dir.join("leaf.crt"), dir.join("ca.crt"));
    write_file(&leaf_file, leaf);
    write_file(&ca_file, ca);
    Command::new("openssl")
        .args(["verify", "-partial_chain", "-CAfile"])
        .arg(&ca_file)
        .arg(&leaf_file)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("openssl verify")
        .success()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_ca_rotates_under_a_writer_and_through_an_operator_restart() {
    let client = client().await;
    let namespace = TestNamespace::create(&client, "carot").await;
    let ns = namespace.name.clone();
    let volumes = LocalVolumes::create("carot-local", 1);
    let operator = Operator::start(&ns, ROTATION_ADDRESS);
    let mut logs = vec![operator.log.clone()];
    apply_cluster(&ns, "ledger", 2, &volumes.class, "");
    let ready = |logs: &[PathBuf]| {
        wait_for(
            "the cluster is Ready with 2 ready instances",
            Duration::from_secs(180),
            || {
                jsonpath(
                    "dbc",
                    "ledger",
                    &ns,
                    "{.status.phase}/{.status.readyInstances}",
                ) == "Ready/2"
            },
            || describe(&ns, logs),
        )
    };
    ready(&logs);
    let writer = Writer::start(&ns, "ledger").await;
    writer
        .wait_for_write_after(std::time::Instant::now(), Duration::from_secs(30))
        .await;
    let old_ca = secret_value(&ns, "castellan-ca", "tls.crt");
    let old_leaves: Vec<String> = ["instance-tls", "server-tls", "replication-tls"]
        .iter()
        .map(|suffix| secret_value(&ns, &format!("ledger-{suffix}"), "tls.crt"))
        .collect();
    let since = std::time::Instant::now();

    // Asked for: first the new CA is trusted everywhere, before it issues anything.
    kubectl_ok(&[
        "annotate",
        "secret",
        "castellan-ca",
        "-n",
        &ns,
        "castellan.io/rotate-ca=first",
    ]);
    eventually(
        "the new CA is trusted beside the old one",
        Duration::from_secs(60),
        || async {
            let next = secret_value(&ns, "castellan-ca", "next.crt");
            let bundle = secret_value(&ns, "ledger-instance-tls", "ca.crt");
            if !next.is_empty() && certificates_in(&bundle) == 2 {
                Ok(())
            } else {
                Err(format!("next.crt: {}, bundle: {bundle}", !next.is_empty()))
            }
        },
    )
    .await;
    assert_eq!(
        secret_value(&ns, "castellan-ca", "tls.crt"),
        old_ca,
        "the old CA issues until every instance trusts the new one"
    );

    // The operator is replaced mid-rotation, as a rolling update of its Deployment
    // does it (a standby waits for the Lease the leader gives up on SIGTERM); the next
    // one carries on from the Secret. (Killed instead, its primary lease would run out
    // before the standby takes over, and writes pause: that is failover's business.)
    let standby = Operator::start(&ns, ROTATION_ADDRESS_2);
    logs.push(standby.log.clone());
    let stopped = operator.terminate();
    assert!(stopped.success(), "the leader stops cleanly: {stopped:?}");
    let operator = standby;
    let diagnostics = || describe(&ns, &logs);
    wait_for(
        "the rotation finished (castellan.io/ca-rotated=first)",
        Duration::from_secs(240),
        || {
            jsonpath(
                "secret",
                "castellan-ca",
                &ns,
                "{.metadata.annotations.castellan\\.io/ca-rotated}",
            ) == "first"
        },
        diagnostics,
    );
    let new_ca = secret_value(&ns, "castellan-ca", "tls.crt");
    assert_ne!(fingerprint(&new_ca), fingerprint(&old_ca));
    assert!(secret_value(&ns, "castellan-ca", "next.crt").is_empty());
    assert_eq!(
        fingerprint(&secret_value(&ns, "castellan-ca", "ca.crt")),
        fingerprint(&new_ca),
        "the old CA is trusted no more"
    );
    assert!(
        jsonpath(
            "secret",
            "castellan-ca",
            &ns,
            "{.metadata.annotations.castellan\\.io/ca-rotation}"
        )
        .is_empty(),
        "no rotation under way"
    );
    let scratch = std::env::temp_dir().join(format!("{ns}-rotation"));
    std::fs::create_dir_all(&scratch).expect("a scratch directory");
    for (suffix, old_leaf) in ["instance-tls", "server-tls", "replication-tls"]
        .iter()
        .zip(&old_leaves)
    {
        let secret = format!("ledger-{suffix}");
        let leaf = secret_value(&ns, &secret, "tls.crt");
        assert_ne!(&leaf, old_leaf, "{secret} issued again");
        assert!(
            signed_by(&leaf, &new_ca, &scratch),
            "{secret} by the new CA"
        );
        assert!(!signed_by(&leaf, &old_ca, &scratch));
        // The clusters' passes drop the old CA once the rotation finished.
        eventually(
            &format!("{secret} trusts the new CA alone"),
            Duration::from_secs(30),
            || async {
                let bundle = secret_value(&ns, &secret, "ca.crt");
                if certificates_in(&bundle) == 1 && fingerprint(&bundle) == fingerprint(&new_ca) {
                    Ok(())
                } else {
                    Err(bundle)
                }
            },
        )
        .await;
    }
    for reason in [
        "CARotationStarted",
        "CARotationSwitched",
        "CARotationFinished",
    ] {
        assert!(
            !events_with(&ns, reason, "").is_empty(),
            "an Event {reason}\n{}",
            diagnostics()
        );
    }

    // PostgreSQL serves the new certificate, which a client verifies with the
    // application Secret's ca.crt (now the new CA).
    let rw = jsonpath("svc", "ledger-rw", &ns, "{.spec.clusterIP}");
    let server_leaf = secret_value(&ns, "ledger-server-tls", "tls.crt");
    serves(
        &rw,
        "the new server certificate",
        &fingerprint(&server_leaf),
    )
    .await;
    let app_ca = scratch.join("app-ca.crt");
    eventually(
        "the application Secret's ca.crt is the new CA",
        Duration::from_secs(30),
        || async {
            let ca = secret_value(&ns, "ledger-app", "ca.crt");
            if fingerprint(&ca) == fingerprint(&new_ca) {
                write_file(&app_ca, &ca);
                Ok(())
            } else {
                Err("not yet".to_owned())
            }
        },
    )
    .await;
    let app_ca_path = app_ca.display().to_string();
    let uri = secret_value(&ns, "ledger-app", "uri");
    assert_eq!(
        psql_as_app(&uri, &rw, &app_ca_path, "select 1"),
        Ok("1".to_owned())
    );

    // No write failed, and the replica still streams what was written.
    assert!(
        !writer.failed_after(since),
        "a write failed during the rotation\n{}",
        diagnostics()
    );
    let written = writer.acknowledged().len();
    let ro = jsonpath("svc", "ledger-ro", &ns, "{.spec.clusterIP}");
    let password = secret_value(&ns, "ledger-app", "password");
    eventually(
        "the replica has every row acknowledged before the check",
        Duration::from_secs(60),
        || async {
            let mut replica = support::postgres::connect(&ro, "clerk", &password, "shop").await;
            let count: i64 = sqlx::query_scalar("select count(*) from ledger")
                .fetch_one(&mut replica)
                .await
                .map_err(|e| e.to_string())?;
            if usize::try_from(count).unwrap_or(0) >= written {
                Ok(())
            } else {
                Err(format!("{count} of {written}"))
            }
        },
    )
    .await;
    drop(writer);

    // The operator still commands its instances, with a certificate of the new CA.
    kubectl_ok(&[
        "patch",
        "dbc",
        "ledger",
        "-n",
        &ns,
        "--type=merge",
        "-p",
        r#"{"spec":{"parameters":{"work_mem":"12MB"}}}"#,
    ]);
    for (service, address) in [("ledger-rw", &rw), ("ledger-ro", &ro)] {
        eventually(
            &format!("{service} runs with work_mem 12MB"),
            Duration::from_secs(60),
            || async {
                let mut connection =
                    support::postgres::connect(address, "clerk", &password, "shop").await;
                let work_mem: String = sqlx::query_scalar("show work_mem")
                    .fetch_one(&mut connection)
                    .await
                    .map_err(|e| e.to_string())?;
                if work_mem == "12MB" {
                    Ok(())
                } else {
                    Err(work_mem)
                }
            },
        )
        .await;
    }
    let _ = std::fs::remove_dir_all(&scratch);
    ready(&logs);
    drop(operator);
    drop(volumes);
}

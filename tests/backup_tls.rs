//! An object store behind TLS with a private CA, end to end, through `kubectl`: without
//! `spec.backup.endpointCA` archiving fails and says why (the certificate is not
//! trusted), a CA Secret that holds no certificate is named in the condition, and with
//! the right CA archiving resumes; an uncompressed (`compression: none`) base backup
//! over that endpoint completes as a plain `data.tar` and its verification (a restore
//! into a scratch instance over the same TLS) succeeds.

mod support;

use std::path::PathBuf;
use std::time::Duration;

use support::cluster::{
    LocalVolumes, Operator, SUPERUSER_ACCESS, apply_cluster, apply_manifest, condition,
    condition_message, describe, jsonpath, phase_and_ready, try_superuser, wait_for,
};
use support::{TestNamespace, client, kubectl_ok, s3};

const OPERATOR: &str = "127.0.69.1:8080";

fn archiving_message(namespace: &str) -> String {
    condition_message(namespace, "vault", "ContinuousArchiving")
}

/// `kubectl apply`s the one-instance cluster `vault` backing up through the TLS proxy,
/// uncompressed, with Secret `ca` as its `endpointCA` when given.
fn apply_vault(namespace: &str, class: &str, proxy: &s3::TlsProxy, ca: Option<&str>) {
    let env = s3::env();
    let ca = ca
        .map(|ca| format!(", endpointCA: {{secretName: {ca}}}"))
        .unwrap_or_default();
    let backup = format!(
        "  backup: {{endpoint: \"{}\", bucket: {}, credentials: {{secretName: s3}}, compression: none{ca}}}\n",
        proxy.endpoint, env["S3_BUCKET"]
    );
    apply_cluster(
        namespace,
        "vault",
        1,
        class,
        &format!("{backup}{SUPERUSER_ACCESS}"),
    );
}

/// Creates Secret `name` with `contents` under `ca.crt`.
fn create_ca_secret(namespace: &str, name: &str, contents: &str) {
    let file = std::env::temp_dir().join(format!("{namespace}-{name}.crt"));
    std::fs::write(&file, contents).expect("writing the CA");
    kubectl_ok(&[
        "create",
        "secret",
        "generic",
        name,
        "-n",
        namespace,
        &format!("--from-file=ca.crt={}", file.display()),
    ]);
    let _ = std::fs::remove_file(&file);
}

#[tokio::test]
async fn a_private_ca_endpoint_is_trusted_only_when_named_and_plain_backups_restore() {
    let _client = client().await;
    let namespace = TestNamespace::create(&_client, "backup-tls").await;
    let ns = namespace.name.clone();
    // Per node: the instance, and a scratch instance for the verification.
    let volumes = LocalVolumes::create(&format!("{ns}-local"), 2);
    let operator = Operator::start(&ns, OPERATOR);
    let logs: Vec<PathBuf> = vec![operator.log.clone()];
    let diagnostics = || describe(&ns, &logs);
    let proxy = s3::TlsProxy::start();
    s3::create_secret(&ns);

    // Without the CA: the certificate is refused, and the condition says so.
    apply_vault(&ns, &volumes.class, &proxy, None);
    wait_for(
        "vault Ready",
        Duration::from_secs(120),
        || phase_and_ready(&ns, "vault") == "Ready/1",
        diagnostics,
    );
    let primary = jsonpath("dbc", "vault", &ns, "{.status.currentPrimary}");
    let mut connection = try_superuser(&ns, "vault", &primary)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    sqlx::query("create table secrets as select g as id, md5(g::text) as body from generate_series(1, 1000) g")
        .execute(&mut connection)
        .await
        .expect("writing rows");
    sqlx::query("select pg_switch_wal()")
        .execute(&mut connection)
        .await
        .expect("switching WAL");
    wait_for(
        "archiving failing on the untrusted certificate",
        Duration::from_secs(90),
        || {
            condition(&ns, "vault", "ContinuousArchiving") == "False/ArchivingFailing"
                && archiving_message(&ns)
                    .to_lowercase()
                    .contains("certificate")
        },
        diagnostics,
    );

    // A CA Secret without a certificate: named, with the reason.
    create_ca_secret(&ns, "s3-ca-wrong", "this is no certificate");
    apply_vault(&ns, &volumes.class, &proxy, Some("s3-ca-wrong"));
    wait_for(
        "the wrong CA Secret named in the condition",
        Duration::from_secs(60),
        || {
            condition(&ns, "vault", "ContinuousArchiving") == "False/CredentialsUnavailable"
                && archiving_message(&ns).contains("s3-ca-wrong")
                && archiving_message(&ns).contains("holds no PEM certificate")
        },
        diagnostics,
    );

    // The right CA: archiving resumes with the segment that failed.
    create_ca_secret(&ns, "s3-ca", &proxy.ca_pem);
    apply_vault(&ns, &volumes.class, &proxy, Some("s3-ca"));
    wait_for(
        "archiving over TLS with the cluster's CA",
        Duration::from_secs(90),
        || {
            condition(&ns, "vault", "ContinuousArchiving") == "True/Archiving"
                && archiving_message(&ns).contains("last ")
        },
        diagnostics,
    );

    // An uncompressed base backup over TLS, verified by a restore over TLS.
    apply_manifest(
        &ns,
        "plain",
        "apiVersion: castellan.io/v1alpha1\nkind: Backup\nmetadata: {name: plain}\nspec: {cluster: vault, verify: true}\n",
    );
    wait_for(
        "the plain backup Completed",
        Duration::from_secs(120),
        || jsonpath("backup", "plain", &ns, "{.status.phase}") == "Completed",
        diagnostics,
    );
    let system_id: i64 = sqlx::query_scalar("select system_identifier from pg_control_system()")
        .fetch_one(&mut connection)
        .await
        .expect("the system identifier");
    let id = jsonpath("backup", "plain", &ns, "{.status.backupId}");
    let key = format!("{ns}/vault/{system_id}/base/{id}");
    let stored = s3::keys(&key).await;
    assert!(
        stored.contains(&format!("{key}/data.tar"))
            && stored.contains(&format!("{key}/backup.json")),
        "an uncompressed tar and its manifest under {key}: {stored:?}"
    );
    assert!(!stored.iter().any(|k| k.ends_with(".zst")), "{stored:?}");
    let data: u64 = jsonpath("backup", "plain", &ns, "{.status.dataBytes}")
        .parse()
        .expect("dataBytes");
    let size: u64 = jsonpath("backup", "plain", &ns, "{.status.sizeBytes}")
        .parse()
        .expect("sizeBytes");
    assert!(
        size >= data,
        "stored {size} bytes of {data} without compression"
    );
    wait_for(
        "the plain backup verified",
        Duration::from_secs(300),
        || {
            let verified = jsonpath(
                "backup",
                "plain",
                &ns,
                "{.status.conditions[?(@.type==\"RestoreVerified\")].status}",
            );
            assert_ne!(verified, "False", "{}", diagnostics());
            verified == "True"
        },
        diagnostics,
    );
    drop(connection);
    drop(proxy);
    drop(operator);
}

//! The local S3 server `make test` and `make up` run (`deploy/local/s3.sh`): its address
//! and keys from `<dev dir>/s3.env`, a client, and stopping and starting it.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use futures::TryStreamExt;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};

use super::cluster::SUPERUSER_ACCESS;
use super::kubeconfig_path;

/// The dev directory of the cluster under test (where its kubeconfig is).
fn dev_dir() -> PathBuf {
    kubeconfig_path()
        .parent()
        .map(PathBuf::from)
        .expect("the kubeconfig lies in the dev directory")
}

/// `S3_ENDPOINT`, `S3_BUCKET`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`.
pub fn env() -> BTreeMap<String, String> {
    let path = dev_dir().join("s3.env");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "reading {}: {e} (make test and make up start the S3 server: deploy/local/s3.sh up)",
            path.display()
        )
    });
    text.lines()
        .filter_map(|line| {
            let line = line.trim().trim_start_matches("export ");
            let (key, value) = line.split_once('=')?;
            Some((key.to_owned(), value.trim_matches('"').to_owned()))
        })
        .collect()
}

pub fn store() -> AmazonS3 {
    // The S3 client's TLS takes the process' provider (unused over http://, but
    // required to build the client).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let env = env();
    AmazonS3Builder::new()
        .with_endpoint(&env["S3_ENDPOINT"])
        .with_bucket_name(&env["S3_BUCKET"])
        .with_region(env.get("AWS_REGION").map_or("us-east-1", String::as_str))
        .with_access_key_id(&env["AWS_ACCESS_KEY_ID"])
        .with_secret_access_key(&env["AWS_SECRET_ACCESS_KEY"])
        .with_allow_http(true)
        .build()
        .expect("an S3 client for the local server")
}

/// Every key under `prefix`.
pub async fn keys(prefix: &str) -> Vec<String> {
    let store = store();
    let prefix = ObjectPath::from(prefix);
    store
        .list(Some(&prefix))
        .map_ok(|meta| meta.location.to_string())
        .try_collect()
        .await
        .unwrap_or_default()
}

/// The object at `key`, decompressed (Castellan stores WAL with zstd).
pub async fn wal_file(key: &str) -> Vec<u8> {
    let bytes = store()
        .get(&ObjectPath::from(key))
        .await
        .unwrap_or_else(|e| panic!("reading {key}: {e}"))
        .bytes()
        .await
        .unwrap_or_else(|e| panic!("reading {key}: {e}"));
    zstd::stream::decode_all(bytes.as_ref()).unwrap_or_else(|e| panic!("decompressing {key}: {e}"))
}

/// `deploy/local/s3.sh stop` or `up`: the server goes away, and comes back with its
/// data and keys.
pub fn server(action: &str) {
    // No port base: `s3.sh up` after `stop` starts it where its s3.env says.
    let status = Command::new(super::repo().join("deploy/local/s3.sh"))
        .arg(action)
        .env("CASTELLAN_DEV_DIR", dev_dir())
        .env_remove("CASTELLAN_PORT_BASE")
        .status()
        .expect("running deploy/local/s3.sh");
    assert!(status.success(), "deploy/local/s3.sh {action} failed");
}

/// Creates Secret `s3` in `namespace` with the local server's keys.
pub fn create_secret(namespace: &str) {
    let env = env();
    super::kubectl_ok(&[
        "create",
        "secret",
        "generic",
        "s3",
        "-n",
        namespace,
        &format!("--from-literal=accessKeyId={}", env["AWS_ACCESS_KEY_ID"]),
        &format!(
            "--from-literal=secretAccessKey={}",
            env["AWS_SECRET_ACCESS_KEY"]
        ),
    ]);
}

/// The local server as a `spec.backup` (or `recovery.source`) value in flow style,
/// with Secret `s3` (`create_secret`); `path` when given, and `extra` fields (such as
/// `retention: {keepLast: 1}`).
pub fn backup_target(path: Option<&str>, extra: &str) -> String {
    let env = env();
    let path = path.map(|p| format!(", path: {p}")).unwrap_or_default();
    let extra = if extra.is_empty() {
        String::new()
    } else {
        format!(", {extra}")
    };
    format!(
        "{{endpoint: \"{}\", bucket: {}{path}, credentials: {{secretName: s3}}{extra}}}",
        env["S3_ENDPOINT"], env["S3_BUCKET"]
    )
}

/// Overwrites (or creates) object `key` with `bytes`.
pub async fn put(key: &str, bytes: Vec<u8>) {
    store()
        .put(&ObjectPath::from(key), bytes.into())
        .await
        .unwrap_or_else(|e| panic!("writing {key}: {e}"));
}

/// The local S3 server behind TLS with a private CA, as a user's in-house store is: a
/// proxy on `127.0.0.1` that terminates TLS with a certificate of its own CA (SAN
/// 127.0.0.1) and passes the bytes on to the plain server. Runs until dropped.
pub struct TlsProxy {
    /// `https://127.0.0.1:<port>`.
    pub endpoint: String,
    /// The CA that signed the proxy's certificate, PEM.
    pub ca_pem: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl TlsProxy {
    pub fn start() -> Self {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, SanType};
        use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};

        let ca_key = KeyPair::generate().expect("a CA key");
        let mut ca = CertificateParams::default();
        ca.distinguished_name
            .push(rcgen::DnType::CommonName, "castellan test S3 CA");
        ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        let ca_pem = ca.self_signed(&ca_key).expect("the CA certificate").pem();
        let issuer = Issuer::new(ca, ca_key);
        let key = KeyPair::generate().expect("a server key");
        let mut server = CertificateParams::default();
        server.subject_alt_names = vec![SanType::IpAddress([127, 0, 0, 1].into())];
        let certificate = server
            .signed_by(&key, &issuer)
            .expect("the server certificate");
        let config = rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_no_client_auth()
        .with_single_cert(
            vec![certificate.der().clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )
        .expect("the server's TLS configuration");
        let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));

        let upstream = env()["S3_ENDPOINT"]
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_owned();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a port for the proxy");
        listener.set_nonblocking(true).expect("non-blocking");
        let endpoint = format!("https://{}", listener.local_addr().expect("its address"));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        // Its own runtime: the tests wait with blocking calls.
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .expect("the proxy's runtime");
            runtime.block_on(async move {
                let listener =
                    tokio::net::TcpListener::from_std(listener).expect("the proxy's listener");
                let serve = async {
                    loop {
                        let Ok((client, _)) = listener.accept().await else {
                            continue;
                        };
                        let (acceptor, upstream) = (acceptor.clone(), upstream.clone());
                        tokio::spawn(async move {
                            // A client that refuses the certificate ends here.
                            let Ok(mut client) = acceptor.accept(client).await else {
                                return;
                            };
                            let Ok(mut server) = tokio::net::TcpStream::connect(&upstream).await
                            else {
                                return;
                            };
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                        });
                    }
                };
                tokio::select! {
                    () = serve => {}
                    _ = stopped => {}
                }
            });
        });
        Self {
            endpoint,
            ca_pem,
            stop: Some(stop),
        }
    }
}

impl Drop for TlsProxy {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Creates Secret `s3` in `namespace` (`create_secret`) and cluster `name`
/// (`replicas` instances on `class`) archiving to the local server, with `extra` in
/// its `spec.backup`; waits until it is Ready with WAL archiving working. The
/// superuser may log in over the network: the tests read and write as it.
pub fn archiving_cluster(
    namespace: &str,
    name: &str,
    replicas: u32,
    class: &str,
    extra: &str,
    diagnostics: impl Fn() -> String,
) {
    create_secret(namespace);
    super::cluster::apply_cluster(
        namespace,
        name,
        replicas,
        class,
        &format!(
            "  backup: {}\n{SUPERUSER_ACCESS}",
            backup_target(None, extra)
        ),
    );
    wait_until_archiving(namespace, name, replicas, diagnostics);
}

/// Creates Secret `s3` in `namespace` and switches WAL archiving to the local server
/// on for the existing cluster `name` (`kubectl patch`), with `extra` in its
/// `spec.backup`; waits until it is Ready with WAL archiving working.
pub fn switch_archiving_on(
    namespace: &str,
    name: &str,
    replicas: u32,
    extra: &str,
    diagnostics: impl Fn() -> String,
) {
    create_secret(namespace);
    super::kubectl_ok(&[
        "patch",
        "dbc",
        name,
        "-n",
        namespace,
        "--type=merge",
        "-p",
        &format!("spec: {{backup: {}}}", backup_target(None, extra)),
    ]);
    wait_until_archiving(namespace, name, replicas, diagnostics);
}

fn wait_until_archiving(
    namespace: &str,
    name: &str,
    replicas: u32,
    diagnostics: impl Fn() -> String,
) {
    use super::cluster::{condition, phase_and_ready, wait_for};
    wait_for(
        &format!("{name} Ready/{replicas} with archiving"),
        std::time::Duration::from_secs(120),
        || {
            phase_and_ready(namespace, name) == format!("Ready/{replicas}")
                && condition(namespace, name, "ContinuousArchiving") == "True/Archiving"
        },
        diagnostics,
    );
}

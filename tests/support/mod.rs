//! What the end-to-end tests share: a client for the local cluster `make test`
//! started, kubectl, and throwaway namespaces.
#![allow(dead_code)] // each test binary uses a different part of this module

pub mod agent;
pub mod cluster;
pub mod disks;
pub mod faults;
pub mod manifests;
pub mod otel;
pub mod postgres;
pub mod process;
pub mod s3;

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DeleteParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

/// The kubeconfig of the cluster under test. Tests fail, loudly, without one: a suite
/// that silently skips its cluster tests would report green having tested nothing.
pub fn kubeconfig_path() -> PathBuf {
    match std::env::var_os("CASTELLAN_KUBECONFIG") {
        Some(path) => PathBuf::from(path),
        None => panic!(
            "CASTELLAN_KUBECONFIG is not set: run the end-to-end tests with `make test`, \
             or point it at a cluster started with `make up` (.dev/kubeconfig)"
        ),
    }
}

/// The test cluster's client configuration, from [`kubeconfig_path`].
pub async fn config() -> Config {
    let path = kubeconfig_path();
    let kubeconfig = Kubeconfig::read_from(&path)
        .unwrap_or_else(|e| panic!("reading kubeconfig {}: {e}", path.display()));
    Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .unwrap_or_else(|e| panic!("loading kubeconfig {}: {e}", path.display()))
}

pub async fn client() -> Client {
    Client::try_from(config().await).expect("building a client for the test cluster")
}

/// The inodes of process `pid`'s open sockets (`socket:[N]` links in /proc/PID/fd);
/// empty once it has exited.
pub fn socket_inodes(pid: u32) -> std::collections::BTreeSet<String> {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Default::default();
    };
    fds.filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter_map(|target| {
            let target = target.to_string_lossy();
            Some(
                target
                    .strip_prefix("socket:[")?
                    .strip_suffix(']')?
                    .to_owned(),
            )
        })
        .collect()
}

/// The repository root (the package root, which is the repository root for this
/// package). Read when the test runs, not when it was compiled: a test binary from a
/// shared build cache may have been compiled in another checkout.
pub fn repo() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

/// Runs kubectl (the one `make up` built, at the control plane's version) against the
/// test cluster.
pub fn kubectl(args: &[&str]) -> Output {
    let kubectl = kubectl_program();
    Command::new(&kubectl)
        .arg("--kubeconfig")
        .arg(kubeconfig_path())
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", kubectl.display()))
}

/// The kubectl `make up` built, at the control plane's version (else the one on PATH).
pub fn kubectl_program() -> PathBuf {
    kubeconfig_path()
        .parent()
        .map(|dir| dir.join("bin/kubectl"))
        .filter(|path| path.exists())
        .unwrap_or_else(|| PathBuf::from("kubectl"))
}

/// Runs kubectl and returns its stdout, failing the test with stderr if it failed.
pub fn kubectl_ok(args: &[&str]) -> String {
    let output = kubectl(args);
    assert!(
        output.status.success(),
        "kubectl {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// `kubectl auth can-i VERB RESOURCE -n NAMESPACE` with `extra` (`--as=…`,
/// `--subresource=…`): yes or no; anything else (a resource kubectl cannot parse) is a
/// broken check, not a "no", and fails the test.
pub fn can_i(verb: &str, resource: &str, namespace: &str, extra: &[&str]) -> bool {
    let mut args = vec!["auth", "can-i", verb, resource, "-n", namespace];
    args.extend_from_slice(extra);
    let output = kubectl(&args);
    match String::from_utf8_lossy(&output.stdout).trim() {
        "yes" => true,
        "no" => false,
        other => panic!(
            "kubectl {}: {other} {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr)
        ),
    }
}

/// A namespace that lives as long as the value. Deletion is requested on drop and not
/// awaited: namespaces finish deleting in the background.
pub struct TestNamespace {
    pub name: String,
}

impl TestNamespace {
    pub async fn create(client: &Client, prefix: &str) -> Self {
        let api: Api<Namespace> = Api::all(client.clone());
        let name = format!("{prefix}-{}", std::process::id());
        let namespace: Namespace = serde_json::from_value(serde_json::json!({
            "metadata": { "name": name, "labels": { "castellan.io/test": "true" } }
        }))
        .expect("a namespace object");
        api.create(&PostParams::default(), &namespace)
            .await
            .unwrap_or_else(|e| panic!("creating namespace {name}: {e}"));
        Self { name }
    }
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        // A failed test's namespace stays for inspection when asked to.
        if std::thread::panicking() && std::env::var_os("CASTELLAN_KEEP_FAILED").is_some() {
            eprintln!("kept namespace {} (CASTELLAN_KEEP_FAILED)", self.name);
            return;
        }
        let _ = kubectl(&["delete", "namespace", &self.name, "--wait=false"]);
    }
}

pub async fn delete_all<K>(api: &Api<K>)
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let _ = api
        .delete_collection(&DeleteParams::default(), &Default::default())
        .await;
}

/// Polls `check` every 200 ms until it returns `Ok`, or fails the test with `what`
/// and the last thing seen.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        match check().await {
            Ok(value) => return value,
            Err(last) if Instant::now() > deadline => {
                panic!("{what}: never happened; last: {last}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// "N cores, YYYY-MM-DD": what a benchmark's figures were measured on, for its heading.
pub fn machine() -> String {
    let date = Command::new("date")
        .args(["-u", "+%Y-%m-%d"])
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_owned())
        .unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{cores} cores, {date}")
}

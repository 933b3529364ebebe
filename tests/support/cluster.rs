//! DatabaseCluster end-to-end helpers: the operator as a host process, local volumes
//! on the dev nodes, a cluster manifest, waiting on kubectl-visible state, and
//! connections to the instances with the cluster's own credentials.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sqlx::PgConnection;

use super::manifests::operator_kubeconfig;
use super::postgres::{connect, postgres_ids};
use super::{kubectl, kubectl_ok};

pub fn http_get(address: &str, path: &str) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-s", "--max-time", "5", "-w", "\n%{http_code}"])
        .arg(format!("http://{address}{path}"))
        .output()
        .expect("running curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

/// The operator as a host process managing one namespace (its Lease lives there too),
/// acting as the shipped operator's service account with its rights
/// ([`operator_kubeconfig`]), stopped when dropped.
pub struct Operator {
    child: Child,
    pub address: &'static str,
    pub log: PathBuf,
}

impl Operator {
    pub fn start(namespace: &str, address: &'static str) -> Self {
        Self::start_with(namespace, address, &[])
    }

    pub fn start_with(namespace: &str, address: &'static str, extra: &[&str]) -> Self {
        Self::start_with_env(namespace, address, extra, &[])
    }

    pub fn start_with_env(
        namespace: &str,
        address: &'static str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        Self::start_program(
            Path::new(env!("CARGO_BIN_EXE_castellan")),
            namespace,
            address,
            extra,
            env,
        )
    }

    /// [`Operator::start_with_env`] with another build of castellan (a benchmark's
    /// release build).
    pub fn start_program(
        program: &Path,
        namespace: &str,
        address: &'static str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        let (uid, gid) = postgres_ids();
        let (uid, gid) = (uid.to_string(), gid.to_string());
        let log_path =
            std::env::temp_dir().join(format!("operator-{}-{address}.log", std::process::id()));
        let log = std::fs::File::create(&log_path).expect("operator log");
        let child = Command::new(program)
            .args(["operator", "--postgres-uid", &uid, "--postgres-gid", &gid])
            .args(["--metrics-address", address, "--identity", address])
            .args(["--namespace", namespace, "--watch-namespace", namespace])
            .args(extra)
            .env("KUBECONFIG", operator_kubeconfig(namespace))
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .expect("starting castellan operator");
        Self {
            child,
            address,
            log: log_path,
        }
    }

    pub fn is_leader(&self) -> bool {
        http_get(self.address, "/metrics")
            .1
            .contains("castellan_leader 1\n")
    }

    /// The process' id (a benchmark reads its memory and CPU time from /proc).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process still runs.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGTERM, as Kubernetes stops a pod, and wait for the exit.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        self.child.wait().expect("waiting for the operator")
    }

    pub fn logs(operators: &[PathBuf]) -> String {
        operators
            .iter()
            .map(|log| std::fs::read_to_string(log).unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n----\n")
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Local PersistentVolumes, `per_node` on each of the three nodes, in directories
/// owned by postgres, and the `WaitForFirstConsumer` class they belong to; removed
/// when dropped.
pub struct LocalVolumes {
    pub class: String,
    names: Vec<String>,
    root: PathBuf,
    /// The btrfs filesystem the volumes are on, when they are.
    btrfs: Option<super::disks::Btrfs>,
}

impl LocalVolumes {
    pub fn create(prefix: &str, per_node: u32) -> Self {
        let class = format!("{prefix}-{}", std::process::id());
        let root = PathBuf::from(format!("/tmp/{class}"));
        Self::create_in(class, root, per_node, "2Gi", None)
    }

    /// [`LocalVolumes::create`] on a btrfs filesystem of their own (a loop device over a
    /// sparse file), as a StoragePool's volumes are: reflinks work there.
    pub fn create_on_btrfs(prefix: &str, per_node: u32) -> Self {
        Self::create_on_btrfs_sized(prefix, per_node, 4 * 1024 * super::disks::MIB, "2Gi")
    }

    /// [`LocalVolumes::create_on_btrfs`] with the filesystem's size and the volumes'
    /// capacity chosen (a benchmark's database may not fit the defaults).
    pub fn create_on_btrfs_sized(
        prefix: &str,
        per_node: u32,
        filesystem_bytes: u64,
        capacity: &str,
    ) -> Self {
        let class = format!("{prefix}-{}", std::process::id());
        let root = PathBuf::from(format!("/tmp/{class}"));
        let btrfs = super::disks::Btrfs::mount(&root, filesystem_bytes);
        Self::create_in(class, root, per_node, capacity, Some(btrfs))
    }

    /// Bytes the volumes' btrfs filesystem holds (`btrfs filesystem usage`, "Used"),
    /// after writing out what is still in memory: its usage counts allocated extents.
    /// Panics for volumes that are not on btrfs.
    pub fn used_bytes(&self) -> u64 {
        assert!(self.btrfs.is_some(), "{}: not on btrfs", self.class);
        let root = self.root.to_string_lossy();
        super::disks::run("btrfs", &["filesystem", "sync", &root]);
        let usage = super::disks::run("btrfs", &["filesystem", "usage", "-b", &root]);
        usage
            .lines()
            .find_map(|line| line.trim().strip_prefix("Used:"))
            .and_then(|value| value.trim().parse().ok())
            .unwrap_or_else(|| panic!("no Used: in btrfs filesystem usage:\n{usage}"))
    }

    fn create_in(
        class: String,
        root: PathBuf,
        per_node: u32,
        capacity: &str,
        btrfs: Option<super::disks::Btrfs>,
    ) -> Self {
        let (uid, gid) = postgres_ids();
        let mut manifests = format!(
            "apiVersion: storage.k8s.io/v1\nkind: StorageClass\nmetadata: {{name: {class}}}\n\
             provisioner: kubernetes.io/no-provisioner\nvolumeBindingMode: WaitForFirstConsumer\n"
        );
        let mut names = Vec::new();
        for node in 1..=3 {
            for volume in 1..=per_node {
                let dir = root.join(format!("node-{node}-{volume}"));
                std::fs::create_dir_all(&dir).expect("volume directory");
                std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
                    .expect("chmod");
                let status = Command::new("chown")
                    .arg(format!("{uid}:{gid}"))
                    .arg(&dir)
                    .status()
                    .expect("chown");
                assert!(status.success());
                let name = format!("{class}-node-{node}-{volume}");
                manifests.push_str(&format!(
                    "---\napiVersion: v1\nkind: PersistentVolume\nmetadata: {{name: {name}}}\nspec:\n  \
                     capacity: {{storage: {capacity}}}\n  accessModes: [ReadWriteOnce]\n  \
                     persistentVolumeReclaimPolicy: Retain\n  storageClassName: {class}\n  \
                     local: {{path: {}}}\n  nodeAffinity:\n    required:\n      nodeSelectorTerms:\n      \
                     - matchExpressions: [{{key: kubernetes.io/hostname, operator: In, values: [node-{node}]}}]\n",
                    dir.display()
                ));
                names.push(name);
            }
        }
        let file = std::env::temp_dir().join(format!("{class}.yaml"));
        std::fs::write(&file, manifests).expect("writing manifests");
        kubectl_ok(&["apply", "-f", file.to_str().expect("utf-8 path")]);
        let _ = std::fs::remove_file(&file);
        Self {
            class,
            names,
            root,
            btrfs,
        }
    }
}

impl Drop for LocalVolumes {
    fn drop(&mut self) {
        // Kept with a failed test's namespace (see `TestNamespace`).
        if std::thread::panicking() && std::env::var_os("CASTELLAN_KEEP_FAILED").is_some() {
            return;
        }
        for name in &self.names {
            let _ = kubectl(&["delete", "pv", name, "--wait=false"]);
        }
        let _ = kubectl(&["delete", "storageclass", &self.class, "--wait=false"]);
        let _ = std::fs::remove_dir_all(&self.root);
        // Unmounted and detached after the directories went.
        if self.btrfs.take().is_some() {
            let _ = std::fs::remove_dir(&self.root);
        }
    }
}

/// `kubectl apply`s a PostgreSQL DatabaseCluster with database `shop` owned by
/// `clerk`; `extra_spec` is more YAML under `spec:` (two-space indented lines).
pub fn apply_cluster(namespace: &str, name: &str, replicas: u32, class: &str, extra_spec: &str) {
    apply_cluster_of(namespace, name, "15", replicas, class, extra_spec);
}

/// [`apply_cluster`] of PostgreSQL `version`.
pub fn apply_cluster_of(
    namespace: &str,
    name: &str,
    version: &str,
    replicas: u32,
    class: &str,
    extra_spec: &str,
) {
    apply_manifest(
        namespace,
        name,
        &format!(
            "apiVersion: castellan.io/v1alpha1\nkind: DatabaseCluster\nmetadata: {{name: {name}}}\nspec:\n  \
             engine: postgresql\n  version: \"{version}\"\n  replicas: {replicas}\n  \
             storage: {{size: 1Gi, storageClassName: {class}}}\n  \
             bootstrap: {{initdb: {{database: shop, owner: clerk}}}}\n{extra_spec}"
        ),
    );
}

/// `kubectl apply`s `yaml` in `namespace` (through a file named after `name`).
pub fn apply_manifest(namespace: &str, name: &str, yaml: &str) -> String {
    let manifest = std::env::temp_dir().join(format!("{namespace}-{name}.yaml"));
    std::fs::write(&manifest, yaml).expect("writing the manifest");
    let applied = kubectl_ok(&[
        "apply",
        "-f",
        manifest.to_str().expect("utf-8 path"),
        "-n",
        namespace,
    ]);
    let _ = std::fs::remove_file(&manifest);
    applied
}

/// The line of `spec` that lets the tests log in as the superuser over the network
/// (off by default), for `apply_cluster`'s `extra_spec`.
pub const SUPERUSER_ACCESS: &str = "  enableSuperuserAccess: true\n";

/// A superuser connection to instance `pod` of `cluster` (its spec must allow it:
/// [`SUPERUSER_ACCESS`]), or why there is none (yet).
pub async fn try_superuser(
    namespace: &str,
    cluster: &str,
    pod: &str,
) -> Result<PgConnection, String> {
    let address = instance_addresses(namespace, cluster)
        .into_iter()
        .find(|(name, _)| name == pod)
        .map(|(_, ip)| ip)
        .ok_or_else(|| format!("{pod} has no address"))?;
    let password = secret_value(namespace, &format!("{cluster}-superuser"), "password");
    super::postgres::try_connect(&address, "postgres", &password, "shop").await
}

/// `status/reason` of condition `type_` of a DatabaseCluster, e.g. `True/Archiving`.
pub fn condition(namespace: &str, cluster: &str, type_: &str) -> String {
    jsonpath(
        "dbc",
        cluster,
        namespace,
        &format!(
            "{{.status.conditions[?(@.type==\"{type_}\")].status}}/{{.status.conditions[?(@.type==\"{type_}\")].reason}}"
        ),
    )
}

/// The message of a cluster's condition `type_` (empty when it has none).
pub fn condition_message(namespace: &str, cluster: &str, type_: &str) -> String {
    jsonpath(
        "dbc",
        cluster,
        namespace,
        &format!("{{.status.conditions[?(@.type==\"{type_}\")].message}}"),
    )
}

pub fn jsonpath(kind: &str, name: &str, namespace: &str, path: &str) -> String {
    let output = kubectl(&[
        "get",
        kind,
        name,
        "-n",
        namespace,
        "-o",
        &format!("jsonpath={path}"),
    ]);
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Polls `check` every half second; fails with `diagnostics` after `timeout`.
pub fn wait_for(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> bool,
    diagnostics: impl Fn() -> String,
) {
    let deadline = Instant::now() + timeout;
    while !check() {
        assert!(
            Instant::now() < deadline,
            "{what} within {timeout:?}\n{}",
            diagnostics()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The messages of the Events with `reason` in `namespace`, one a line (an Event in the
/// events.k8s.io form carries it as `note`).
pub fn events(namespace: &str, reason: &str) -> String {
    kubectl_ok(&[
        "get",
        "events",
        "-n",
        namespace,
        "--field-selector",
        &format!("reason={reason}"),
        "-o",
        "jsonpath={range .items[*]}{.note}{.message}{\"\\n\"}{end}",
    ])
}

/// The messages of the Events with `reason` in `namespace` once one of them contains
/// `needle` (any, when empty), waiting up to 20 s: an Event is posted beside the status
/// write that a test usually waits for, not necessarily before it.
pub fn events_with(namespace: &str, reason: &str, needle: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let found = events(namespace, reason);
        if (!found.is_empty() && found.contains(needle)) || Instant::now() >= deadline {
            return found;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The messages of Events with `reason` about object `name`, in `namespace` (every
/// namespace when empty: a pool's Events land in `default`), once there is one.
pub fn events_about(namespace: &str, name: &str, reason: &str) -> String {
    events_matching(
        namespace,
        &format!("involvedObject.name={name},reason={reason}"),
    )
}

/// [`events_about`] an object of `kind` only: a claim and its volume may share a name,
/// and Events about a cluster-scoped object (a PersistentVolume) land in `default`.
pub fn events_regarding(namespace: &str, kind: &str, name: &str, reason: &str) -> String {
    events_matching(
        namespace,
        &format!("involvedObject.kind={kind},involvedObject.name={name},reason={reason}"),
    )
}

/// The messages of the Events in `namespace` (every one when empty) that the field
/// `selector` picks, once there is one.
fn events_matching(namespace: &str, selector: &str) -> String {
    let scope = if namespace.is_empty() {
        vec!["-A"]
    } else {
        vec!["-n", namespace]
    };
    let mut args = vec!["get", "events"];
    args.extend(scope);
    args.extend([
        "--field-selector",
        selector,
        "-o",
        "jsonpath={.items[*].message}",
    ]);
    // An Event may be recorded a moment after the change it reports: 10 s at most.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let messages = kubectl_ok(&args);
        if !messages.trim().is_empty() || Instant::now() > deadline {
            return messages;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `phase/readyInstances` of a cluster, e.g. `Ready/3`.
pub fn phase_and_ready(namespace: &str, name: &str) -> String {
    jsonpath(
        "dbc",
        name,
        namespace,
        "{.status.phase}/{.status.readyInstances}",
    )
}

/// The objects and Events of a namespace, the last lines of each pod's log (its
/// instance manager's, for a database pod), and the operators' logs, for a failure
/// message.
pub fn describe(namespace: &str, operator_logs: &[PathBuf]) -> String {
    let pods = kubectl(&["get", "pods", "-n", namespace, "-o", "name"]);
    let pod_logs: Vec<String> = String::from_utf8_lossy(&pods.stdout)
        .lines()
        .map(|pod| {
            let tail = kubectl(&["logs", "--tail=40", "-n", namespace, pod]);
            format!(
                "---- {pod} (last 40 lines)\n{}{}",
                String::from_utf8_lossy(&tail.stdout),
                String::from_utf8_lossy(&tail.stderr)
            )
        })
        .collect();
    format!(
        "{}\n{}\n{}\n----\n{}",
        String::from_utf8_lossy(
            &kubectl(&["get", "dbc,pods,pvc,svc", "-n", namespace, "-o", "wide"]).stdout
        ),
        String::from_utf8_lossy(&kubectl(&["get", "events", "-n", namespace]).stdout),
        pod_logs.join("\n"),
        Operator::logs(operator_logs)
    )
}

/// A key of a Secret, decoded.
pub fn secret_value(namespace: &str, secret: &str, key: &str) -> String {
    // A key such as `ca.crt` needs its dot escaped in JSONPath.
    let key = key.replace('.', "\\.");
    let encoded = jsonpath("secret", secret, namespace, &format!("{{.data.{key}}}"));
    let out = Command::new("base64")
        .arg("-d")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child
                .stdin
                .take()
                .expect("stdin")
                .write_all(encoded.as_bytes())?;
            child.wait_with_output()
        });
    String::from_utf8_lossy(&out.expect("decoding a secret").stdout).into_owned()
}

/// A connection to `host` as the application user of cluster `name`.
pub async fn connect_app(namespace: &str, name: &str, host: &str) -> PgConnection {
    let password = secret_value(namespace, &format!("{name}-app"), "password");
    connect(host, "clerk", &password, "shop").await
}

/// Pod name → pod IP of every instance of cluster `name`.
pub fn instance_addresses(namespace: &str, name: &str) -> Vec<(String, String)> {
    let out = kubectl_ok(&[
        "get",
        "pods",
        "-n",
        namespace,
        "-l",
        &format!("castellan.io/cluster={name}"),
        "-o",
        "jsonpath={range .items[*]}{.metadata.name} {.status.podIP}{\"\\n\"}{end}",
    ]);
    out.lines()
        .filter_map(|line| {
            let (pod, ip) = line.split_once(' ')?;
            Some((pod.to_owned(), ip.to_owned()))
        })
        .collect()
}

/// Waits until the test table `orders` has `rows` rows on the connection's server.
pub async fn wait_orders(connection: &mut PgConnection, rows: i64, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let found = sqlx::query_scalar::<_, i64>("select count(*) from orders")
            .fetch_one(&mut *connection)
            .await
            .unwrap_or(-1);
        if found == rows {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {found} rows in orders, expected {rows}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
/// The image catalog's entry for `major` in the operator's namespace.
pub fn catalog_image(namespace: &str, major: &str) -> String {
    jsonpath(
        "configmap",
        "castellan-images",
        namespace,
        &format!("{{.data.{major}}}"),
    )
}

/// Waits until the operator has made its image catalog (with the built images).
pub fn wait_for_catalog(namespace: &str, diagnostics: impl Fn() -> String) {
    wait_for(
        "the operator makes the image catalog",
        Duration::from_secs(60),
        || !catalog_image(namespace, "15").is_empty(),
        diagnostics,
    );
}

/// Sets the image catalog's entry for `major`, as a user edits it.
pub fn set_catalog_image(namespace: &str, major: &str, image: &str) {
    kubectl_ok(&[
        "patch",
        "configmap",
        "castellan-images",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        &format!(r#"{{"data":{{"{major}":"{image}"}}}}"#),
    ]);
}

/// `show server_version` on every instance of `cluster`, by pod.
pub async fn server_versions(namespace: &str, cluster: &str) -> Vec<(String, String)> {
    let mut versions = Vec::new();
    for (pod, ip) in instance_addresses(namespace, cluster) {
        let mut connection = connect_app(namespace, cluster, &ip).await;
        let version: String = sqlx::query_scalar("show server_version")
            .fetch_one(&mut connection)
            .await
            .expect("server_version");
        versions.push((pod, version));
    }
    versions
}

/// Deletes a cluster and waits until its pods are gone, so that what comes next (a
/// benchmark's next run) is measured on nodes that run nothing else.
pub fn delete_cluster(ns: &str, name: &str) {
    kubectl_ok(&["delete", "dbc", name, "-n", ns, "--timeout=120s"]);
    let selector = format!("castellan.io/cluster={name}");
    wait_for(
        &format!("{name}'s pods gone"),
        Duration::from_secs(120),
        || {
            kubectl_ok(&["get", "pods", "-n", ns, "-l", &selector, "-o", "name"])
                .trim()
                .is_empty()
        },
        String::new,
    );
}

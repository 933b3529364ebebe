//! The DatabaseCluster controller end to end on the local cluster's process-backed
//! nodes: `kubectl apply` a two-instance PostgreSQL cluster and it becomes Ready, with
//! its credentials Secret, its Services following the roles, and a row written through
//! `-rw` readable through `-ro`; deleting it removes what it owned.

mod support;

use support::operator::{Operator, http_get};
use support::postgres::{connect, postgres_ids};

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::{TestNamespace, client, kubectl, kubectl_ok};

/// Where the test's two operators serve /healthz, /readyz and /metrics (also their
/// identities in the leader Lease).
const METRICS_ADDRESSES: [&str; 2] = ["127.0.60.1:8080", "127.0.60.2:8080"];

/// Local PersistentVolumes, one per node, in directories owned by postgres, and the
/// `WaitForFirstConsumer` class they belong to; removed when dropped.
struct LocalVolumes {
    class: String,
    names: Vec<String>,
    root: PathBuf,
}

impl LocalVolumes {
    fn create(prefix: &str) -> Self {
        let class = format!("{prefix}-{}", std::process::id());
        let root = PathBuf::from(format!("/tmp/{class}"));
        let (uid, gid) = postgres_ids();
        let mut manifests = format!(
            "apiVersion: storage.k8s.io/v1\nkind: StorageClass\nmetadata: {{name: {class}}}\n\
             provisioner: kubernetes.io/no-provisioner\nvolumeBindingMode: WaitForFirstConsumer\n"
        );
        let mut names = Vec::new();
        for node in 1..=3 {
            let dir = root.join(format!("node-{node}"));
            std::fs::create_dir_all(&dir).expect("volume directory");
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).expect("chmod");
            let status = Command::new("chown")
                .arg(format!("{uid}:{gid}"))
                .arg(&dir)
                .status()
                .expect("chown");
            assert!(status.success());
            let name = format!("{class}-node-{node}");
            manifests.push_str(&format!(
                "---\napiVersion: v1\nkind: PersistentVolume\nmetadata: {{name: {name}}}\nspec:\n  \
                 capacity: {{storage: 2Gi}}\n  accessModes: [ReadWriteOnce]\n  \
                 persistentVolumeReclaimPolicy: Retain\n  storageClassName: {class}\n  \
                 local: {{path: {}}}\n  nodeAffinity:\n    required:\n      nodeSelectorTerms:\n      \
                 - matchExpressions: [{{key: kubernetes.io/hostname, operator: In, values: [node-{node}]}}]\n",
                dir.display()
            ));
            names.push(name);
        }
        let file = std::env::temp_dir().join(format!("{class}.yaml"));
        std::fs::write(&file, manifests).expect("writing manifests");
        kubectl_ok(&["apply", "-f", file.to_str().expect("utf-8 path")]);
        Self { class, names, root }
    }
}

impl Drop for LocalVolumes {
    fn drop(&mut self) {
        for name in &self.names {
            let _ = kubectl(&["delete", "pv", name, "--wait=false"]);
        }
        let _ = kubectl(&["delete", "storageclass", &self.class, "--wait=false"]);
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

fn jsonpath(kind: &str, name: &str, namespace: &str, path: &str) -> String {
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

fn wait_for(
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

#[tokio::test(flavor = "multi_thread")]
async fn a_two_instance_cluster_becomes_ready_and_replicates() {
    let client = client().await;
    let namespace = TestNamespace::create(&client, "dbc").await;
    let ns = namespace.name.clone();
    let volumes = LocalVolumes::create("dbc-local");
    // Two replicas of the operator: only the one holding the Lease acts.
    let mut operators = vec![
        Operator::start(&ns, METRICS_ADDRESSES[0]),
        Operator::start(&ns, METRICS_ADDRESSES[1]),
    ];
    let logs: Vec<PathBuf> = operators.iter().map(|o| o.log.clone()).collect();
    let operator_log = || {
        logs.iter()
            .map(|log| std::fs::read_to_string(log).unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n----\n")
    };

    let manifest = std::env::temp_dir().join(format!("dbc-{}.yaml", std::process::id()));
    std::fs::write(
        &manifest,
        format!(
            "apiVersion: castellan.io/v1alpha1\nkind: DatabaseCluster\nmetadata: {{name: shop}}\nspec:\n  \
             engine: postgresql\n  version: \"15\"\n  replicas: 2\n  \
             storage: {{size: 1Gi, storageClassName: {}}}\n  \
             bootstrap: {{initdb: {{database: shop, owner: clerk}}}}\n",
            volumes.class
        ),
    )
    .expect("writing the manifest");
    let started = Instant::now();
    kubectl_ok(&[
        "apply",
        "-f",
        manifest.to_str().expect("utf-8 path"),
        "-n",
        &ns,
    ]);

    let diagnostics = || {
        format!(
            "{}\n{}\n{}",
            String::from_utf8_lossy(
                &kubectl(&["get", "dbc,pods,pvc,svc", "-n", &ns, "-o", "wide"]).stdout
            ),
            String::from_utf8_lossy(&kubectl(&["get", "events", "-n", &ns]).stdout),
            operator_log()
        )
    };
    wait_for(
        "the cluster is Ready with 2 ready instances",
        Duration::from_secs(180),
        || {
            jsonpath(
                "dbc",
                "shop",
                &ns,
                "{.status.phase}/{.status.readyInstances}",
            ) == "Ready/2"
        },
        diagnostics,
    );
    println!(
        "kubectl apply to Ready (2 instances): {:.1} s",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(
        jsonpath("dbc", "shop", &ns, "{.status.currentPrimary}"),
        "shop-1"
    );
    assert_eq!(
        jsonpath(
            "dbc",
            "shop",
            &ns,
            "{.status.conditions[?(@.type==\"Ready\")].status}"
        ),
        "True"
    );
    let nodes = kubectl_ok(&[
        "get",
        "pods",
        "-n",
        &ns,
        "-o",
        "jsonpath={.items[*].spec.nodeName}",
    ]);
    let nodes: Vec<&str> = nodes.split_whitespace().collect();
    assert_eq!(nodes.len(), 2);
    assert_ne!(nodes[0], nodes[1], "instances spread across nodes");

    // The application's credentials, ready to use.
    let secret = |key: &str| {
        let encoded = jsonpath("secret", "shop-app", &ns, &format!("{{.data.{key}}}"));
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
    };
    let password = secret("password");
    assert!(
        secret("uri").starts_with("postgresql://clerk:"),
        "the app secret carries a URI"
    );

    // Through the Services' cluster addresses, as an application would connect.
    let rw = jsonpath("svc", "shop-rw", &ns, "{.spec.clusterIP}");
    let ro = jsonpath("svc", "shop-ro", &ns, "{.spec.clusterIP}");
    let mut primary = connect(&rw, "clerk", &password, "shop").await;
    sqlx::query("create table orders (id int primary key)")
        .execute(&mut primary)
        .await
        .expect("create");
    sqlx::query("insert into orders values (1)")
        .execute(&mut primary)
        .await
        .expect("insert");
    let in_recovery: bool = sqlx::query_scalar("select pg_is_in_recovery()")
        .fetch_one(&mut primary)
        .await
        .expect("query");
    assert!(!in_recovery, "-rw reaches the primary");
    let mut replica = connect(&ro, "clerk", &password, "shop").await;
    let in_recovery: bool = sqlx::query_scalar("select pg_is_in_recovery()")
        .fetch_one(&mut replica)
        .await
        .expect("query");
    assert!(in_recovery, "-ro reaches a replica");
    let deadline = Instant::now() + Duration::from_secs(10);
    while sqlx::query_scalar::<_, i64>("select count(*) from orders")
        .fetch_one(&mut replica)
        .await
        .unwrap_or(0)
        != 1
    {
        assert!(
            Instant::now() < deadline,
            "the row replicates to the replica"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop((primary, replica));

    // The operators' own endpoints; exactly one of them leads.
    let leaders: Vec<usize> = (0..2).filter(|i| operators[*i].is_leader()).collect();
    assert_eq!(
        leaders.len(),
        1,
        "exactly one operator leads:\n{}",
        operator_log()
    );
    let leader = leaders[0];
    for operator in &operators {
        assert_eq!(http_get(operator.address, "/healthz").0, 200);
        assert_eq!(
            http_get(operator.address, "/readyz").0,
            200,
            "the operator reaches the API server"
        );
    }
    let (code, metrics) = http_get(operators[leader].address, "/metrics");
    assert_eq!(code, 200);
    assert!(
        metrics.contains("castellan_instances_created_total 2\n"),
        "{metrics}"
    );
    let (_, standby_metrics) = http_get(operators[1 - leader].address, "/metrics");
    assert!(
        standby_metrics.contains("castellan_reconciles_total 0\n"),
        "the operator without the lease does nothing: {standby_metrics}"
    );

    // The leader is lost: the other takes the lease over and acts. A deleted replica
    // pod is recreated on its volume and the cluster is Ready again.
    let survivor = operators.remove(1 - leader);
    drop(operators);
    wait_for(
        "the surviving operator takes the lease over",
        Duration::from_secs(40),
        || survivor.is_leader(),
        diagnostics,
    );
    kubectl_ok(&[
        "delete",
        "pod",
        "shop-2",
        "-n",
        &ns,
        "--wait=true",
        "--timeout=60s",
    ]);
    wait_for(
        "the replica pod is back and the cluster Ready",
        Duration::from_secs(120),
        || {
            jsonpath(
                "dbc",
                "shop",
                &ns,
                "{.status.phase}/{.status.readyInstances}",
            ) == "Ready/2"
                && !jsonpath("pod", "shop-2", &ns, "{.metadata.uid}").is_empty()
        },
        diagnostics,
    );
    assert!(
        http_get(survivor.address, "/metrics")
            .1
            .contains("castellan_instances_created_total 1\n"),
        "the new leader recreated the pod"
    );

    // Voluntary disruptions may not take the primary, nor more than one replica.
    assert_eq!(
        jsonpath("pdb", "shop-primary", &ns, "{.spec.minAvailable}"),
        "1"
    );
    assert_eq!(jsonpath("pdb", "shop", &ns, "{.spec.minAvailable}"), "0");

    // Status shows every instance with its role and position.
    wait_for(
        "status lists both instances with LSNs",
        Duration::from_secs(30),
        || {
            jsonpath("dbc", "shop", &ns, "{.status.instances[*].lsn}")
                .split_whitespace()
                .count()
                == 2
        },
        diagnostics,
    );
    assert_eq!(
        jsonpath("dbc", "shop", &ns, "{.status.instances[*].role}"),
        "primary replica"
    );

    // Deleting the cluster removes what it owned.
    kubectl_ok(&[
        "delete",
        "dbc",
        "shop",
        "-n",
        &ns,
        "--wait=true",
        "--timeout=60s",
    ]);
    wait_for(
        "owned objects are gone",
        Duration::from_secs(120),
        || {
            let left = kubectl(&[
                "get",
                "pods,pvc,svc,secrets,pdb",
                "-n",
                &ns,
                "-l",
                "castellan.io/cluster=shop",
                "-o",
                "name",
            ]);
            String::from_utf8_lossy(&left.stdout).trim().is_empty()
        },
        diagnostics,
    );
    drop(survivor);
    drop(volumes);
}

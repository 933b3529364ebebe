//! End-to-end: a three-instance PostgreSQL DatabaseCluster on a StoragePool's
//! StorageClass becomes Ready, each instance's data in a btrfs subvolume of the pool on
//! its own node, with a quota of the cluster's storage size; and a cluster that names no
//! class waits with `VolumesBound=False` (`NoStorageClass`) until a pool's class is made
//! the default, then becomes Ready on it, while one naming a class that does not exist
//! says so (`StorageClassNotFound`). Needs root, the local cluster in
//! `CASTELLAN_KUBECONFIG` with its three nodes, and PostgreSQL 15.
//!
//! The agent runs as the DaemonSet (`deploy/local/agent.sh up`); the operator as a host
//! process scoped to the test's namespace, as in tests/operator.rs.

mod support;

use support::agent::{agent_up, dev_dir};
use support::cluster::{Operator, condition_message, describe, jsonpath};
use support::disks::{Loops, MIB, run, sparse_file};
use support::{TestNamespace, client, eventually, kubectl, kubectl_ok};

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use castellan_crds::storage_pool::StoragePool;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::api::{Api, ListParams, PostParams};

const NODES: [&str; 3] = ["node-1", "node-2", "node-3"];

/// Removes the pool and the node label, also when the test fails (declared after the
/// loop devices and the namespace, so it runs first).
struct Teardown {
    loops: Loops,
    pool: String,
    /// The node label the pool selects (each test its own, as they run side by side).
    label: &'static str,
    dev: PathBuf,
    namespace: String,
    /// The `/dev/disk/by-id` links the test made, as udev would.
    links: Vec<PathBuf>,
}

impl Drop for Teardown {
    fn drop(&mut self) {
        // Claims first: a bound volume is not released, and the pool waits for its volumes.
        let _ = kubectl(&["delete", "namespace", &self.namespace, "--timeout=90s"]);
        let selector = format!("castellan.io/pool={}", self.pool);
        let _ = kubectl(&["delete", "pv", "-l", &selector, "--timeout=60s"]);
        let _ = kubectl(&["delete", "storagepool", &self.pool, "--timeout=60s"]);
        for node in NODES {
            let _ = kubectl(&["label", "node", node, &format!("{}-", self.label)]);
            let mount = self.dev.join("pools").join(node).join(&self.pool);
            let _ = std::process::Command::new("umount").arg(&mount).status();
        }
        for link in &self.links {
            let _ = std::fs::remove_file(link);
        }
        // Detached before their objects are deleted, or the agent would report them again.
        std::mem::take(&mut self.loops);
        let devices = kubectl(&[
            "get",
            "blockdevices",
            "-o",
            "jsonpath={range .items[*]}{.metadata.name} {.spec.identity}{\"\\n\"}{end}",
        ]);
        for line in String::from_utf8_lossy(&devices.stdout).lines() {
            if let Some((name, identity)) = line.split_once(' ')
                && identity.contains(&format!("/{}.img", self.pool))
            {
                let _ = kubectl(&["delete", "blockdevice", name, "--wait=false"]);
            }
        }
    }
}

/// One 1 GiB disk per node and a `single` pool named after the teardown's pool over the
/// three of them, publishing a StorageClass of the same name (the cluster's default when
/// `default`); returns once the pool is Ready on the three nodes.
async fn single_pool(client: &kube::Client, teardown: &mut Teardown, default: bool) {
    let pool_name = teardown.pool.clone();
    let mut nodes = Vec::new();
    for node in NODES {
        let dir = teardown.dev.join("disks").join(node);
        std::fs::create_dir_all(&dir).expect("creating the node's disk directory");
        let path =
            teardown
                .loops
                .attach(&sparse_file(&dir, &format!("{pool_name}.img"), 1024 * MIB));
        // Node 1's disk is listed by a /dev/disk/by-id link, as a user names a disk
        // whose /dev/sdX may change; there is no udevd here, so the test makes the link
        // as udev would (relative, to the loop device).
        let listed = if node == NODES[0] {
            let dir = Path::new("/dev/disk/by-id");
            std::fs::create_dir_all(dir).expect("creating /dev/disk/by-id");
            let link = dir.join(format!("castellan-test-{pool_name}-{node}"));
            let _ = std::fs::remove_file(&link);
            let target = Path::new("../..").join(path.trim_start_matches("/dev/"));
            std::os::unix::fs::symlink(&target, &link).expect("linking the disk by id");
            teardown.links.push(link.clone());
            link.to_string_lossy().into_owned()
        } else {
            path
        };
        nodes.push(serde_json::json!({ "name": node, "paths": [listed] }));
        kubectl_ok(&[
            "label",
            "--overwrite",
            "node",
            node,
            &format!("{}=true", teardown.label),
        ]);
    }
    let pools = Api::<StoragePool>::all(client.clone());
    let pool: StoragePool = serde_json::from_value(serde_json::json!({
        "apiVersion": "castellan.io/v1alpha1",
        "kind": "StoragePool",
        "metadata": { "name": pool_name },
        "spec": {
            "nodeSelector": { "matchLabels": { teardown.label: "true" } },
            "devices": { "nodes": nodes },
            "layout": "single",
            "storageClass": { "name": pool_name, "reclaimPolicy": "Delete", "default": default },
        }
    }))
    .expect("a StoragePool");
    pools
        .create(&PostParams::default(), &pool)
        .await
        .expect("creating the pool");
    eventually(
        "the pool Ready on 3 nodes",
        Duration::from_secs(90),
        || async {
            let status = pools
                .get(&pool_name)
                .await
                .map_err(|e| e.to_string())?
                .status
                .unwrap_or_default();
            match (status.phase.as_deref(), status.ready_nodes) {
                (Some("Ready"), Some(3)) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_three_instance_cluster_on_a_pool_keeps_its_data_in_subvolumes() {
    let client = client().await;
    let dev = dev_dir();
    agent_up(&dev);
    let pool_name = format!("db-{}", std::process::id());
    let namespace = TestNamespace::create(&client, "dbpool").await;
    let ns = namespace.name.clone();
    let mut teardown = Teardown {
        loops: Loops::default(),
        pool: pool_name.clone(),
        label: "castellan.io/test-database",
        dev: dev.clone(),
        namespace: ns.clone(),
        links: Vec::new(),
    };

    // One 1 GiB disk per node, a `single` pool on the three of them.
    single_pool(&client, &mut teardown, false).await;

    let _operator = Operator::start(&ns, "127.0.65.1:8080");
    let manifest = format!(
        "apiVersion: castellan.io/v1alpha1\nkind: DatabaseCluster\nmetadata: {{name: ledger}}\nspec:\n  \
         engine: postgresql\n  version: \"15\"\n  replicas: 3\n  \
         storage: {{size: 512Mi, storageClassName: {pool_name}}}\n  \
         bootstrap: {{initdb: {{database: ledger, owner: clerk}}}}\n"
    );
    let file = std::env::temp_dir().join(format!("ledger-{}.yaml", std::process::id()));
    std::fs::write(&file, manifest).expect("writing the manifest");
    let started = Instant::now();
    kubectl_ok(&["apply", "-n", &ns, "-f", &file.to_string_lossy()]);
    eventually(
        "the cluster Ready with 3 instances",
        Duration::from_secs(240),
        || async {
            let out = kubectl(&[
                "get",
                "dbc",
                "ledger",
                "-n",
                &ns,
                "-o",
                "jsonpath={.status.phase}/{.status.readyInstances}",
            ]);
            let state = String::from_utf8_lossy(&out.stdout).into_owned();
            if state == "Ready/3" {
                Ok(())
            } else {
                let pods = kubectl(&["get", "pods,pvc", "-n", &ns, "-o", "wide"]);
                Err(format!(
                    "{state}\n{}",
                    String::from_utf8_lossy(&pods.stdout)
                ))
            }
        },
    )
    .await;
    println!(
        "kubectl apply → Ready (3 instances on pool volumes): {:.1} s",
        started.elapsed().as_secs_f64()
    );

    // Every instance's claim is a subvolume of the pool on its pod's node, with a
    // 512 MiB quota, holding a PostgreSQL data directory.
    let claims = Api::<PersistentVolumeClaim>::namespaced(client.clone(), &ns)
        .list(&ListParams::default())
        .await
        .expect("listing the claims");
    assert_eq!(claims.items.len(), 3, "one claim per instance");
    let volumes = Api::<PersistentVolume>::all(client.clone());
    let mut seen_nodes = Vec::new();
    for claim in &claims.items {
        let pv_name = claim
            .spec
            .as_ref()
            .and_then(|spec| spec.volume_name.clone())
            .expect("the claim is bound");
        let pv = volumes.get(&pv_name).await.expect("reading the PV");
        let node = pv
            .metadata
            .labels
            .as_ref()
            .and_then(|labels| labels.get("castellan.io/node").cloned())
            .expect("the PV names its node");
        let path = PathBuf::from(&pv.spec.expect("a PV spec").local.expect("a local PV").path);
        assert_eq!(
            path,
            dev.join("pools")
                .join(&node)
                .join(&pool_name)
                .join("volumes")
                .join(&pv_name)
        );
        let found = run(
            "find",
            &[
                &path.to_string_lossy(),
                "-maxdepth",
                "3",
                "-name",
                "PG_VERSION",
            ],
        );
        assert!(
            !found.trim().is_empty(),
            "no PostgreSQL data directory in {}",
            path.display()
        );
        let quota = run(
            "btrfs",
            &["qgroup", "show", "-re", "--raw", &path.to_string_lossy()],
        );
        assert!(
            quota.contains(&(512 * MIB).to_string()),
            "no 512 MiB quota on {}: {quota}",
            path.display()
        );
        seen_nodes.push(node);
    }
    seen_nodes.sort();
    assert_eq!(seen_nodes, NODES, "one instance per node");
    // Each node's agent tells the volumes their pool's health, and the cluster says it.
    eventually(
        "VolumesHealthy=True from the agents' reports on the claims",
        Duration::from_secs(60),
        || async {
            let out = kubectl(&[
                "get",
                "dbc",
                "ledger",
                "-n",
                &ns,
                "-o",
                "jsonpath={.status.conditions[?(@.type==\"VolumesHealthy\")].status}/{.status.conditions[?(@.type==\"VolumesHealthy\")].reason}/{.status.conditions[?(@.type==\"VolumesHealthy\")].message}",
            ]);
            let condition = String::from_utf8_lossy(&out.stdout).into_owned();
            if condition
                == "True/PoolHealthy/the pools under 3 of 3 volumes are healthy on their nodes"
            {
                Ok(())
            } else {
                Err(condition)
            }
        },
    )
    .await;
    for claim in &claims.items {
        let claim = Api::<PersistentVolumeClaim>::namespaced(client.clone(), &ns)
            .get(&claim.metadata.name.clone().unwrap_or_default())
            .await
            .expect("reading the claim");
        assert_eq!(
            claim
                .metadata
                .annotations
                .unwrap_or_default()
                .get("castellan.io/pool-health")
                .map(String::as_str),
            Some("Healthy")
        );
    }
    kubectl_ok(&["delete", "dbc", "ledger", "-n", &ns, "--timeout=120s"]);
    let _ = kubectl(&["delete", "pvc", "--all", "-n", &ns, "--timeout=60s"]);
}

/// `kubectl apply`s a one-instance cluster `name`, naming `class` or, without one, no
/// StorageClass at all.
fn apply_small_cluster(namespace: &str, name: &str, class: Option<&str>) {
    let storage = match class {
        Some(class) => format!("{{size: 256Mi, storageClassName: {class}}}"),
        None => "{size: 256Mi}".to_owned(),
    };
    let file = std::env::temp_dir().join(format!("{namespace}-{name}.yaml"));
    std::fs::write(
        &file,
        format!(
            "apiVersion: castellan.io/v1alpha1\nkind: DatabaseCluster\nmetadata: {{name: {name}}}\nspec:\n  \
             engine: postgresql\n  version: \"15\"\n  replicas: 1\n  storage: {storage}\n  \
             bootstrap: {{initdb: {{database: shop, owner: clerk}}}}\n"
        ),
    )
    .expect("writing the manifest");
    kubectl_ok(&["apply", "-n", namespace, "-f", &file.to_string_lossy()]);
}

/// `status/reason` of a cluster's `VolumesBound` condition, e.g. `False/NoStorageClass`.
fn volumes_bound(namespace: &str, name: &str) -> String {
    jsonpath(
        "dbc",
        name,
        namespace,
        "{.status.conditions[?(@.type==\"VolumesBound\")].status}/\
         {.status.conditions[?(@.type==\"VolumesBound\")].reason}",
    )
}

fn volumes_bound_message(namespace: &str, name: &str) -> String {
    condition_message(namespace, name, "VolumesBound")
}

/// `type|series count` of each Event with `reason` about cluster `name`.
fn events_about(namespace: &str, name: &str, reason: &str) -> Vec<String> {
    kubectl_ok(&[
        "get",
        "events",
        "-n",
        namespace,
        "--field-selector",
        &format!("reason={reason},involvedObject.name={name}"),
        "-o",
        "jsonpath={range .items[*]}{.type}|{.series.count}{\"\\n\"}{end}",
    ])
    .lines()
    .map(str::to_owned)
    .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cluster_without_a_class_uses_the_default_pool_and_a_missing_class_is_named() {
    let client = client().await;
    let dev = dev_dir();
    agent_up(&dev);
    let pool_name = format!("dflt-{}", std::process::id());
    let namespace = TestNamespace::create(&client, "dbdefault").await;
    let ns = namespace.name.clone();
    let mut teardown = Teardown {
        loops: Loops::default(),
        pool: pool_name.clone(),
        label: "castellan.io/test-default-class",
        dev: dev.clone(),
        namespace: ns.clone(),
        links: Vec::new(),
    };
    // Not the default yet: first the operator must say that nothing can bind.
    single_pool(&client, &mut teardown, false).await;
    let operator = Operator::start(&ns, "127.0.65.2:8080");
    let diagnostics = || describe(&ns, std::slice::from_ref(&operator.log));
    let missing_class = format!("no-such-class-{}", std::process::id());

    apply_small_cluster(&ns, "plain", None);
    apply_small_cluster(&ns, "astray", Some(&missing_class));
    for (cluster, expected) in [
        ("plain", "False/NoStorageClass"),
        ("astray", "False/StorageClassNotFound"),
    ] {
        eventually(
            &format!("{cluster}: VolumesBound {expected}"),
            Duration::from_secs(60),
            || async {
                match volumes_bound(&ns, cluster) {
                    found if found == expected => Ok(()),
                    found => Err(format!("{found}\n{}", diagnostics())),
                }
            },
        )
        .await;
    }
    let message = volumes_bound_message(&ns, "plain");
    assert!(
        message.contains("plain-1 names no StorageClass and the cluster has no default one")
            && message.contains("spec.storageClass.default: true"),
        "plain's message says what is wrong and what to do: {message}"
    );
    let message = volumes_bound_message(&ns, "astray");
    assert!(
        message.starts_with(&format!("StorageClass {missing_class} does not exist")),
        "astray's message names the class: {message}"
    );
    // One Warning each, when the condition turned False (not one per pass).
    for (cluster, reason) in [
        ("plain", "NoStorageClass"),
        ("astray", "StorageClassNotFound"),
    ] {
        assert_eq!(
            events_about(&ns, cluster, reason),
            ["Warning|"],
            "{cluster}: one {reason} Warning Event\n{}",
            diagnostics()
        );
    }

    // The pool's class made the default: the volume controller gives the waiting claim
    // that class, the agent provisions it, and the cluster becomes Ready on the pool.
    kubectl_ok(&[
        "patch",
        "storagepool",
        &pool_name,
        "--type=merge",
        "-p",
        r#"{"spec":{"storageClass":{"default":true}}}"#,
    ]);
    // And a cluster created while the default exists gets it at once (`make up`'s path).
    apply_small_cluster(&ns, "second", None);
    let started = Instant::now();
    for cluster in ["plain", "second"] {
        eventually(
            &format!("{cluster} Ready on the default class"),
            Duration::from_secs(180),
            || async {
                match (
                    jsonpath(
                        "dbc",
                        cluster,
                        &ns,
                        "{.status.phase}/{.status.readyInstances}",
                    ),
                    volumes_bound(&ns, cluster),
                ) {
                    (phase, volumes) if phase == "Ready/1" && volumes == "True/Bound" => Ok(()),
                    other => Err(format!("{other:?}\n{}", diagnostics())),
                }
            },
        )
        .await;
        let claim = format!("{cluster}-1");
        assert_eq!(
            jsonpath("pvc", &claim, &ns, "{.spec.storageClassName}"),
            pool_name,
            "{claim} got the default class"
        );
        let volume = jsonpath("pvc", &claim, &ns, "{.spec.volumeName}");
        let labels = kubectl_ok(&["get", "pv", &volume, "-o", "jsonpath={.metadata.labels}"]);
        assert!(
            labels.contains(&format!("\"castellan.io/pool\":\"{pool_name}\"")),
            "{claim}'s volume {volume} is the pool's: {labels}"
        );
    }
    println!(
        "default class set → both clusters Ready: {:.1} s",
        started.elapsed().as_secs_f64()
    );
    // The class still does not exist: still named, and still only one Warning.
    assert_eq!(volumes_bound(&ns, "astray"), "False/StorageClassNotFound");
    assert_eq!(
        events_about(&ns, "astray", "StorageClassNotFound"),
        ["Warning|"]
    );

    for cluster in ["plain", "second", "astray"] {
        kubectl_ok(&["delete", "dbc", cluster, "-n", &ns, "--timeout=120s"]);
    }
    let _ = kubectl(&["delete", "pvc", "--all", "-n", &ns, "--timeout=60s"]);
}

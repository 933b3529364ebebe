//! End-to-end: local volumes carved from StoragePools by the agent DaemonSet, on the
//! local cluster in `CASTELLAN_KUBECONFIG` with its three process-backed nodes, real
//! loop devices and real btrfs. Needs root.
//!
//! The test deploys the agent the way the local cluster does (`deploy/local/agent.sh
//! up`: the DaemonSet of deploy/agent/agent.yaml, each node limited to the disk images
//! under `<dev>/disks/<node>/`, pools under `<dev>/pools`), then acts only through the
//! API as a user would: a raid1 pool over two disks on node-1 and node-2 (`Delete`), a
//! single-disk pool on node-3 (`Retain`), claims and pods.

mod support;

use support::agent::{agent_up, dev_dir};
use support::disks::{Loops, MIB, run, sparse_file};
use support::eventually;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use castellan_crds::storage_pool::StoragePool;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};

const DISK: u64 = 256 * MIB;

/// Removes what the test made, also when it fails: claims and pods (the namespace),
/// the PVs it left, the pools, the labels, and the BlockDevices of its disks. Declared
/// after `Loops`, so it runs before the loop devices are detached.
struct Teardown {
    loops: Loops,
    tag: String,
    dev: PathBuf,
    pools: Vec<String>,
}

impl Drop for Teardown {
    fn drop(&mut self) {
        let namespace = format!("volumes-{}", self.tag);
        let _ = support::kubectl(&["delete", "namespace", &namespace, "--timeout=60s"]);
        let pool_selector = self
            .pools
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>()
            .join(",");
        let selector = format!("castellan.io/pool in ({pool_selector})");
        let _ = support::kubectl(&["delete", "pv", "-l", &selector, "--timeout=30s"]);
        for pool in &self.pools {
            let _ = support::kubectl(&["delete", "storagepool", pool, "--timeout=60s"]);
        }
        for node in ["node-1", "node-2", "node-3"] {
            let _ = support::kubectl(&["label", "node", node, "castellan.io/test-volumes-"]);
        }
        // Whatever the agent left mounted (pool deletion releases it normally). Only the
        // test's own pools: the pool root itself is the agents' shared mount.
        let root = self.dev.join("pools");
        for mount in support::disks::mounts_under(&root) {
            if self
                .pools
                .iter()
                .any(|pool| mount.ends_with(&format!("/{pool}")))
            {
                let _ = Command::new("umount").arg(&mount).status();
            }
        }
        // Detached before their objects are deleted, or the agent would report them again.
        std::mem::take(&mut self.loops);
        let devices = support::kubectl(&[
            "get",
            "blockdevices",
            "-o",
            "jsonpath={range .items[*]}{.metadata.name} {.spec.identity}{\"\\n\"}{end}",
        ]);
        for line in String::from_utf8_lossy(&devices.stdout).lines() {
            if let Some((name, identity)) = line.split_once(' ')
                && identity.contains(&format!("/{}-", self.tag))
            {
                let _ = support::kubectl(&["delete", "blockdevice", name, "--wait=false"]);
            }
        }
    }
}

fn claim(name: &str, class: &str, size: &str) -> PersistentVolumeClaim {
    serde_json::from_value(serde_json::json!({
        "metadata": { "name": name },
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": class,
            "resources": { "requests": { "storage": size } },
        }
    }))
    .expect("a PersistentVolumeClaim")
}

/// A pod on a node of `group` running `script` with the claim at
/// /var/tmp/castellan-volume-test (a host path only inside the pod's mount namespace).
fn pod(name: &str, claim: &str, group: &str, script: &str) -> Pod {
    serde_json::from_value(serde_json::json!({
        "metadata": { "name": name },
        "spec": {
            "nodeSelector": { "castellan.io/test-volumes": group },
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "main",
                "image": "busybox",
                "command": ["/bin/sh", "-c", script],
                "volumeMounts": [{ "name": "data", "mountPath": "/var/tmp/castellan-volume-test" }],
            }],
            "volumes": [{ "name": "data", "persistentVolumeClaim": { "claimName": claim } }],
        }
    }))
    .expect("a Pod")
}

/// `pod` restricted to one node.
fn pinned(mut pod: Pod, node: &str) -> Pod {
    if let Some(selector) = pod
        .spec
        .as_mut()
        .and_then(|spec| spec.node_selector.as_mut())
    {
        selector.insert("kubernetes.io/hostname".into(), node.into());
    }
    pod
}

fn pool(
    name: &str,
    group: &str,
    layout: &str,
    reclaim: &str,
    disks: &[(&str, Vec<String>)],
) -> StoragePool {
    let nodes: Vec<serde_json::Value> = disks
        .iter()
        .map(|(node, paths)| serde_json::json!({ "name": node, "paths": paths }))
        .collect();
    serde_json::from_value(serde_json::json!({
        "apiVersion": "castellan.io/v1alpha1",
        "kind": "StoragePool",
        "metadata": { "name": name },
        "spec": {
            "nodeSelector": { "matchLabels": { "castellan.io/test-volumes": group } },
            "devices": { "nodes": nodes },
            "layout": layout,
            "storageClass": { "name": name, "reclaimPolicy": reclaim },
        }
    }))
    .expect("a StoragePool")
}

fn storage(pvc: &PersistentVolumeClaim) -> Option<String> {
    pvc.status
        .as_ref()?
        .capacity
        .as_ref()?
        .get("storage")
        .map(|quantity| quantity.0.clone())
}

fn allocated(pool: &StoragePool, node: &str) -> Option<i64> {
    pool.status
        .as_ref()?
        .nodes
        .iter()
        .find(|entry| entry.node == node)?
        .allocated_bytes
}

/// Runs `sh -c script` on the host and returns (success, stderr).
fn host_sh(script: &str) -> (bool, String) {
    let output = Command::new("sh")
        .args(["-c", script])
        .output()
        .expect("running sh");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn claims_get_subvolumes_with_quotas_grow_refuse_overcommit_and_release() {
    let client = support::client().await;
    let dev = dev_dir();
    agent_up(&dev);
    let tag = format!("t{}", std::process::id());
    let (delete_pool, retain_pool) = (format!("vol-delete-{tag}"), format!("vol-retain-{tag}"));
    let mut teardown = Teardown {
        loops: Loops::default(),
        tag: tag.clone(),
        dev: dev.clone(),
        pools: vec![delete_pool.clone(), retain_pool.clone()],
    };

    // Two clean disks on node-1 and node-2, one on node-3, each in its node's directory.
    let mut disks: Vec<(&str, Vec<String>)> = Vec::new();
    for (node, count) in [("node-1", 2), ("node-2", 2), ("node-3", 1)] {
        let dir = dev.join("disks").join(node);
        std::fs::create_dir_all(&dir).expect("creating the node's disk directory");
        let paths = (0..count)
            .map(|index| {
                teardown
                    .loops
                    .attach(&sparse_file(&dir, &format!("{tag}-{index}.img"), DISK))
            })
            .collect();
        disks.push((node, paths));
    }
    for (node, group) in [
        ("node-1", "mirror"),
        ("node-2", "mirror"),
        ("node-3", "single"),
    ] {
        support::kubectl_ok(&[
            "label",
            "--overwrite",
            "node",
            node,
            &format!("castellan.io/test-volumes={group}"),
        ]);
    }
    let pools = Api::<StoragePool>::all(client.clone());
    pools
        .create(
            &PostParams::default(),
            &pool(&delete_pool, "mirror", "raid1", "Delete", &disks[..2]),
        )
        .await
        .expect("creating the raid1 pool");
    pools
        .create(
            &PostParams::default(),
            &pool(&retain_pool, "single", "single", "Retain", &disks[2..]),
        )
        .await
        .expect("creating the single pool");
    for (name, nodes) in [
        (&delete_pool, &["node-1", "node-2"][..]),
        (&retain_pool, &["node-3"][..]),
    ] {
        eventually(
            &format!("pool {name} Ready"),
            Duration::from_secs(60),
            || async {
                let status = pools
                    .get(name)
                    .await
                    .map_err(|e| e.to_string())?
                    .status
                    .unwrap_or_default();
                let healthy = nodes.iter().all(|node| {
                    status.nodes.iter().any(|entry| {
                        entry.node == *node && entry.health.as_deref() == Some("Healthy")
                    })
                });
                if status.phase.as_deref() == Some("Ready") && healthy {
                    Ok(())
                } else {
                    Err(format!("{status:?}"))
                }
            },
        )
        .await;
    }

    let namespace = format!("volumes-{tag}");
    support::kubectl_ok(&["create", "namespace", &namespace]);
    let claims = Api::<PersistentVolumeClaim>::namespaced(client.clone(), &namespace);
    let pods = Api::<Pod>::namespaced(client.clone(), &namespace);
    let volumes = Api::<PersistentVolume>::all(client.clone());

    // Provisioned on the node the scheduler picked, and used there by the pod.
    // Writing past 64 MiB fails inside the pod; the script records how.
    let started = Instant::now();
    claims
        .create(&PostParams::default(), &claim("data", &delete_pool, "64Mi"))
        .await
        .expect("creating claim data");
    // dd's outcome goes to the pod's log: with the quota full, not even a small file
    // can be created in the volume until the fill is removed and committed.
    let script = "d=/var/tmp/castellan-volume-test; echo hello > $d/hello; \
                  err=$(dd if=/dev/zero of=$d/fill bs=1M count=100 2>&1); rc=$?; \
                  rm -f $d/fill; sync; echo \"dd exit $rc: $err\"; exec sleep 3600";
    pods.create(
        &PostParams::default(),
        &pod("user", "data", "mirror", script),
    )
    .await
    .expect("creating pod user");
    let node = eventually("pod user Running", Duration::from_secs(60), || async {
        let pod = pods.get("user").await.map_err(|e| e.to_string())?;
        let phase = pod.status.as_ref().and_then(|status| status.phase.clone());
        match (
            phase.as_deref(),
            pod.spec.as_ref().and_then(|spec| spec.node_name.clone()),
        ) {
            (Some("Running"), Some(node)) => Ok(node),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    println!(
        "claim → pod Running on {node}: {:.2} s",
        started.elapsed().as_secs_f64()
    );
    assert!(
        node == "node-1" || node == "node-2",
        "the pod ran on {node}, outside the pool"
    );
    let claim_object = claims.get("data").await.expect("reading claim data");
    let pv_name = claim_object
        .spec
        .as_ref()
        .and_then(|spec| spec.volume_name.clone())
        .expect("claim data is bound");
    let pv = volumes.get(&pv_name).await.expect("reading the PV");
    let pv_spec = pv.spec.clone().expect("a PV spec");
    let path = PathBuf::from(&pv_spec.local.as_ref().expect("a local PV").path);
    assert_eq!(
        path,
        dev.join("pools")
            .join(&node)
            .join(&delete_pool)
            .join("volumes")
            .join(&pv_name)
    );
    let affinity = serde_json::to_value(&pv_spec.node_affinity).expect("node affinity");
    assert_eq!(
        affinity["required"]["nodeSelectorTerms"][0]["matchExpressions"][0]["values"][0],
        node.as_str(),
        "the PV is pinned to the pod's node"
    );
    assert_eq!(
        pv_spec.persistent_volume_reclaim_policy.as_deref(),
        Some("Delete")
    );
    assert_eq!(storage(&claim_object).as_deref(), Some("64Mi"));
    // The subvolume on the host holds what the pod wrote; its write past 64 MiB failed.
    let log = eventually(
        "the pod's write-past-quota attempt in its log",
        Duration::from_secs(30),
        || async {
            let output = support::kubectl(&["logs", "-n", &namespace, "user"]);
            let log = String::from_utf8_lossy(&output.stdout).into_owned();
            if log.contains("dd exit") {
                Ok(log)
            } else {
                Err(log)
            }
        },
    )
    .await;
    assert_eq!(
        std::fs::read_to_string(path.join("hello")).expect("the pod's file"),
        "hello\n"
    );
    assert!(
        !log.contains("dd exit 0:"),
        "writing 100 MiB into a 64 MiB volume succeeded: {log}"
    );
    assert!(
        log.contains("Disk quota exceeded"),
        "dd failed otherwise: {log}"
    );
    run("btrfs", &["subvolume", "show", &path.to_string_lossy()]);
    let quota = run(
        "btrfs",
        &["qgroup", "show", "-re", "--raw", &path.to_string_lossy()],
    );
    assert!(
        quota.contains(&(64 * MIB).to_string()),
        "no 64 MiB quota: {quota}"
    );
    eventually(
        "64 MiB allocated in the pool's status",
        Duration::from_secs(60),
        || async {
            let pool = pools.get(&delete_pool).await.map_err(|e| e.to_string())?;
            match allocated(&pool, &node) {
                Some(bytes) if bytes == (64 * MIB) as i64 => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;

    // Expansion: the quota, the PV and the claim's capacity follow the request.
    let started = Instant::now();
    let grow = serde_json::json!({"spec": {"resources": {"requests": {"storage": "128Mi"}}}});
    claims
        .patch("data", &PatchParams::default(), &Patch::Merge(&grow))
        .await
        .expect("raising the request of claim data");
    eventually(
        "claim data grown to 128Mi",
        Duration::from_secs(30),
        || async {
            let claim = claims.get("data").await.map_err(|e| e.to_string())?;
            let conditions = claim
                .status
                .as_ref()
                .and_then(|status| status.conditions.clone())
                .unwrap_or_default();
            // No resize condition left; others (`Unused`) are not the resizer's.
            let resizing = conditions.iter().any(|c| c.type_.contains("Resiz"));
            match storage(&claim).as_deref() {
                Some("128Mi") if !resizing => Ok(()),
                other => Err(format!("{other:?} {conditions:?}")),
            }
        },
    )
    .await;
    println!(
        "request raised → claim capacity 128Mi: {:.2} s",
        started.elapsed().as_secs_f64()
    );
    let pv = volumes.get(&pv_name).await.expect("reading the PV");
    assert_eq!(
        pv.spec
            .and_then(|spec| spec.capacity)
            .and_then(|capacity| capacity.get("storage").cloned())
            .map(|q| q.0)
            .as_deref(),
        Some("128Mi")
    );
    let fill = path.join("grown");
    let (ok, stderr) = host_sh(&format!(
        "dd if=/dev/zero of={} bs=1M count=100 conv=fsync 2>&1 >/dev/null",
        fill.display()
    ));
    assert!(
        ok,
        "writing 100 MiB into the grown 128 MiB volume failed: {stderr}"
    );
    std::fs::remove_file(&fill).expect("removing the fill file");

    // Over-commit: on the same node, 200 MiB do not fit beside the 128 MiB already
    // promised on its 256 MiB filesystem (though the filesystem itself is nearly empty):
    // a Warning Event on the claim, and no PV.
    claims
        .create(
            &PostParams::default(),
            &claim("huge", &delete_pool, "200Mi"),
        )
        .await
        .expect("creating claim huge");
    pods.create(
        &PostParams::default(),
        &pinned(pod("greedy", "huge", "mirror", "exec sleep 3600"), &node),
    )
    .await
    .expect("creating pod greedy");
    let message = eventually(
        "a ProvisioningFailed Event on claim huge",
        Duration::from_secs(60),
        || async {
            let output = support::kubectl(&[
                "get",
                "events",
                "-n",
                &namespace,
                "--field-selector",
                "involvedObject.name=huge,reason=ProvisioningFailed,type=Warning",
                "-o",
                "jsonpath={.items[*].message}",
            ]);
            let text = String::from_utf8_lossy(&output.stdout).into_owned();
            if text.contains("bytes free") {
                Ok(text)
            } else {
                Err(text)
            }
        },
    )
    .await;
    println!("over-commit refused: {message}");
    let huge = claims.get("huge").await.expect("reading claim huge");
    assert_eq!(
        huge.status.and_then(|status| status.phase).as_deref(),
        Some("Pending")
    );
    let provisioned = support::kubectl(&[
        "get",
        "pv",
        "-l",
        &format!("castellan.io/pool={delete_pool}"),
        "-o",
        "name",
    ]);
    assert_eq!(
        String::from_utf8_lossy(&provisioned.stdout).lines().count(),
        1,
        "a PV was made for claim huge"
    );
    pods.delete("greedy", &DeleteParams::default())
        .await
        .expect("deleting pod greedy");
    claims
        .delete("huge", &DeleteParams::default())
        .await
        .expect("deleting claim huge");

    // Release with Delete: the PV and the subvolume go, the space comes back.
    let started = Instant::now();
    pods.delete("user", &DeleteParams::default())
        .await
        .expect("deleting pod user");
    claims
        .delete("data", &DeleteParams::default())
        .await
        .expect("deleting claim data");
    eventually(
        "PV of claim data deleted",
        Duration::from_secs(60),
        || async {
            match volumes.get_opt(&pv_name).await.map_err(|e| e.to_string())? {
                None => Ok(()),
                Some(pv) => Err(format!("{:?}", pv.status)),
            }
        },
    )
    .await;
    println!(
        "claim deleted → PV and subvolume gone: {:.2} s",
        started.elapsed().as_secs_f64()
    );
    assert!(
        !path.exists(),
        "the subvolume {} is still there",
        path.display()
    );
    eventually(
        "0 bytes allocated after the release",
        Duration::from_secs(60),
        || async {
            let pool = pools.get(&delete_pool).await.map_err(|e| e.to_string())?;
            match allocated(&pool, &node) {
                Some(0) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;

    // Release with Retain: the PV is Released and then deleted by the user; the
    // subvolume and its data stay, and its quota still counts.
    claims
        .create(&PostParams::default(), &claim("kept", &retain_pool, "32Mi"))
        .await
        .expect("creating claim kept");
    pods.create(
        &PostParams::default(),
        &pod(
            "keeper",
            "kept",
            "single",
            "echo kept > /var/tmp/castellan-volume-test/kept; exec sleep 3600",
        ),
    )
    .await
    .expect("creating pod keeper");
    let kept_pv = eventually("claim kept bound", Duration::from_secs(60), || async {
        let claim = claims.get("kept").await.map_err(|e| e.to_string())?;
        claim
            .spec
            .and_then(|spec| spec.volume_name)
            .ok_or_else(|| "unbound".to_string())
    })
    .await;
    let kept_path = dev
        .join("pools/node-3")
        .join(&retain_pool)
        .join("volumes")
        .join(&kept_pv);
    eventually("the keeper's file", Duration::from_secs(30), || async {
        std::fs::read_to_string(kept_path.join("kept")).map_err(|e| e.to_string())
    })
    .await;
    pods.delete("keeper", &DeleteParams::default())
        .await
        .expect("deleting pod keeper");
    claims
        .delete("kept", &DeleteParams::default())
        .await
        .expect("deleting claim kept");
    eventually(
        "PV of claim kept Released",
        Duration::from_secs(60),
        || async {
            let pv = volumes.get(&kept_pv).await.map_err(|e| e.to_string())?;
            match pv.status.and_then(|status| status.phase).as_deref() {
                Some("Released") => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    assert!(
        kept_path.join("kept").exists(),
        "a Released Retain volume lost its data"
    );
    volumes
        .delete(&kept_pv, &DeleteParams::default())
        .await
        .expect("deleting the retained PV");
    eventually("retained PV deleted", Duration::from_secs(60), || async {
        match volumes.get_opt(&kept_pv).await.map_err(|e| e.to_string())? {
            None => Ok(()),
            Some(pv) => Err(format!("{:?}", pv.metadata.finalizers)),
        }
    })
    .await;
    assert_eq!(
        std::fs::read_to_string(kept_path.join("kept")).expect("the retained data"),
        "kept\n"
    );
    let pool = pools
        .get(&retain_pool)
        .await
        .expect("reading the retain pool");
    assert_eq!(
        allocated(&pool, "node-3"),
        Some((32 * MIB) as i64),
        "the retained quota stopped counting"
    );

    // Deleting a pool waits while a volume of it exists (condition and Event, the pool
    // still mounted), then unmounts it and wipes and releases its disk.
    claims
        .create(
            &PostParams::default(),
            &claim("blocker", &retain_pool, "16Mi"),
        )
        .await
        .expect("creating claim blocker");
    pods.create(
        &PostParams::default(),
        &pod("blocker", "blocker", "single", "exec sleep 3600"),
    )
    .await
    .expect("creating pod blocker");
    let blocker_pv = eventually("claim blocker bound", Duration::from_secs(60), || async {
        let claim = claims.get("blocker").await.map_err(|e| e.to_string())?;
        claim
            .spec
            .and_then(|spec| spec.volume_name)
            .ok_or_else(|| "unbound".to_string())
    })
    .await;
    pools
        .delete(&retain_pool, &DeleteParams::default())
        .await
        .expect("deleting the retain pool");
    let blocked = eventually(
        "the retain pool's deletion blocked by its volume",
        Duration::from_secs(30),
        || async {
            let pool = pools.get(&retain_pool).await.map_err(|e| e.to_string())?;
            let conditions = pool
                .status
                .map(|status| status.conditions)
                .unwrap_or_default();
            match conditions.iter().find(|c| c.type_ == "Deleting") {
                Some(c) if c.reason == "VolumesExist" => Ok(c.message.clone()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    assert!(
        blocked.contains(&blocker_pv),
        "the condition does not name the volume: {blocked}"
    );
    let event = eventually(
        "a DeletionBlocked Event",
        Duration::from_secs(30),
        || async {
            let output = support::kubectl(&[
                "get",
                "events",
                "-A",
                "--field-selector",
                &format!("involvedObject.name={retain_pool},reason=DeletionBlocked"),
                "-o",
                "jsonpath={.items[*].message}",
            ]);
            let text = String::from_utf8_lossy(&output.stdout).into_owned();
            if text.contains(&blocker_pv) {
                Ok(text)
            } else {
                Err(text)
            }
        },
    )
    .await;
    println!("pool deletion blocked: {event}");
    assert!(
        kept_path.join("kept").exists(),
        "the pool was unmounted while a volume of it existed"
    );
    let started = Instant::now();
    pods.delete("blocker", &DeleteParams::default())
        .await
        .expect("deleting pod blocker");
    claims
        .delete("blocker", &DeleteParams::default())
        .await
        .expect("deleting claim blocker");
    // Retain: the PV stays Released, and still blocks, until it is deleted.
    eventually(
        "PV of claim blocker Released",
        Duration::from_secs(60),
        || async {
            let pv = volumes.get(&blocker_pv).await.map_err(|e| e.to_string())?;
            match pv.status.and_then(|status| status.phase).as_deref() {
                Some("Released") => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    volumes
        .delete(&blocker_pv, &DeleteParams::default())
        .await
        .expect("deleting the blocking PV");
    // Up to two periodic passes: a busy disk (a container of another local cluster still
    // holding the filesystem) is wiped on a later pass.
    eventually(
        "the retain pool released and gone",
        Duration::from_secs(120),
        || async {
            match pools
                .get_opt(&retain_pool)
                .await
                .map_err(|e| e.to_string())?
            {
                None => Ok(()),
                Some(pool) => Err(format!("{:?}", pool.status.map(|s| s.conditions))),
            }
        },
    )
    .await;
    println!(
        "last volume deleted → pool released: {:.2} s",
        started.elapsed().as_secs_f64()
    );
    let mount = dev.join("pools/node-3").join(&retain_pool);
    assert!(
        support::disks::mounts_under(&mount).is_empty(),
        "the deleted pool is still mounted"
    );
    let disk = &disks[2].1[0];
    let signatures = run("wipefs", &["--no-act", "--json", disk]);
    assert!(
        !signatures.contains("\"type\""),
        "the released disk still carries a signature: {signatures}"
    );
    eventually("the released disk Unclaimed", Duration::from_secs(30), || async {
        let output = support::kubectl(&[
            "get",
            "blockdevices",
            "-l",
            "castellan.io/node=node-3",
            "-o",
            "jsonpath={range .items[*]}{.spec.path} {.status.state} {.status.pool}{\"\\n\"}{end}",
        ]);
        let text = String::from_utf8_lossy(&output.stdout).into_owned();
        let line = text.lines().find(|line| line.starts_with(&format!("{disk} "))).unwrap_or_default().to_string();
        if line.trim() == format!("{disk} Unclaimed") { Ok(()) } else { Err(text) }
    })
    .await;
}

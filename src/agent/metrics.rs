//! The agent's `/metrics` (plain HTTP, its own port; names in docs/metrics.md): this
//! node's part of every StoragePool (capacity, allocated, free, health, members by
//! state) and its BlockDevices by phase, as the agent reported them in status, and
//! btrfs' error counters of each pool mounted here. Read when scraped: the API
//! objects through the agent's client, bounded by [`SCRAPE_TIMEOUT`]; nothing is kept
//! between scrapes. Reading and rendering are apart, so that rendering is tested
//! without a cluster.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use castellan_crds::storage_pool::StoragePool;
use castellan_crds::{BlockDevice, BlockDeviceState};
use kube::api::ListParams;
use kube::{Api, Client, ResourceExt};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::btrfs::DeviceErrors;
use super::pool::machine::{DEGRADED, FAILED, HEALTHY, PENDING};
use crate::kube_ops::NODE_LABEL;

/// How long a scrape may wait for the API server.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(5);

type Labels = Vec<(&'static str, String)>;
type FloatGauge = Gauge<f64, AtomicU64>;

/// What one scrape read: the pools, this node's BlockDevices, and the error counters
/// of each pool mounted here (by pool, then member path).
#[derive(Default)]
pub struct Snapshot {
    pub pools: Vec<StoragePool>,
    pub devices: Vec<BlockDevice>,
    pub errors: BTreeMap<String, BTreeMap<String, DeviceErrors>>,
}

/// What the agent's `/metrics` reads from.
#[derive(Clone)]
pub struct Sources {
    pub client: Client,
    pub node: String,
    /// `<pool-root>/<node>`: every pool built on this node is mounted below it.
    pub mounts: PathBuf,
}

/// The exposition of one scrape. What cannot be read in time is left out (and logged);
/// the rest is still served.
pub async fn scrape(sources: &Sources) -> String {
    let pools = Api::<StoragePool>::all(sources.client.clone());
    let devices = Api::<BlockDevice>::all(sources.client.clone());
    let selector = format!("{NODE_LABEL}={}", sources.node);
    let (all, this_node) = (
        ListParams::default(),
        ListParams::default().labels(&selector),
    );
    let reading = async {
        tokio::join!(
            pools.list(&all),
            devices.list(&this_node),
            error_counters(sources.mounts.clone()),
        )
    };
    let mut snapshot = Snapshot::default();
    match tokio::time::timeout(SCRAPE_TIMEOUT, reading).await {
        Ok((pools, devices, errors)) => {
            match pools {
                Ok(list) => snapshot.pools = list.items,
                Err(error) => tracing::warn!(%error, "listing StoragePools for /metrics"),
            }
            match devices {
                Ok(list) => snapshot.devices = list.items,
                Err(error) => tracing::warn!(%error, "listing BlockDevices for /metrics"),
            }
            snapshot.errors = errors;
        }
        Err(_) => {
            tracing::warn!(timeout = ?SCRAPE_TIMEOUT, "reading the pools for /metrics took too long")
        }
    }
    crate::exposition::encode(&[&render(&sources.node, &snapshot)])
}

/// `btrfs device stats` of every pool mounted under `mounts` (a directory per pool).
async fn error_counters(mounts: PathBuf) -> BTreeMap<String, BTreeMap<String, DeviceErrors>> {
    tokio::task::spawn_blocking(move || {
        std::fs::read_dir(&mounts)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|entry| {
                let path = entry.path();
                let stats = mounted_stats(&path)?;
                Some((entry.file_name().to_string_lossy().into_owned(), stats))
            })
            .collect()
    })
    .await
    .unwrap_or_default()
}

fn mounted_stats(path: &Path) -> Option<BTreeMap<String, DeviceErrors>> {
    super::host::is_mount_point(path).then(|| super::pool::shell::device_stats(path))
}

fn pool_labels(node: &str, pool: &str) -> Labels {
    vec![("node", node.to_owned()), ("pool", pool.to_owned())]
}

fn gauges(registry: &mut Registry, name: &str, help: &str, series: Vec<(Labels, f64)>) {
    let family = Family::<Labels, FloatGauge>::default();
    for (labels, value) in &series {
        family.get_or_create(labels).set(*value);
    }
    registry.register(name, help, family);
}

/// The metric families of `snapshot`, for node `node`.
pub fn render(node: &str, snapshot: &Snapshot) -> Registry {
    let mut registry = Registry::default();
    let mut capacity = Vec::new();
    let mut allocated = Vec::new();
    let mut free = Vec::new();
    let mut health = Vec::new();
    let mut members = Vec::new();
    for pool in &snapshot.pools {
        let name = pool.name_any();
        let Some(here) = pool
            .status
            .iter()
            .flat_map(|status| &status.nodes)
            .find(|entry| entry.node == node)
        else {
            continue;
        };
        let labels = pool_labels(node, &name);
        let bytes = |value: Option<i64>| value.map(|b| (labels.clone(), b as f64));
        capacity.extend(bytes(here.capacity_bytes));
        allocated.extend(bytes(here.allocated_bytes));
        free.extend(bytes(here.free_bytes));
        let current = here.health.as_deref().unwrap_or(PENDING);
        for word in [HEALTHY, DEGRADED, FAILED, PENDING] {
            let mut labels = labels.clone();
            labels.push(("health", word.to_owned()));
            health.push((labels, if word == current { 1.0 } else { 0.0 }));
        }
        // The states the pool machine writes (pool/machine.rs), each with a series so
        // that an alert on one of them has a 0 to compare with.
        let mut by_state: BTreeMap<&str, f64> = [
            ("Online", 0.0),
            ("Failing", 0.0),
            ("Replacing", 0.0),
            ("Missing", 0.0),
            ("Failed", 0.0),
        ]
        .into();
        for disk in &here.disks {
            *by_state
                .entry(disk.state.as_deref().unwrap_or("Online"))
                .or_default() += 1.0;
        }
        for (state, count) in by_state {
            let mut labels = labels.clone();
            labels.push(("state", state.to_owned()));
            members.push((labels, count));
        }
    }
    gauges(
        &mut registry,
        "castellan_pool_capacity_bytes",
        "Usable bytes of the pool's filesystem on this node",
        capacity,
    );
    gauges(
        &mut registry,
        "castellan_pool_allocated_bytes",
        "Bytes promised to the pool's volumes on this node (the sum of their quotas)",
        allocated,
    );
    gauges(
        &mut registry,
        "castellan_pool_free_bytes",
        "Bytes of the pool on this node still free for new volumes",
        free,
    );
    gauges(
        &mut registry,
        "castellan_pool_health",
        "The pool's health on this node: 1 for the current one",
        health,
    );
    gauges(
        &mut registry,
        "castellan_pool_members",
        "The pool's disks on this node, by state",
        members,
    );

    let errors = Family::<Labels, Counter>::default();
    for (pool, devices) in &snapshot.errors {
        for (device, counts) in devices {
            for (kind, count) in [
                ("read", counts.read),
                ("write", counts.write),
                ("flush", counts.flush),
                ("corruption", counts.corruption),
                ("generation", counts.generation),
            ] {
                let mut labels = pool_labels(node, pool);
                labels.push(("device", device.clone()));
                labels.push(("kind", kind.to_owned()));
                errors.get_or_create(&labels).inc_by(count);
            }
        }
    }
    registry.register(
        "castellan_device_errors",
        "btrfs' error counters of each pool member, over the filesystem's life",
        errors,
    );

    let mut phases: BTreeMap<String, f64> = [
        BlockDeviceState::Unclaimed,
        BlockDeviceState::Claimed,
        BlockDeviceState::InUse,
        BlockDeviceState::Missing,
        BlockDeviceState::Failed,
    ]
    .iter()
    .map(|state| (format!("{state:?}"), 0.0))
    .collect();
    for device in snapshot
        .devices
        .iter()
        .filter(|device| device.spec.node_name == node)
    {
        if let Some(state) = device.status.as_ref().and_then(|s| s.state) {
            *phases.entry(format!("{state:?}")).or_default() += 1.0;
        }
    }
    gauges(
        &mut registry,
        "castellan_block_devices",
        "BlockDevices of this node by phase",
        phases
            .into_iter()
            .map(|(phase, count)| (vec![("node", node.to_owned()), ("phase", phase)], count))
            .collect(),
    );
    registry
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool() -> StoragePool {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "castellan.io/v1alpha1",
            "kind": "StoragePool",
            "metadata": {"name": "fast"},
            "spec": {"devices": {}, "layout": "raid1", "storageClass": {"name": "fast"}},
            "status": {"nodes": [
                {"node": "node-1", "health": "Degraded", "capacityBytes": 1000,
                 "allocatedBytes": 400, "freeBytes": 600,
                 "disks": [
                    {"blockDevice": "a", "path": "/dev/loop1", "sizeBytes": 1000, "state": "Online"},
                    {"blockDevice": "b", "path": "/dev/loop2", "sizeBytes": 1000, "state": "Missing"}
                 ]},
                {"node": "node-2", "health": "Healthy", "capacityBytes": 5000}
            ]}
        }))
        .expect("a StoragePool")
    }

    fn device(node: &str, state: &str) -> BlockDevice {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "castellan.io/v1alpha1",
            "kind": "BlockDevice",
            "metadata": {"name": format!("{node}-{state}")},
            "spec": {"nodeName": node, "path": "/dev/loop1", "sizeBytes": 1000, "identity": "serial-1"},
            "status": {"state": state}
        }))
        .expect("a BlockDevice")
    }

    #[test]
    fn this_nodes_part_of_each_pool_and_its_devices_are_reported() {
        let snapshot = Snapshot {
            pools: vec![pool()],
            devices: vec![
                device("node-1", "InUse"),
                device("node-1", "InUse"),
                device("node-1", "Unclaimed"),
                device("node-2", "Failed"),
            ],
            errors: BTreeMap::from([(
                "fast".to_owned(),
                BTreeMap::from([(
                    "/dev/loop1".to_owned(),
                    DeviceErrors {
                        read: 3,
                        ..DeviceErrors::default()
                    },
                )]),
            )]),
        };
        let text = crate::exposition::encode(&[&render("node-1", &snapshot)]);
        for line in [
            "castellan_pool_capacity_bytes{node=\"node-1\",pool=\"fast\"} 1000.0\n",
            "castellan_pool_allocated_bytes{node=\"node-1\",pool=\"fast\"} 400.0\n",
            "castellan_pool_free_bytes{node=\"node-1\",pool=\"fast\"} 600.0\n",
            "castellan_pool_health{node=\"node-1\",pool=\"fast\",health=\"Degraded\"} 1.0\n",
            "castellan_pool_health{node=\"node-1\",pool=\"fast\",health=\"Healthy\"} 0.0\n",
            "castellan_pool_members{node=\"node-1\",pool=\"fast\",state=\"Online\"} 1.0\n",
            "castellan_pool_members{node=\"node-1\",pool=\"fast\",state=\"Missing\"} 1.0\n",
            "castellan_pool_members{node=\"node-1\",pool=\"fast\",state=\"Failed\"} 0.0\n",
            "castellan_device_errors_total{node=\"node-1\",pool=\"fast\",device=\"/dev/loop1\",kind=\"read\"} 3\n",
            "castellan_device_errors_total{node=\"node-1\",pool=\"fast\",device=\"/dev/loop1\",kind=\"write\"} 0\n",
            "castellan_block_devices{node=\"node-1\",phase=\"InUse\"} 2.0\n",
            "castellan_block_devices{node=\"node-1\",phase=\"Unclaimed\"} 1.0\n",
            "castellan_block_devices{node=\"node-1\",phase=\"Failed\"} 0.0\n",
        ] {
            assert!(text.contains(line), "{line:?} missing from:\n{text}");
        }
        assert!(
            !text.contains("node-2"),
            "another node's part leaked:\n{text}"
        );
    }
}

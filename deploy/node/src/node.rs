//! The Node object: what this node tells the API server about itself (labels,
//! capacity, addresses, the kubelet port) and the status heartbeat that keeps it Ready.
//!
//! The Lease is renewed separately (`lease.rs`) and more often; the node lifecycle
//! controller takes the newer of the two as proof of life.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context;
use k8s_openapi::api::core::v1::{
    DaemonEndpoint, Node, NodeAddress, NodeCondition, NodeDaemonEndpoints, NodeStatus,
    NodeSystemInfo,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::{Patch, PatchParams};

pub const FIELD_MANAGER: &str = "castellan-devnode";
const STATUS_INTERVAL: Duration = Duration::from_secs(10);

/// What the node says about itself, fixed for the life of the process.
#[derive(Clone, Debug)]
pub struct NodeIdentity {
    pub name: String,
    pub zone: String,
    pub address: std::net::Ipv4Addr,
    pub kubelet_port: u16,
    pub cpu: String,
    pub memory: String,
    pub max_pods: u32,
}

/// The Node's metadata as this node owns it (server-side applied).
pub fn node_object(identity: &NodeIdentity) -> Node {
    let labels = BTreeMap::from([
        ("kubernetes.io/hostname".to_string(), identity.name.clone()),
        ("kubernetes.io/os".to_string(), "linux".to_string()),
        (
            "kubernetes.io/arch".to_string(),
            std::env::consts::ARCH
                .replace("x86_64", "amd64")
                .replace("aarch64", "arm64"),
        ),
        (
            "topology.kubernetes.io/zone".to_string(),
            identity.zone.clone(),
        ),
        (
            "node.castellan.io/process-backed".to_string(),
            "true".to_string(),
        ),
    ]);
    Node {
        metadata: ObjectMeta {
            name: Some(identity.name.clone()),
            labels: Some(labels),
            ..ObjectMeta::default()
        },
        ..Node::default()
    }
}

/// The Node's status at `now`: always Ready while this process runs, since a stopped
/// node is exactly one that stops saying so.
pub fn node_status(identity: &NodeIdentity, now: Timestamp, ready_since: Timestamp) -> NodeStatus {
    let resources = BTreeMap::from([
        ("cpu".to_string(), Quantity(identity.cpu.clone())),
        ("memory".to_string(), Quantity(identity.memory.clone())),
        ("pods".to_string(), Quantity(identity.max_pods.to_string())),
        (
            "ephemeral-storage".to_string(),
            Quantity("100Gi".to_string()),
        ),
    ]);
    let condition =
        |type_: &str, status: &str, reason: &str, message: &str, since: Timestamp| NodeCondition {
            type_: type_.to_string(),
            status: status.to_string(),
            reason: Some(reason.to_string()),
            message: Some(message.to_string()),
            last_heartbeat_time: Some(Time(now)),
            last_transition_time: Some(Time(since)),
        };
    NodeStatus {
        capacity: Some(resources.clone()),
        allocatable: Some(resources),
        conditions: Some(vec![
            condition(
                "Ready",
                "True",
                "KubeletReady",
                "castellan-devnode is posting ready status",
                ready_since,
            ),
            condition(
                "MemoryPressure",
                "False",
                "KubeletHasSufficientMemory",
                "no memory pressure is simulated",
                ready_since,
            ),
            condition(
                "DiskPressure",
                "False",
                "KubeletHasNoDiskPressure",
                "no disk pressure is simulated",
                ready_since,
            ),
            condition(
                "PIDPressure",
                "False",
                "KubeletHasSufficientPID",
                "no PID pressure is simulated",
                ready_since,
            ),
        ]),
        // No Hostname address: the API server would prefer it for `kubectl logs`, and
        // node names do not resolve here.
        addresses: Some(vec![NodeAddress {
            type_: "InternalIP".to_string(),
            address: identity.address.to_string(),
        }]),
        daemon_endpoints: Some(NodeDaemonEndpoints {
            kubelet_endpoint: Some(DaemonEndpoint {
                port: i32::from(identity.kubelet_port),
            }),
        }),
        node_info: Some(NodeSystemInfo {
            architecture: std::env::consts::ARCH
                .replace("x86_64", "amd64")
                .replace("aarch64", "arm64"),
            boot_id: String::new(),
            container_runtime_version: concat!("castellan-devnode://", env!("CARGO_PKG_VERSION"))
                .to_string(),
            kernel_version: String::new(),
            kube_proxy_version: String::new(),
            kubelet_version: "v1.37.2".to_string(),
            machine_id: identity.name.clone(),
            operating_system: "linux".to_string(),
            os_image: "castellan-devnode (host processes)".to_string(),
            system_uuid: identity.name.clone(),
            ..NodeSystemInfo::default()
        }),
        ..NodeStatus::default()
    }
}

/// Creates or updates the Node, then posts its status.
pub async fn register(nodes: &Api<Node>, identity: &NodeIdentity) -> anyhow::Result<()> {
    let params = PatchParams::apply(FIELD_MANAGER).force();
    nodes
        .patch(
            &identity.name,
            &params,
            &Patch::Apply(node_object(identity)),
        )
        .await
        .with_context(|| format!("registering Node {}", identity.name))?;
    let now = Timestamp::now();
    post_status(nodes, identity, now, now).await
}

async fn post_status(
    nodes: &Api<Node>,
    identity: &NodeIdentity,
    now: Timestamp,
    ready_since: Timestamp,
) -> anyhow::Result<()> {
    let patch = serde_json::json!({ "status": node_status(identity, now, ready_since) });
    nodes
        .patch_status(
            &identity.name,
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .with_context(|| format!("posting status of Node {}", identity.name))?;
    Ok(())
}

/// Posts the status every few seconds, forever; failures are logged and retried.
pub async fn heartbeat(nodes: Api<Node>, identity: NodeIdentity) {
    let ready_since = Timestamp::now();
    loop {
        tokio::time::sleep(STATUS_INTERVAL).await;
        if let Err(error) = post_status(&nodes, &identity, Timestamp::now(), ready_since).await {
            tracing::warn!("{error:#}");
        }
    }
}

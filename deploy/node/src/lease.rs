//! The node's Lease in `kube-node-lease`: renewed every few seconds while the process
//! lives. When it stops being renewed, the node lifecycle controller marks the Node
//! NotReady after its grace period (16 s in the local cluster) and evicts its pods.

use std::time::Duration;

use anyhow::Context;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, OwnerReference};
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::{Patch, PatchParams};

use crate::node::FIELD_MANAGER;

const RENEW_INTERVAL: Duration = Duration::from_secs(3);
const LEASE_DURATION_SECONDS: i32 = 40;

pub fn lease_object(node_name: &str, node_uid: Option<&str>, now: Timestamp) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(node_name.to_string()),
            namespace: Some("kube-node-lease".to_string()),
            // Like the kubelet's: the Lease goes when the Node is deleted.
            owner_references: node_uid.map(|uid| {
                vec![OwnerReference {
                    api_version: "v1".to_string(),
                    kind: "Node".to_string(),
                    name: node_name.to_string(),
                    uid: uid.to_string(),
                    ..OwnerReference::default()
                }]
            }),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(node_name.to_string()),
            lease_duration_seconds: Some(LEASE_DURATION_SECONDS),
            renew_time: Some(MicroTime(now)),
            ..LeaseSpec::default()
        }),
    }
}

pub async fn renew(
    leases: &Api<Lease>,
    node_name: &str,
    node_uid: Option<&str>,
) -> anyhow::Result<()> {
    let params = PatchParams::apply(FIELD_MANAGER).force();
    leases
        .patch(
            node_name,
            &params,
            &Patch::Apply(lease_object(node_name, node_uid, Timestamp::now())),
        )
        .await
        .with_context(|| format!("renewing Lease kube-node-lease/{node_name}"))?;
    Ok(())
}

/// Renews the Lease forever; a failed renewal is logged and retried on the next tick.
pub async fn keep_renewing(leases: Api<Lease>, node_name: String, node_uid: Option<String>) {
    loop {
        if let Err(error) = renew(&leases, &node_name, node_uid.as_deref()).await {
            tracing::warn!("{error:#}");
        }
        tokio::time::sleep(RENEW_INTERVAL).await;
    }
}

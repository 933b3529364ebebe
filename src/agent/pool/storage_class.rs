//! StorageClass: the class a `StoragePool` publishes, built from its spec.
//!
//! Pure. Every node's agent applies the same object under the same field manager, so
//! the writes are idempotent and never conflict; the operator may take this over when
//! its pool controller exists (same builder, same manager name).

use castellan_crds::storage_pool::{ReclaimPolicy, StoragePool};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::{Resource, ResourceExt};

// One name for the provisioner a class names and the one its volumes say made them
// (`pv.kubernetes.io/provisioned-by`).
use crate::agent::volume::machine::PROVISIONER;

/// The annotation that makes a class the cluster's default.
pub const DEFAULT_CLASS_ANNOTATION: &str = "storageclass.kubernetes.io/is-default-class";
/// The StorageClass parameter naming the pool.
pub const POOL_PARAMETER: &str = "castellan.io/pool";

/// The StorageClass of `pool`, owned by it so that it goes with the pool.
pub fn build(pool: &StoragePool) -> StorageClass {
    let class = &pool.spec.storage_class;
    let owner = pool.uid().map(|uid| OwnerReference {
        api_version: StoragePool::api_version(&()).to_string(),
        kind: StoragePool::kind(&()).to_string(),
        name: pool.name_any(),
        uid,
        ..Default::default()
    });
    StorageClass {
        metadata: ObjectMeta {
            name: Some(class.name.clone()),
            annotations: Some(
                [(
                    DEFAULT_CLASS_ANNOTATION.to_string(),
                    class.default.to_string(),
                )]
                .into(),
            ),
            owner_references: owner.map(|owner| vec![owner]),
            ..Default::default()
        },
        provisioner: PROVISIONER.to_string(),
        parameters: Some([(POOL_PARAMETER.to_string(), pool.name_any())].into()),
        reclaim_policy: Some(
            match class.reclaim_policy {
                ReclaimPolicy::Delete => "Delete",
                ReclaimPolicy::Retain => "Retain",
            }
            .to_string(),
        ),
        volume_binding_mode: Some("WaitForFirstConsumer".to_string()),
        allow_volume_expansion: Some(true),
        ..Default::default()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in tests a failed unwrap is a failed test
mod tests {
    use super::*;
    use castellan_crds::storage_pool::{DeviceFilter, Layout, PoolStorageClass, StoragePoolSpec};

    #[test]
    fn the_class_follows_the_spec_and_belongs_to_the_pool() {
        let mut pool = StoragePool::new(
            "fast",
            StoragePoolSpec {
                node_selector: None,
                devices: DeviceFilter::default(),
                layout: Layout::Raid1,
                storage_class: PoolStorageClass {
                    name: "castellan-fast".into(),
                    reclaim_policy: ReclaimPolicy::Retain,
                    default: true,
                },
                scrub: None,
            },
        );
        pool.metadata.uid = Some("u-1".into());
        let class = build(&pool);
        assert_eq!(class.metadata.name.as_deref(), Some("castellan-fast"));
        assert_eq!(class.provisioner, "castellan.io/local");
        assert_eq!(class.reclaim_policy.as_deref(), Some("Retain"));
        assert_eq!(
            class.volume_binding_mode.as_deref(),
            Some("WaitForFirstConsumer")
        );
        assert_eq!(class.allow_volume_expansion, Some(true));
        assert_eq!(
            class.metadata.annotations.unwrap()[DEFAULT_CLASS_ANNOTATION],
            "true"
        );
        assert_eq!(class.parameters.unwrap()[POOL_PARAMETER], "fast");
        let owner = &class.metadata.owner_references.unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str(), owner.uid.as_str()),
            ("StoragePool", "fast", "u-1")
        );
    }

    /// `default: false` is written out, not left off: the agent applies the class with
    /// server-side apply, so a pool unmarked as the default must overwrite the "true" it
    /// wrote before; Kubernetes reads anything but "true" as not the default.
    #[test]
    fn a_pool_that_is_not_the_default_says_so() {
        let pool: StoragePool = serde_json::from_value(serde_json::json!({
            "apiVersion": "castellan.io/v1alpha1",
            "kind": "StoragePool",
            "metadata": { "name": "slow" },
            "spec": { "layout": "single", "storageClass": { "name": "castellan-slow" } },
        }))
        .unwrap();
        assert!(!pool.spec.storage_class.default, "off unless asked for");
        let class = build(&pool);
        assert_eq!(
            class.metadata.annotations.unwrap()[DEFAULT_CLASS_ANNOTATION],
            "false"
        );
        assert_eq!(class.reclaim_policy.as_deref(), Some("Delete"));
    }
}

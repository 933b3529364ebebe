//! Every CRD of the API, and their rendering as the YAML files in `crds/`.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

use crate::{Backup, BackupSchedule, BlockDevice, DatabaseCluster, StoragePool};

/// Every CustomResourceDefinition Castellan serves, in a stable order.
pub fn all() -> Vec<CustomResourceDefinition> {
    vec![
        StoragePool::crd(),
        BlockDevice::crd(),
        DatabaseCluster::crd(),
        Backup::crd(),
        BackupSchedule::crd(),
    ]
}

/// The file name a CRD is written to under `crds/`: `<group>_<plural>.yaml`, the
/// convention controller-gen and most operators follow.
pub fn file_name(crd: &CustomResourceDefinition) -> String {
    format!("{}_{}.yaml", crd.spec.group, crd.spec.names.plural)
}

/// One CRD as the YAML document `kubectl apply -f` takes.
pub fn to_yaml(crd: &CustomResourceDefinition) -> Result<String, serde_yaml_ng::Error> {
    serde_yaml_ng::to_string(crd)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::path::PathBuf;

    use super::*;

    /// `crds/` is generated; this fails when someone changed the types and forgot
    /// `make crds`, so the YAML users apply never drifts from what the operator expects.
    #[test]
    fn crd_files_are_current() {
        // Where the package is when the test runs (a cached test binary may have been
        // compiled in another checkout).
        let root = std::env::var_os("CARGO_MANIFEST_DIR")
            .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from);
        let dir = root.as_path();
        let mut expected_files = BTreeSet::new();
        for crd in all() {
            let name = file_name(&crd);
            let generated = to_yaml(&crd).expect("CRDs serialize to YAML");
            let on_disk = std::fs::read_to_string(dir.join(&name))
                .unwrap_or_else(|e| panic!("reading crds/{name}: {e}; run `make crds`"));
            assert!(
                generated == on_disk,
                "crds/{name} is stale; run `make crds`"
            );
            expected_files.insert(name);
        }
        let present: BTreeSet<String> = std::fs::read_dir(dir)
            .expect("crds/ is readable")
            .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
            .filter(|name| name.ends_with(".yaml"))
            .collect();
        assert_eq!(
            present, expected_files,
            "crds/ holds YAML no type generates"
        );
    }

    #[test]
    fn every_kind_follows_the_api_rules() {
        for crd in all() {
            let kind = &crd.spec.names.kind;
            assert_eq!(crd.spec.group, crate::GROUP);
            assert_eq!(
                crd.spec.names.categories.as_deref(),
                Some(&[crate::CATEGORY.to_owned()][..]),
                "{kind} is in the castellan category"
            );
            assert!(
                crd.spec
                    .names
                    .short_names
                    .as_ref()
                    .is_some_and(|s| !s.is_empty()),
                "{kind} has a short name"
            );
            let [version] = &crd.spec.versions[..] else {
                panic!("{kind} serves exactly one version");
            };
            assert_eq!(version.name, crate::VERSION);
            assert!(
                version
                    .subresources
                    .as_ref()
                    .is_some_and(|s| s.status.is_some()),
                "{kind} has a status subresource"
            );
            let columns = version
                .additional_printer_columns
                .as_deref()
                .unwrap_or_default();
            assert!(columns.len() >= 3, "{kind} has printer columns");
            let schema = serde_json::to_value(&version.schema).expect("schema serializes");
            let status = &schema["openAPIV3Schema"]["properties"]["status"]["properties"];
            assert!(
                status["observedGeneration"].is_object(),
                "{kind} status has observedGeneration"
            );
            assert!(
                status["conditions"].is_object(),
                "{kind} status has conditions"
            );
        }
    }
}

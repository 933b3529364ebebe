//! The manifests Castellan ships under `deploy/`, read as the tests check them, and
//! applied in part: the identity and rights of a component without its workload.

use super::{kubectl_ok, repo};

/// The documents of a multi-document YAML file in the repository.
pub fn manifests(path: &str) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(repo().join(path))
        .unwrap_or_else(|e| panic!("reading {path}: {e}"));
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|document| {
            serde::Deserialize::deserialize(document)
                .unwrap_or_else(|e| panic!("parsing {path}: {e}"))
        })
        .filter(|document: &serde_json::Value| !document.is_null())
        .collect()
}

/// Applies the Namespace, ServiceAccount, Roles and their bindings of the manifest at
/// `path`, and nothing else (its Deployment would start a component).
pub fn apply_identity(path: &str) {
    let rbac: Vec<String> = manifests(path)
        .into_iter()
        .filter(|d| {
            matches!(
                d["kind"].as_str(),
                Some(
                    "Namespace"
                        | "ServiceAccount"
                        | "ClusterRole"
                        | "ClusterRoleBinding"
                        | "Role"
                        | "RoleBinding"
                )
            )
        })
        .map(|d| serde_json::to_string(&d).expect("JSON"))
        .collect();
    let file = std::env::temp_dir().join(format!(
        "rbac-{}-{}.json",
        path.replace('/', "-"),
        std::process::id()
    ));
    std::fs::write(
        &file,
        format!(
            "{{\"apiVersion\":\"v1\",\"kind\":\"List\",\"items\":[{}]}}",
            rbac.join(",")
        ),
    )
    .expect("writing the RBAC manifests");
    kubectl_ok(&["apply", "-f", file.to_str().expect("utf-8 path")]);
    let _ = std::fs::remove_file(&file);
}

//! The manifests Castellan ships under `deploy/`, read as the tests check them, and
//! applied in part: the identity and rights of a component without its workload.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::{kubeconfig_path, kubectl_ok, repo};

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
    let rbac = manifests(path).into_iter().filter(|d| {
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
    });
    apply_documents(&path.replace('/', "-"), rbac);
}

/// The operator's service account as `deploy/operator/operator.yaml` ships it.
pub const OPERATOR_USER: &str = "system:serviceaccount:castellan-system:castellan-operator";

/// A kubeconfig that acts as the shipped operator's service account, with the rights
/// `deploy/operator/operator.yaml` gives it: its ClusterRole, and its home Role (the
/// leader Lease, the CA Secret, the image catalog) bound in `namespace` too, where an
/// operator started with `--namespace namespace` keeps them. The end-to-end tests run
/// their operator through it, so a call the shipped RBAC does not allow fails the test
/// that makes it instead of a user's first try. (The deployed admission policies name
/// this user, so it is the real one, not one of the test's namespace.)
pub fn operator_kubeconfig(namespace: &str) -> PathBuf {
    apply_identity("deploy/operator/operator.yaml");
    let home = manifests("deploy/operator/operator.yaml")
        .into_iter()
        .filter(|d| matches!(d["kind"].as_str(), Some("Role" | "RoleBinding")))
        .map(|mut document| {
            document["metadata"]["namespace"] = namespace.into();
            document
        });
    apply_documents(&format!("operator-home-{namespace}"), home);

    let admin = kubeconfig_path();
    let text = std::fs::read_to_string(&admin)
        .unwrap_or_else(|e| panic!("reading {}: {e}", admin.display()));
    let mut kubeconfig: serde_json::Value = serde_yaml_ng::from_str(&text)
        .unwrap_or_else(|e| panic!("parsing {}: {e}", admin.display()));
    let groups = [
        "system:serviceaccounts",
        "system:serviceaccounts:castellan-system",
        "system:authenticated",
    ];
    for user in kubeconfig["users"].as_array_mut().into_iter().flatten() {
        user["user"]["as"] = OPERATOR_USER.into();
        user["user"]["as-groups"] = groups.as_slice().into();
    }
    let path = std::env::temp_dir().join(format!(
        "operator-kubeconfig-{namespace}-{}.json",
        std::process::id()
    ));
    std::fs::write(&path, kubeconfig.to_string())
        .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    path
}

/// Applies `documents` server-side (tests apply the same identity at the same time;
/// a client-side apply of one object from two of them can fail with a conflict).
fn apply_documents(name: &str, documents: impl Iterator<Item = serde_json::Value>) {
    static FILES: AtomicUsize = AtomicUsize::new(0);
    let items: Vec<serde_json::Value> = documents.collect();
    let file = std::env::temp_dir().join(format!(
        "apply-{name}-{}-{}.json",
        std::process::id(),
        FILES.fetch_add(1, Ordering::Relaxed)
    ));
    let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items});
    std::fs::write(&file, list.to_string()).expect("writing the manifests to apply");
    kubectl_ok(&[
        "apply",
        "--server-side",
        "--force-conflicts",
        "--field-manager=castellan-tests",
        "-f",
        file.to_str().expect("utf-8 path"),
    ]);
    let _ = std::fs::remove_file(&file);
}

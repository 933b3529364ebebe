//! The object store a `DatabaseCluster` backs up to, as the instances need it: the
//! endpoint and bucket from `spec.backup`, the prefix of the cluster's objects, and the
//! credentials read from the Secret it names.

use castellan_crds::DatabaseCluster;
use castellan_crds::database_cluster::BackupTarget;
use k8s_openapi::api::core::v1::Secret;
use kube::{Api, Client, ResourceExt};

use crate::instance_api::{ArchiveConfig, ArchiveTarget};

/// The prefix of a cluster's objects in the bucket: `spec.backup.path`, or
/// `<namespace>/<cluster>` when it is absent.
pub fn prefix(cluster: &DatabaseCluster, path: Option<&str>) -> String {
    match path.map(|p| p.trim_matches('/')).filter(|p| !p.is_empty()) {
        Some(path) => path.to_owned(),
        None => format!(
            "{}/{}",
            cluster.namespace().unwrap_or_else(|| "default".to_owned()),
            cluster.name_any()
        ),
    }
}

/// The archive setting `cluster`'s instances should have: off without `spec.backup`;
/// otherwise its target with the credentials from the Secret. An error says what is
/// missing, for the `ContinuousArchiving` condition.
pub async fn archive_setting(
    client: &Client,
    cluster: &DatabaseCluster,
) -> Result<ArchiveConfig, String> {
    let Some(backup) = cluster.spec.backup.as_ref() else {
        return Ok(ArchiveConfig::new(None));
    };
    let namespace = cluster.namespace().unwrap_or_else(|| "default".to_owned());
    let prefix = prefix(cluster, backup.path.as_deref());
    target(client, &namespace, backup, prefix)
        .await
        .map(|target| ArchiveConfig::new(Some(target)))
}

/// The object store `backup` names, under `prefix`, with the credentials from its
/// Secret in `namespace`.
pub async fn target(
    client: &Client,
    namespace: &str,
    backup: &BackupTarget,
    prefix: String,
) -> Result<ArchiveTarget, String> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let credentials = &backup.credentials;
    let secret = read_secret(&secrets, namespace, &credentials.secret_name, "credentials").await?;
    let ca_bundle = match &backup.endpoint_ca {
        None => None,
        Some(ca) => {
            let secret = read_secret(&secrets, namespace, &ca.secret_name, "endpointCA").await?;
            let pem = text(&secret, &ca.key)?;
            let what = format!("Secret {}'s key {}", ca.secret_name, ca.key);
            crate::pki::certificates(pem.as_bytes(), &what).map_err(|e| e.to_string())?;
            Some(pem)
        }
    };
    Ok(ArchiveTarget {
        endpoint: backup.endpoint.trim_end_matches('/').to_owned(),
        bucket: backup.bucket.clone(),
        prefix,
        region: backup.region.clone(),
        access_key_id: text(&secret, &credentials.access_key_id_key)?,
        secret_access_key: text(&secret, &credentials.secret_access_key_key)?,
        ca_bundle,
    })
}

/// Secret `name` in `namespace`, named in `spec.backup` for `what`.
async fn read_secret(
    secrets: &Api<Secret>,
    namespace: &str,
    name: &str,
    what: &str,
) -> Result<Secret, String> {
    secrets
        .get_opt(name)
        .await
        .map_err(|e| format!("reading the object store's {what} in Secret {name}: {e}"))?
        .ok_or_else(|| {
            format!("the object store's {what} Secret {name} does not exist in {namespace}")
        })
}

/// The text under `key` of `secret`, trimmed.
fn text(secret: &Secret, key: &str) -> Result<String, String> {
    let name = secret.name_any();
    let value = secret
        .data
        .as_ref()
        .and_then(|data| data.get(key))
        .ok_or_else(|| format!("Secret {name} has no key {key}"))?;
    String::from_utf8(value.0.clone())
        .map(|v| v.trim().to_owned())
        .map_err(|_| format!("Secret {name}'s key {key} is not UTF-8 text"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster() -> DatabaseCluster {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "castellan.io/v1alpha1",
            "kind": "DatabaseCluster",
            "metadata": {"name": "shop", "namespace": "sales"},
            "spec": {"engine": "postgresql", "version": "15", "replicas": 1,
                     "storage": {"size": "1Gi"}}
        }))
        .expect("a cluster")
    }

    #[test]
    fn the_prefix_defaults_to_namespace_and_name() {
        assert_eq!(prefix(&cluster(), None), "sales/shop");
        assert_eq!(prefix(&cluster(), Some("")), "sales/shop");
        assert_eq!(prefix(&cluster(), Some("team/pg/")), "team/pg");
    }
}

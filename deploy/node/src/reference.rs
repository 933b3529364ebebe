//! The ConfigMaps and Secrets a pod refers to (from its environment and its volumes),
//! read the way the kubelet reads them: a missing one is an error unless the reference
//! is optional.

use std::fmt::Debug;

use anyhow::{Context, bail};
use k8s_openapi::NamespaceResourceScope;
use kube::Api;
use serde::de::DeserializeOwned;

/// Reads the object `namespace/name` of kind `K`; `None` when it is absent and the
/// reference is optional.
pub async fn read<K>(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    optional: bool,
) -> anyhow::Result<Option<K>>
where
    K: kube::Resource<Scope = NamespaceResourceScope, DynamicType = ()>
        + Clone
        + DeserializeOwned
        + Debug,
{
    let kind = K::kind(&());
    let found = Api::<K>::namespaced(client.clone(), namespace)
        .get_opt(name)
        .await
        .with_context(|| format!("reading {kind} {namespace}/{name}"))?;
    if found.is_none() && !optional {
        bail!("{kind} {namespace}/{name} not found");
    }
    Ok(found)
}

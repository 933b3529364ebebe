//! A container's environment, resolved the way the kubelet does: `envFrom` sources,
//! then `env` entries (which win), `valueFrom` references to the pod's own fields,
//! resources, Secrets and ConfigMaps, and `$(VAR)` expansion of earlier variables.
//!
//! On top come what a kubelet and a container image would give: the API server's
//! address (`KUBERNETES_SERVICE_HOST`/`PORT`: the `kubernetes` Service has no endpoints
//! on a loopback control plane), `POD_IP`, `HOSTNAME`, and the image's PATH and env.

use std::collections::BTreeMap;

use anyhow::bail;
use k8s_openapi::api::core::v1::{ConfigMap, Container, Pod, Secret};

use crate::ApiServerAddress;
use crate::images::Image;
use crate::reference;

const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// What a container's environment is built from besides its spec.
pub struct EnvContext<'a> {
    pub client: &'a kube::Client,
    pub pod: &'a Pod,
    pub pod_ip: &'a str,
    pub host_ip: &'a str,
    pub api_server: &'a ApiServerAddress,
    pub image: Option<&'a Image>,
    pub node_cpu: &'a str,
    pub node_memory: &'a str,
}

/// Environment variables in the order they were defined (later ones override).
pub type Environment = Vec<(String, String)>;

pub async fn resolve(
    context: &EnvContext<'_>,
    container: &Container,
) -> anyhow::Result<Environment> {
    let namespace = context
        .pod
        .metadata
        .namespace
        .as_deref()
        .unwrap_or("default");
    let mut env: Environment = Vec::new();
    let set = |env: &mut Environment, name: String, value: String| {
        env.retain(|(existing, _)| *existing != name);
        env.push((name, value));
    };

    let mut path = context
        .image
        .map(|image| image.path.join(":"))
        .unwrap_or_default();
    if !path.is_empty() {
        path.push(':');
    }
    path.push_str(DEFAULT_PATH);
    set(&mut env, "PATH".into(), path);
    if let Some(hostname) = crate::container::hostname(context.pod) {
        set(&mut env, "HOSTNAME".into(), hostname);
    }
    set(&mut env, "HOME".into(), home_of(context.pod, container));
    set(
        &mut env,
        "KUBERNETES_SERVICE_HOST".into(),
        context.api_server.host.clone(),
    );
    set(
        &mut env,
        "KUBERNETES_SERVICE_PORT".into(),
        context.api_server.port.to_string(),
    );
    set(
        &mut env,
        "KUBERNETES_SERVICE_PORT_HTTPS".into(),
        context.api_server.port.to_string(),
    );
    set(&mut env, "POD_IP".into(), context.pod_ip.to_string());
    if let Some(image) = context.image {
        for (name, value) in &image.env {
            set(&mut env, name.clone(), value.clone());
        }
    }

    for source in container.env_from.iter().flatten() {
        let prefix = source.prefix.clone().unwrap_or_default();
        let values = if let Some(reference) = &source.config_map_ref {
            let optional = reference.optional.unwrap_or(false);
            reference::read::<ConfigMap>(context.client, namespace, &reference.name, optional)
                .await?
                .map(|map| map.data.unwrap_or_default())
        } else if let Some(reference) = &source.secret_ref {
            let optional = reference.optional.unwrap_or(false);
            reference::read::<Secret>(context.client, namespace, &reference.name, optional)
                .await?
                .map(secret_strings)
        } else {
            None
        };
        for (key, value) in values.unwrap_or_default() {
            set(&mut env, format!("{prefix}{key}"), value);
        }
    }

    for variable in container.env.iter().flatten() {
        let value = if let Some(source) = &variable.value_from {
            if let Some(field) = &source.field_ref {
                Some(field_value(context, &field.field_path)?)
            } else if let Some(resource) = &source.resource_field_ref {
                Some(resource_value(context, container, &resource.resource))
            } else if let Some(key) = &source.config_map_key_ref {
                let optional = key.optional.unwrap_or(false);
                let map =
                    reference::read::<ConfigMap>(context.client, namespace, &key.name, optional)
                        .await?;
                let value = map.and_then(|map| map.data.unwrap_or_default().remove(&key.key));
                if value.is_none() && !optional {
                    bail!(
                        "key {:?} not found in ConfigMap {namespace}/{}",
                        key.key,
                        key.name
                    );
                }
                value
            } else if let Some(key) = &source.secret_key_ref {
                let optional = key.optional.unwrap_or(false);
                let found =
                    reference::read::<Secret>(context.client, namespace, &key.name, optional)
                        .await?;
                let value = found.and_then(|found| secret_strings(found).remove(&key.key));
                if value.is_none() && !optional {
                    bail!(
                        "key {:?} not found in Secret {namespace}/{}",
                        key.key,
                        key.name
                    );
                }
                value
            } else {
                None
            }
        } else {
            Some(expand(variable.value.as_deref().unwrap_or_default(), &env))
        };
        if let Some(value) = value {
            set(&mut env, variable.name.clone(), value);
        }
    }
    Ok(env)
}

fn home_of(pod: &Pod, container: &Container) -> String {
    match crate::container::run_as(pod, container).0 {
        None | Some(0) => "/root".to_string(),
        Some(_) => "/".to_string(),
    }
}

fn secret_strings(secret: Secret) -> BTreeMap<String, String> {
    let mut values: BTreeMap<String, String> = secret
        .data
        .unwrap_or_default()
        .into_iter()
        .map(|(key, bytes)| (key, String::from_utf8_lossy(&bytes.0).into_owned()))
        .collect();
    values.extend(secret.string_data.unwrap_or_default());
    values
}

/// The value of a `fieldRef` path, as the downward API defines them.
pub fn field_value(context: &EnvContext<'_>, path: &str) -> anyhow::Result<String> {
    let pod = context.pod;
    let meta = &pod.metadata;
    let spec = pod.spec.as_ref();
    let keyed = |prefix: &str| -> Option<String> {
        path.strip_prefix(prefix)
            .and_then(|rest| rest.strip_prefix("['").or_else(|| rest.strip_prefix("[\"")))
            .and_then(|rest| rest.strip_suffix("']").or_else(|| rest.strip_suffix("\"]")))
            .map(str::to_string)
    };
    let value = match path {
        "metadata.name" => meta.name.clone().unwrap_or_default(),
        "metadata.namespace" => meta.namespace.clone().unwrap_or_default(),
        "metadata.uid" => meta.uid.clone().unwrap_or_default(),
        "spec.nodeName" => spec
            .and_then(|spec| spec.node_name.clone())
            .unwrap_or_default(),
        "spec.serviceAccountName" => spec
            .and_then(|spec| spec.service_account_name.clone())
            .unwrap_or_default(),
        "status.podIP" | "status.podIPs" => context.pod_ip.to_string(),
        "status.hostIP" | "status.hostIPs" => context.host_ip.to_string(),
        "metadata.labels" => format_map(meta.labels.as_ref()),
        "metadata.annotations" => format_map(meta.annotations.as_ref()),
        _ => {
            if let Some(key) = keyed("metadata.labels") {
                meta.labels
                    .as_ref()
                    .and_then(|labels| labels.get(&key).cloned())
                    .unwrap_or_default()
            } else if let Some(key) = keyed("metadata.annotations") {
                meta.annotations
                    .as_ref()
                    .and_then(|map| map.get(&key).cloned())
                    .unwrap_or_default()
            } else {
                bail!("unsupported fieldRef {path:?}");
            }
        }
    };
    Ok(value)
}

/// `key="value"` lines, sorted, as the downward API writes labels and annotations.
pub fn format_map(map: Option<&BTreeMap<String, String>>) -> String {
    map.into_iter()
        .flatten()
        .map(|(key, value)| format!("{key}={value:?}\n"))
        .collect()
}

/// `resourceFieldRef`: the container's limit (or request), else the node's capacity,
/// in cores (rounded up) or bytes as the kubelet reports them with the default divisor.
fn resource_value(context: &EnvContext<'_>, container: &Container, resource: &str) -> String {
    let resources = container.resources.as_ref();
    let (kind, name) = resource.split_once('.').unwrap_or(("limits", resource));
    let from_spec = match kind {
        "requests" => resources
            .and_then(|r| r.requests.as_ref())
            .and_then(|map| map.get(name)),
        _ => resources
            .and_then(|r| r.limits.as_ref())
            .and_then(|map| map.get(name)),
    }
    .map(|quantity| quantity.0.clone());
    let quantity = from_spec.unwrap_or_else(|| match name {
        "cpu" => context.node_cpu.to_string(),
        _ => context.node_memory.to_string(),
    });
    if name == "cpu" {
        cores(&quantity).to_string()
    } else {
        bytes(&quantity).map(|b| b.to_string()).unwrap_or(quantity)
    }
}

fn cores(quantity: &str) -> u64 {
    match quantity.strip_suffix('m') {
        Some(milli) => milli.parse::<u64>().map(|m| m.div_ceil(1000)).unwrap_or(1),
        None => quantity
            .parse::<f64>()
            .map(|c| c.ceil() as u64)
            .unwrap_or(1),
    }
}

fn bytes(quantity: &str) -> Option<u64> {
    const SUFFIXES: [(&str, u64); 8] = [
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("k", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
    ];
    for (suffix, factor) in SUFFIXES {
        if let Some(number) = quantity.strip_suffix(suffix) {
            return number.parse::<u64>().ok().map(|n| n * factor);
        }
    }
    quantity.parse().ok()
}

/// Kubernetes' `$(VAR)` expansion: references to defined variables are replaced,
/// `$$` escapes a dollar, and anything else is left as written.
pub fn expand(text: &str, env: &[(String, String)]) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(dollar) = rest.find('$') {
        out.push_str(&rest[..dollar]);
        let after = &rest[dollar + 1..];
        if let Some(stripped) = after.strip_prefix('$') {
            out.push('$');
            rest = stripped;
        } else if let Some(inner) = after.strip_prefix('(')
            && let Some(close) = inner.find(')')
        {
            let name = &inner[..close];
            match env.iter().rev().find(|(key, _)| key == name) {
                Some((_, value)) => out.push_str(value),
                None => {
                    out.push_str("$(");
                    out.push_str(name);
                    out.push(')');
                }
            }
            rest = &inner[close + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expands_defined_variables_only() {
        let env = vec![("A".to_string(), "1".to_string())];
        assert_eq!(expand("x$(A)y$(B)$$(A)$", &env), "x1y$(B)$(A)$");
    }

    #[test]
    fn quantities() {
        assert_eq!(cores("1500m"), 2);
        assert_eq!(cores("8"), 8);
        assert_eq!(bytes("16Gi"), Some(16 << 30));
        assert_eq!(bytes("100M"), Some(100_000_000));
    }
}

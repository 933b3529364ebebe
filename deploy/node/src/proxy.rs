//! The Service proxy, a stand-in for kube-proxy: for every Service with a ClusterIP
//! (from the loopback range the API server hands out), it listens on each TCP
//! `ClusterIP:port` and forwards each connection to one ready pod, round robin.
//!
//! Backends come from the pods the Service selects, not from EndpointSlices: the API
//! server refuses loopback addresses in EndpointSlices ("may not be in the loopback
//! range"), so the endpointslice controller cannot publish these pods. The proxy applies
//! the same rules it would: Running, `Ready` condition True (or any, with
//! `publishNotReadyAddresses`), not terminating; `targetPort` by number or by the
//! container port's name. Changes are picked up within half a second.

use std::collections::{BTreeMap, HashMap};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::Api;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::ProxyArgs;

const RESYNC_INTERVAL: Duration = Duration::from_millis(500);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A Service's frontend.
type Frontend = (Ipv4Addr, u16);

/// The ready backends of each frontend, shared with its listener.
struct Frontends {
    backends: RwLock<HashMap<Frontend, Vec<SocketAddr>>>,
    next: AtomicUsize,
}

impl Frontends {
    fn backends(&self, frontend: Frontend) -> Vec<SocketAddr> {
        // Written as whole-map replacements, so a poisoned lock still holds a valid map.
        let map = self
            .backends
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        map.get(&frontend).cloned().unwrap_or_default()
    }
}

pub async fn run(args: ProxyArgs) -> anyhow::Result<()> {
    let (client, _) = crate::client_from(&args.kubeconfig).await?;
    let services = reflect::<Service>(Api::all(client.clone()));
    let pods = reflect::<Pod>(Api::all(client));
    let frontends = Arc::new(Frontends {
        backends: RwLock::new(HashMap::new()),
        next: AtomicUsize::new(0),
    });
    let mut listeners: HashMap<Frontend, JoinHandle<()>> = HashMap::new();
    tracing::info!("service proxy running");
    loop {
        let table = desired(&services.state(), &pods.state());
        {
            let mut map = frontends
                .backends
                .write()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            *map = table.clone().into_iter().collect();
        }
        listeners.retain(|frontend, listener| {
            let keep = table.contains_key(frontend) && !listener.is_finished();
            if !keep {
                listener.abort();
            }
            keep
        });
        for frontend in table.keys() {
            if !listeners.contains_key(frontend) {
                listeners.insert(
                    *frontend,
                    tokio::spawn(listen(*frontend, frontends.clone())),
                );
            }
        }
        tokio::time::sleep(RESYNC_INTERVAL).await;
    }
}

fn reflect<K>(api: Api<K>) -> Store<K>
where
    K: kube::Resource
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    let (store, writer) = reflector::store();
    let stream = reflector::reflector(writer, watcher::watcher(api, watcher::Config::default()))
        .default_backoff()
        .applied_objects();
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(result) = stream.next().await {
            if let Err(error) = result {
                tracing::warn!("watching: {error}");
            }
        }
    });
    store
}

/// Every TCP frontend of every Service and its ready backends.
fn desired(services: &[Arc<Service>], pods: &[Arc<Pod>]) -> BTreeMap<Frontend, Vec<SocketAddr>> {
    let mut table = BTreeMap::new();
    for service in services {
        let Some(spec) = &service.spec else { continue };
        let Some(cluster_ip) = spec
            .cluster_ip
            .as_deref()
            .and_then(|ip| ip.parse::<Ipv4Addr>().ok())
        else {
            continue;
        };
        let Some(selector) = spec
            .selector
            .as_ref()
            .filter(|selector| !selector.is_empty())
        else {
            continue;
        };
        let namespace = service.metadata.namespace.as_deref().unwrap_or("default");
        let include_unready = spec.publish_not_ready_addresses.unwrap_or(false);
        let selected: Vec<&Pod> = pods
            .iter()
            .map(|pod| pod.as_ref())
            .filter(|pod| pod.metadata.namespace.as_deref() == Some(namespace))
            .filter(|pod| {
                let labels = pod.metadata.labels.as_ref();
                selector
                    .iter()
                    .all(|(key, value)| labels.and_then(|l| l.get(key)) == Some(value))
            })
            .filter(|pod| pod.metadata.deletion_timestamp.is_none())
            .filter(|pod| include_unready || is_ready(pod))
            .collect();
        for port in spec.ports.iter().flatten() {
            if port.protocol.as_deref().unwrap_or("TCP") != "TCP" {
                continue;
            }
            let Ok(service_port) = u16::try_from(port.port) else {
                continue;
            };
            let target = port
                .target_port
                .clone()
                .unwrap_or(IntOrString::Int(port.port));
            let backends = selected
                .iter()
                .filter_map(|pod| {
                    let ip = pod
                        .status
                        .as_ref()?
                        .pod_ip
                        .as_deref()?
                        .parse::<Ipv4Addr>()
                        .ok()?;
                    Some(SocketAddr::from((ip, target_port(pod, &target)?)))
                })
                .collect();
            table.insert((cluster_ip, service_port), backends);
        }
    }
    table
}

fn is_ready(pod: &Pod) -> bool {
    pod.status.as_ref().is_some_and(|status| {
        status.phase.as_deref() == Some("Running")
            && status
                .conditions
                .iter()
                .flatten()
                .any(|condition| condition.type_ == "Ready" && condition.status == "True")
    })
}

fn target_port(pod: &Pod, target: &IntOrString) -> Option<u16> {
    match target {
        IntOrString::Int(port) => u16::try_from(*port).ok(),
        IntOrString::String(name) => pod
            .spec
            .as_ref()?
            .containers
            .iter()
            .flat_map(|container| container.ports.iter().flatten())
            .find(|port| port.name.as_deref() == Some(name.as_str()))
            .and_then(|port| u16::try_from(port.container_port).ok()),
    }
}

async fn listen(frontend: Frontend, frontends: Arc<Frontends>) {
    let listener = match TcpListener::bind(frontend).await {
        Ok(listener) => listener,
        Err(error) => {
            tracing::warn!("listening on {}:{}: {error}", frontend.0, frontend.1);
            // The resync loop notices the finished task and tries again.
            tokio::time::sleep(RESYNC_INTERVAL).await;
            return;
        }
    };
    tracing::info!("forwarding {}:{}", frontend.0, frontend.1);
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        let frontends = frontends.clone();
        tokio::spawn(async move {
            if let Err(message) = forward(client, frontend, &frontends).await {
                tracing::debug!("{}:{}: {message}", frontend.0, frontend.1);
            }
        });
    }
}

/// Connects to a ready backend, starting from the next in round-robin order and
/// trying the others if it refuses, then copies bytes both ways.
async fn forward(
    mut client: TcpStream,
    frontend: Frontend,
    frontends: &Frontends,
) -> Result<(), String> {
    let backends = frontends.backends(frontend);
    if backends.is_empty() {
        return Err("no ready endpoints".to_string());
    }
    let start = frontends.next.fetch_add(1, Ordering::Relaxed);
    for offset in 0..backends.len() {
        let backend = backends[(start + offset) % backends.len()];
        match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(backend)).await {
            Ok(Ok(mut upstream)) => {
                let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                return Ok(());
            }
            _ => continue,
        }
    }
    Err(format!(
        "no endpoint of {} accepted the connection",
        backends.len()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        Container, ContainerPort, PodCondition, PodSpec, PodStatus, ServicePort, ServiceSpec,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn pod(name: &str, ip: &str, ready: bool) -> Arc<Pod> {
        Arc::new(Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("default".into()),
                labels: Some([("app".to_string(), "web".to_string())].into()),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                containers: vec![Container {
                    ports: Some(vec![ContainerPort {
                        name: Some("http".into()),
                        container_port: 8080,
                        ..ContainerPort::default()
                    }]),
                    ..Container::default()
                }],
                ..PodSpec::default()
            }),
            status: Some(PodStatus {
                phase: Some("Running".into()),
                pod_ip: Some(ip.into()),
                conditions: Some(vec![PodCondition {
                    type_: "Ready".into(),
                    status: if ready { "True" } else { "False" }.into(),
                    ..PodCondition::default()
                }]),
                ..PodStatus::default()
            }),
        })
    }

    #[test]
    fn frontends_forward_to_ready_selected_pods_by_port_name() {
        let service = Arc::new(Service {
            metadata: ObjectMeta {
                name: Some("web".into()),
                namespace: Some("default".into()),
                ..ObjectMeta::default()
            },
            spec: Some(ServiceSpec {
                cluster_ip: Some("127.96.0.10".into()),
                selector: Some([("app".to_string(), "web".to_string())].into()),
                ports: Some(vec![ServicePort {
                    port: 80,
                    target_port: Some(IntOrString::String("http".into())),
                    ..ServicePort::default()
                }]),
                ..ServiceSpec::default()
            }),
            ..Service::default()
        });
        let table = desired(
            &[service],
            &[
                pod("a", "127.101.0.2", true),
                pod("b", "127.102.0.2", false),
            ],
        );
        let expected: Vec<SocketAddr> = vec!["127.101.0.2:8080".parse().expect("literal address")];
        assert_eq!(
            table.get(&(Ipv4Addr::new(127, 96, 0, 10), 80)),
            Some(&expected)
        );
    }
}

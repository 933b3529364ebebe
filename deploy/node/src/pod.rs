//! One pod's life on this node, from binding to deletion: address, volumes, init
//! containers in order, then the containers side by side, each with its probes and
//! restart policy; status written back as it changes; and on deletion SIGTERM, SIGKILL
//! after the grace period, and the final delete with grace 0 that a kubelet sends.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use k8s_openapi::api::core::v1::{
    Container, ContainerState, ContainerStateRunning, Pod, PodCondition,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, Preconditions};
use tokio::sync::{Notify, mpsc, watch};

use crate::container::{self, Exit, Launch};
use crate::env::{self, EnvContext};
use crate::events::Severity;
use crate::images;
use crate::logs;
use crate::pods::NodeContext;
use crate::probe::{self, ProbeEvent, ProbeTarget};
use crate::status::{self, ContainerRecord, PodRecord};
use crate::volume::{self, VolumePaths};

/// A back-off never grows past this, as in the kubelet.
const MAX_BACKOFF: Duration = Duration::from_secs(300);
/// A container that ran this long before exiting restarts without back-off.
const BACKOFF_RESET: Duration = Duration::from_secs(600);
const RETRY_INTERVAL: Duration = Duration::from_secs(2);
/// How often `secret` and `configMap` volumes are compared with their objects.
const REFRESH_INTERVAL: Duration = Duration::from_secs(5);
const STATUS_DEBOUNCE: Duration = Duration::from_millis(200);

/// What the node sends a pod's worker: the newest Pod object, and when to stop (with
/// which grace period).
pub struct PodChannels {
    pub pod: watch::Receiver<Pod>,
    pub stop: watch::Receiver<Option<Duration>>,
}

/// The grace period a deleted pod gets.
pub fn grace_period(pod: &Pod) -> Duration {
    let seconds = pod
        .metadata
        .deletion_grace_period_seconds
        .or(pod
            .spec
            .as_ref()
            .and_then(|spec| spec.termination_grace_period_seconds))
        .unwrap_or(30);
    Duration::from_secs(u64::try_from(seconds).unwrap_or(0))
}

struct Worker {
    node: Arc<NodeContext>,
    pod: Pod,
    pod_dir: PathBuf,
    pod_ip: Ipv4Addr,
    pod_ip_text: String,
    host_ip_text: String,
    record: Arc<Mutex<PodRecord>>,
    changed: Arc<Notify>,
    stop: watch::Receiver<Option<Duration>>,
}

#[derive(Clone, Copy)]
enum Slot {
    Init(usize),
    Main(usize),
}

enum RunResult {
    Succeeded,
    Failed,
    Stopped,
}

pub async fn run(node: Arc<NodeContext>, channels: PodChannels) {
    let pod = channels.pod.borrow().clone();
    let name = volume::describe(&pod);
    if let Err(error) = run_pod(node, pod, channels).await {
        tracing::error!(pod = name, "{error:#}");
    }
}

async fn run_pod(node: Arc<NodeContext>, pod: Pod, channels: PodChannels) -> anyhow::Result<()> {
    let uid = pod.metadata.uid.clone().context("pod has no uid")?;
    let pod_dir = volume::pod_dir(&node.state_dir, &uid);
    std::fs::create_dir_all(&pod_dir).with_context(|| format!("creating {}", pod_dir.display()))?;
    let host_network = pod
        .spec
        .as_ref()
        .and_then(|spec| spec.host_network)
        .unwrap_or(false);
    let pod_ip = if host_network {
        node.identity.address
    } else {
        pod_address(&node, &pod_dir)?
    };
    let key = pod_key(&pod);
    node.register_pod_dir(key.clone(), pod_dir.clone());

    let record = Arc::new(Mutex::new(initial_record(
        &pod,
        &pod_dir,
        pod_ip,
        node.identity.address,
    )));
    let changed = Arc::new(Notify::new());
    let writer = tokio::spawn(write_status(
        node.clone(),
        pod.clone(),
        record.clone(),
        changed.clone(),
    ));
    changed.notify_one();
    tracing::info!(pod = volume::describe(&pod), %pod_ip, "starting pod");

    let worker = Worker {
        node: node.clone(),
        pod,
        pod_dir: pod_dir.clone(),
        pod_ip,
        pod_ip_text: pod_ip.to_string(),
        host_ip_text: node.identity.address.to_string(),
        record,
        changed: changed.clone(),
        stop: channels.stop,
    };
    worker.run_containers().await;

    // Everything has exited (or the pod was finished and is now being deleted).
    let mut stop = worker.stop.clone();
    let _ = stop.wait_for(Option::is_some).await;
    changed.notify_one();
    tokio::time::sleep(STATUS_DEBOUNCE * 2).await;
    writer.abort();
    let latest = channels.pod.borrow().clone();
    if !node.is_shutting_down() {
        finish_deletion(&node, &latest).await;
        if !host_network {
            node.addresses.release(pod_ip);
        }
        volume::remove_pod_dir(&pod_dir);
        node.forget_pod_dir(&key);
        tracing::info!(pod = volume::describe(&latest), "pod terminated");
    }
    Ok(())
}

pub fn pod_key(pod: &Pod) -> (String, String) {
    (
        pod.metadata.namespace.clone().unwrap_or_default(),
        pod.metadata.name.clone().unwrap_or_default(),
    )
}

/// The pod's address, the same one across node restarts (kept in its directory).
fn pod_address(node: &NodeContext, pod_dir: &Path) -> anyhow::Result<Ipv4Addr> {
    let file = pod_dir.join("address");
    if let Some(address) = std::fs::read_to_string(&file)
        .ok()
        .and_then(|text| text.trim().parse().ok())
        && node.addresses.claim(address)
    {
        return Ok(address);
    }
    let address = node.addresses.allocate()?;
    std::fs::write(&file, address.to_string())
        .with_context(|| format!("recording pod address in {}", file.display()))?;
    Ok(address)
}

fn initial_record(pod: &Pod, pod_dir: &Path, pod_ip: Ipv4Addr, host_ip: Ipv4Addr) -> PodRecord {
    let spec = pod.spec.clone().unwrap_or_default();
    let init = spec.init_containers.unwrap_or_default();
    let waiting_reason = if init.is_empty() {
        "ContainerCreating"
    } else {
        "PodInitializing"
    };
    let record_of = |container: &Container, reason: &str| {
        let mut record = ContainerRecord::waiting(
            &container.name,
            container.image.as_deref().unwrap_or_default(),
            reason,
        );
        record.restart_count =
            i32::try_from(logs::runs(pod_dir, &container.name).len()).unwrap_or(i32::MAX);
        record
    };
    PodRecord {
        pod_ip: Some(pod_ip),
        host_ip,
        start_time: pod
            .status
            .as_ref()
            .and_then(|status| status.start_time.clone())
            .map(|time| time.0)
            .unwrap_or_else(Timestamp::now),
        init_containers: init
            .iter()
            .map(|c| record_of(c, "PodInitializing"))
            .collect(),
        containers: spec
            .containers
            .iter()
            .map(|c| record_of(c, waiting_reason))
            .collect(),
        initialized: init.is_empty(),
        init_failed: false,
        blocked: None,
    }
}

/// Writes the pod's status whenever the record changes (coalescing bursts).
async fn write_status(
    node: Arc<NodeContext>,
    pod: Pod,
    record: Arc<Mutex<PodRecord>>,
    changed: Arc<Notify>,
) {
    let (namespace, name) = pod_key(&pod);
    let uid = pod.metadata.uid.clone();
    let pods: Api<Pod> = Api::namespaced(node.client.clone(), &namespace);
    let mut conditions: Vec<PodCondition> = pod
        .status
        .as_ref()
        .and_then(|status| status.conditions.clone())
        .unwrap_or_default();
    loop {
        changed.notified().await;
        tokio::time::sleep(STATUS_DEBOUNCE).await;
        if node.is_shutting_down() {
            continue;
        }
        let snapshot = lock(&record).clone();
        let status = status::pod_status(&snapshot, &conditions, Timestamp::now());
        conditions = status.conditions.clone().unwrap_or_default();
        // The uid makes the patch fail on a newer pod of the same name (a StatefulSet's
        // replacement) instead of overwriting its status, as the kubelet's patches do.
        let patch = serde_json::json!({ "metadata": { "uid": uid }, "status": status });
        match pods
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => return,
            // Replaced by a pod with another uid (uid is immutable), or a status the
            // API server refuses: say which, since the pod's status stops here.
            Err(kube::Error::Api(status)) if status.code == 422 => {
                tracing::warn!(
                    pod = format!("{namespace}/{name}"),
                    "pod status refused; no longer writing it: {}",
                    status.message
                );
                return;
            }
            Err(error) => {
                tracing::warn!(
                    pod = format!("{namespace}/{name}"),
                    "writing pod status: {error}"
                );
                // Try again soon: the next change may be a while away.
                let changed = changed.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(RETRY_INTERVAL).await;
                    changed.notify_one();
                });
            }
        }
    }
}

/// The kubelet's last word on a deleted pod: remove it for good once its processes are
/// gone. The uid precondition keeps a new pod of the same name safe.
async fn finish_deletion(node: &NodeContext, pod: &Pod) {
    let (namespace, name) = pod_key(pod);
    let pods: Api<Pod> = Api::namespaced(node.client.clone(), &namespace);
    let params = DeleteParams {
        grace_period_seconds: Some(0),
        preconditions: Some(Preconditions {
            uid: pod.metadata.uid.clone(),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    match pods.delete(&name, &params).await {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => {}
        Err(error) => tracing::warn!(
            pod = format!("{namespace}/{name}"),
            "deleting terminated pod: {error}"
        ),
    }
}

/// The grace period the pod is stopped with, once it is. (A closed channel means the
/// node dropped the pod: stop at once.)
async fn wait_for_stop(stop: &mut watch::Receiver<Option<Duration>>) -> Duration {
    match stop.wait_for(Option::is_some).await {
        Ok(grace) => grace.unwrap_or_default(),
        Err(_closed) => Duration::ZERO,
    }
}

fn lock(record: &Mutex<PodRecord>) -> std::sync::MutexGuard<'_, PodRecord> {
    // A panic elsewhere cannot leave a half-written record: every update is one assignment.
    record
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Worker {
    fn stopping(&self) -> Option<Duration> {
        *self.stop.borrow()
    }

    fn update(&self, slot: Slot, change: impl FnOnce(&mut ContainerRecord)) {
        {
            let mut record = lock(&self.record);
            let container = match slot {
                Slot::Init(index) => record.init_containers.get_mut(index),
                Slot::Main(index) => record.containers.get_mut(index),
            };
            if let Some(container) = container {
                change(container);
            }
        }
        self.changed.notify_one();
    }

    fn event(&self, severity: Severity, reason: &str, action: &str, note: String) {
        self.node
            .events
            .publish(&self.pod, severity, reason, action, note);
    }

    fn update_pod(&self, change: impl FnOnce(&mut PodRecord)) {
        change(&mut lock(&self.record));
        self.changed.notify_one();
    }

    /// Sleeps, unless the pod is stopped first; true if it was.
    async fn sleep_or_stop(&self, duration: Duration) -> bool {
        let mut stop = self.stop.clone();
        tokio::select! {
            _ = tokio::time::sleep(duration) => false,
            _ = stop.wait_for(Option::is_some) => true,
        }
    }

    async fn run_containers(&self) {
        let spec = self.pod.spec.clone().unwrap_or_default();
        let volumes = loop {
            if self.stopping().is_some() {
                return;
            }
            match volume::prepare(&self.env_context(None), &self.pod_dir).await {
                Ok(volumes) => break volumes,
                Err(error) => {
                    let message = format!("{error:#}");
                    tracing::info!(pod = volume::describe(&self.pod), "waiting: {message}");
                    self.event(Severity::Warning, "FailedMount", "Mount", message.clone());
                    self.update_pod(|record| record.blocked = Some(message));
                    if self.sleep_or_stop(RETRY_INTERVAL).await {
                        return;
                    }
                }
            }
        };
        self.update_pod(|record| record.blocked = None);

        for (index, container) in spec.init_containers.iter().flatten().enumerate() {
            match self.supervise(Slot::Init(index), container, &volumes).await {
                RunResult::Succeeded => {}
                RunResult::Failed => {
                    self.update_pod(|record| record.init_failed = true);
                    return;
                }
                RunResult::Stopped => return,
            }
        }
        self.update_pod(|record| {
            record.initialized = true;
            for container in &mut record.containers {
                if container.state.waiting.is_some() {
                    container.state = status::waiting("ContainerCreating", None);
                }
            }
        });
        let runs = spec
            .containers
            .iter()
            .enumerate()
            .map(|(index, container)| self.supervise(Slot::Main(index), container, &volumes));
        // Secret and ConfigMap volumes follow their objects while the containers run.
        let refresh = async {
            while !self.sleep_or_stop(REFRESH_INTERVAL).await {
                if let Err(error) = volume::refresh(&self.env_context(None), &self.pod_dir).await {
                    tracing::info!(pod = volume::describe(&self.pod), "{error:#}");
                }
            }
            std::future::pending::<()>().await;
        };
        tokio::select! {
            _ = futures::future::join_all(runs) => {}
            () = refresh => {}
        }
    }

    fn env_context<'a>(&'a self, image: Option<&'a images::Image>) -> EnvContext<'a> {
        EnvContext {
            client: &self.node.client,
            pod: &self.pod,
            pod_ip: &self.pod_ip_text,
            host_ip: &self.host_ip_text,
            api_server: &self.node.api_server,
            image,
            node_cpu: &self.node.identity.cpu,
            node_memory: &self.node.identity.memory,
        }
    }

    /// Everything needed to start the container, or why it cannot start yet.
    async fn launch(&self, container: &Container, volumes: &VolumePaths) -> anyhow::Result<Launch> {
        let image = container
            .image
            .as_deref()
            .and_then(|image| self.node.images.find(image));
        let context = self.env_context(image);
        let environment = env::resolve(&context, container).await?;
        let expand = |items: &Option<Vec<String>>| -> Vec<String> {
            items
                .iter()
                .flatten()
                .map(|item| env::expand(item, &environment))
                .collect()
        };
        let argv = images::argv(image, &expand(&container.command), &expand(&container.args));
        let (uid, gid) = container::run_as(&self.pod, container);
        Ok(Launch {
            argv,
            mounts: container::bind_mounts(container, volumes)?,
            uid,
            gid,
            groups: container::supplementary_groups(&self.pod),
            workdir: container
                .working_dir
                .clone()
                .filter(|dir| !dir.is_empty())
                .map(PathBuf::from),
            hostname: container::hostname(&self.pod),
            marker: format!("{}/{}", self.pod_dir.display(), container.name),
            env: environment,
        })
    }

    /// Runs a container until it is done for good (by its restart policy), or the pod
    /// is stopped.
    async fn supervise(
        &self,
        slot: Slot,
        container: &Container,
        volumes: &VolumePaths,
    ) -> RunResult {
        let init = matches!(slot, Slot::Init(_));
        let restart_policy = self
            .pod
            .spec
            .as_ref()
            .and_then(|spec| spec.restart_policy.clone())
            .unwrap_or_else(|| "Always".to_string());
        let owner = format!("{} {}", volume::describe(&self.pod), container.name);
        let mut backoff: Option<Duration> = None;
        loop {
            if self.stopping().is_some() {
                return RunResult::Stopped;
            }
            let launch = match self.launch(container, volumes).await {
                Ok(launch) => launch,
                Err(error) => {
                    let message = format!("{error:#}");
                    self.event(
                        Severity::Warning,
                        "Failed",
                        "Create",
                        format!("Error: {message}"),
                    );
                    self.update(slot, |record| {
                        record.state = status::waiting("CreateContainerConfigError", Some(message))
                    });
                    if self.sleep_or_stop(RETRY_INTERVAL).await {
                        return RunResult::Stopped;
                    }
                    continue;
                }
            };
            let run = logs::runs(&self.pod_dir, &container.name)
                .last()
                .map_or(0, |last| last + 1);
            let log_file = logs::run_file(&self.pod_dir, &container.name, run);
            let started_at = Timestamp::now();
            let began = Instant::now();
            let exit = match container::spawn(&launch, &log_file, &self.node.registry, &owner) {
                Ok(mut process) => {
                    logs::prune(&self.pod_dir, &container.name);
                    self.node.set_log_live(&log_file, true);
                    self.event(
                        Severity::Normal,
                        "Started",
                        "Start",
                        format!("Started container {}", container.name),
                    );
                    self.update(slot, |record| {
                        record.state = ContainerState {
                            running: Some(ContainerStateRunning {
                                started_at: Some(Time(started_at)),
                            }),
                            ..ContainerState::default()
                        };
                        record.restart_count = i32::try_from(run).unwrap_or(i32::MAX);
                        record.started = false;
                        record.ready = false;
                    });
                    let exit = self
                        .watch_run(slot, container, &launch, &mut process, init)
                        .await;
                    self.node.set_log_live(&log_file, false);
                    exit
                }
                Err(error) => {
                    // As a runtime's StartError: the run counts, with exit code 128.
                    let _ = std::fs::write(&log_file, format!("{error:#}\n"));
                    tracing::warn!(container = owner, "{error:#}");
                    Exit {
                        code: 128,
                        signal: None,
                    }
                }
            };
            let finished_at = Timestamp::now();
            let terminated =
                status::terminated(exit.code, exit.signal, Some(Time(started_at)), finished_at);
            let restart = match restart_policy.as_str() {
                "Never" => false,
                "OnFailure" => exit.code != 0,
                _ if init => exit.code != 0,
                _ => true,
            };
            if !restart || self.stopping().is_some() {
                self.update(slot, |record| {
                    record.state = terminated;
                    record.ready = false;
                    record.started = false;
                    record.finished = true;
                });
                if self.stopping().is_some() {
                    return RunResult::Stopped;
                }
                return if exit.code == 0 {
                    RunResult::Succeeded
                } else {
                    RunResult::Failed
                };
            }
            // Restart: at once the first time, then after a doubling back-off.
            if began.elapsed() >= BACKOFF_RESET {
                backoff = None;
            }
            let delay = backoff.unwrap_or(Duration::ZERO);
            backoff = Some(match backoff {
                None => self.node.restart_backoff,
                Some(previous) => (previous * 2).min(MAX_BACKOFF),
            });
            let message = format!(
                "back-off {}s restarting failed container={} pod={}",
                delay.as_secs(),
                container.name,
                volume::describe(&self.pod)
            );
            if !delay.is_zero() {
                self.event(
                    Severity::Warning,
                    "BackOff",
                    "Restart",
                    format!("Back-off restarting failed container {}", container.name),
                );
            }
            self.update(slot, |record| {
                record.last_state = Some(terminated.clone());
                record.ready = false;
                record.started = false;
                record.state = if delay.is_zero() {
                    terminated
                } else {
                    status::waiting("CrashLoopBackOff", Some(message))
                };
            });
            if self.sleep_or_stop(delay).await {
                return RunResult::Stopped;
            }
        }
    }

    /// Follows one run until it ends: by itself, killed after failed probes, or
    /// terminated because the pod is stopping.
    async fn watch_run(
        &self,
        slot: Slot,
        container: &Container,
        launch: &Launch,
        process: &mut container::Process,
        init: bool,
    ) -> Exit {
        let (events_tx, mut events) = mpsc::channel(8);
        let probes = (!init).then(|| {
            tokio::spawn(probe::watch(
                ProbeTarget {
                    pod_ip: self.pod_ip.to_string(),
                    container: container.clone(),
                    launch: launch.clone(),
                },
                events_tx,
            ))
        });
        let mut stop = self.stop.clone();
        let registry = &self.node.registry;
        // False once the probe task is done (no probes left to run): its channel then
        // reports None at once, forever, and must not be polled again.
        let mut probing = probes.is_some();
        let outcome = loop {
            tokio::select! {
                exit = container::wait(process, registry) => break exit,
                event = events.recv(), if probing => match event {
                    Some(ProbeEvent::Started) => self.update(slot, |record| record.started = true),
                    Some(ProbeEvent::Ready(ready)) => self.update(slot, |record| record.ready = ready),
                    Some(ProbeEvent::Kill(reason)) => {
                        tracing::info!(container = container.name, pod = volume::describe(&self.pod), "{reason}; restarting");
                        self.event(Severity::Warning, "Unhealthy", "Probe", reason.clone());
                        self.event(
                            Severity::Normal,
                            "Killing",
                            "Kill",
                            format!("Container {} failed a probe, will be restarted", container.name),
                        );
                        let grace = grace_period(&self.pod);
                        break container::terminate(process, grace, registry).await;
                    }
                    None => probing = false,
                },
                grace = wait_for_stop(&mut stop) => {
                    self.event(Severity::Normal, "Killing", "Kill", format!("Stopping container {}", container.name));
                    break container::terminate(process, grace, registry).await;
                }
            }
        };
        if let Some(probes) = probes {
            probes.abort();
        }
        outcome
    }
}

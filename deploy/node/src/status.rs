//! What the node knows about a pod's containers, and the pure translation of it into a
//! `PodStatus` as a kubelet reports it: phase, the four standard conditions, container
//! states with exit codes and restart counts, and the pod's address.

use std::net::Ipv4Addr;

use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateTerminated, ContainerStateWaiting, ContainerStatus, HostIP,
    PodCondition, PodIP, PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

/// One container as the node runs it.
#[derive(Clone, Debug, Default)]
pub struct ContainerRecord {
    pub name: String,
    pub image: String,
    pub state: ContainerState,
    pub last_state: Option<ContainerState>,
    pub restart_count: i32,
    pub ready: bool,
    /// Past its startup probe (or started, without one).
    pub started: bool,
    /// Will not run again: exited and its restart policy says so.
    pub finished: bool,
}

impl ContainerRecord {
    pub fn waiting(name: &str, image: &str, reason: &str) -> Self {
        Self {
            name: name.to_string(),
            image: image.to_string(),
            state: waiting(reason, None),
            ..Self::default()
        }
    }

    fn exit_code(&self) -> Option<i32> {
        self.state
            .terminated
            .as_ref()
            .map(|terminated| terminated.exit_code)
    }

    fn status(&self) -> ContainerStatus {
        ContainerStatus {
            name: self.name.clone(),
            image: self.image.clone(),
            image_id: format!("castellan-devnode://{}", self.image),
            container_id: Some(format!("castellan-devnode://{}", self.name)),
            state: Some(self.state.clone()),
            last_state: self.last_state.clone(),
            restart_count: self.restart_count,
            ready: self.ready,
            started: Some(self.started),
            ..ContainerStatus::default()
        }
    }
}

pub fn waiting(reason: &str, message: Option<String>) -> ContainerState {
    ContainerState {
        waiting: Some(ContainerStateWaiting {
            reason: Some(reason.to_string()),
            message,
        }),
        ..ContainerState::default()
    }
}

pub fn terminated(
    exit_code: i32,
    signal: Option<i32>,
    started_at: Option<Time>,
    finished_at: Timestamp,
) -> ContainerState {
    ContainerState {
        terminated: Some(ContainerStateTerminated {
            exit_code,
            signal,
            reason: Some(if exit_code == 0 { "Completed" } else { "Error" }.to_string()),
            started_at,
            finished_at: Some(Time(finished_at)),
            ..ContainerStateTerminated::default()
        }),
        ..ContainerState::default()
    }
}

/// Everything the node knows about one pod.
#[derive(Clone, Debug)]
pub struct PodRecord {
    pub pod_ip: Option<Ipv4Addr>,
    pub host_ip: Ipv4Addr,
    pub start_time: Timestamp,
    pub init_containers: Vec<ContainerRecord>,
    pub containers: Vec<ContainerRecord>,
    pub initialized: bool,
    /// An init container failed for good (restartPolicy Never).
    pub init_failed: bool,
    /// Why the pod cannot start yet (a volume, an environment reference), if so.
    pub blocked: Option<String>,
}

/// The pod's phase from its containers, following the kubelet's rules.
pub fn phase(record: &PodRecord) -> &'static str {
    if record.init_failed {
        return "Failed";
    }
    if !record.initialized {
        return "Pending";
    }
    if !record.containers.is_empty() && record.containers.iter().all(|c| c.finished) {
        return if record.containers.iter().all(|c| c.exit_code() == Some(0)) {
            "Succeeded"
        } else {
            "Failed"
        };
    }
    let ever_ran = |container: &ContainerRecord| {
        container.state.running.is_some()
            || container.state.terminated.is_some()
            || container.restart_count > 0
    };
    if record.containers.iter().any(ever_ran) {
        "Running"
    } else {
        "Pending"
    }
}

/// The pod's status. `previous` keeps each condition's transition time while its
/// status does not change.
pub fn pod_status(record: &PodRecord, previous: &[PodCondition], now: Timestamp) -> PodStatus {
    let phase = phase(record);
    let containers_ready =
        !record.containers.is_empty() && record.containers.iter().all(|c| c.ready);
    let not_ready_message = || {
        let names: Vec<&str> = record
            .containers
            .iter()
            .filter(|c| !c.ready)
            .map(|c| c.name.as_str())
            .collect();
        format!("containers with unready status: [{}]", names.join(" "))
    };
    let condition = |type_: &str, status: bool, reason: Option<&str>, message: Option<String>| {
        let status = if status { "True" } else { "False" };
        let since = previous
            .iter()
            .find(|old| old.type_ == type_ && old.status == status)
            .and_then(|old| old.last_transition_time.clone())
            .unwrap_or(Time(now));
        PodCondition {
            type_: type_.to_string(),
            status: status.to_string(),
            reason: reason.map(str::to_string),
            message,
            last_transition_time: Some(since),
            ..PodCondition::default()
        }
    };
    let unready_reason = |ready: bool| (!ready).then_some("ContainersNotReady");
    let unready_message = |ready: bool| (!ready).then(not_ready_message);
    let (initialized_reason, initialized_message) = if record.initialized {
        (None, None)
    } else {
        let pending: Vec<&str> = record
            .init_containers
            .iter()
            .filter(|c| c.exit_code() != Some(0))
            .map(|c| c.name.as_str())
            .collect();
        (
            Some("ContainersNotInitialized"),
            Some(format!(
                "containers with incomplete status: [{}]",
                pending.join(" ")
            )),
        )
    };
    let conditions = vec![
        condition(
            "PodReadyToStartContainers",
            record.pod_ip.is_some() && record.blocked.is_none(),
            None,
            record.blocked.clone(),
        ),
        condition(
            "Initialized",
            record.initialized,
            initialized_reason,
            initialized_message,
        ),
        condition(
            "Ready",
            containers_ready,
            unready_reason(containers_ready),
            unready_message(containers_ready),
        ),
        condition(
            "ContainersReady",
            containers_ready,
            unready_reason(containers_ready),
            unready_message(containers_ready),
        ),
        condition("PodScheduled", true, None, None),
    ];
    let address = record.pod_ip.map(|ip| ip.to_string());
    PodStatus {
        phase: Some(phase.to_string()),
        conditions: Some(conditions),
        host_ip: Some(record.host_ip.to_string()),
        host_ips: Some(vec![HostIP {
            ip: record.host_ip.to_string(),
        }]),
        pod_ip: address.clone(),
        pod_ips: address.map(|ip| vec![PodIP { ip }]),
        start_time: Some(Time(record.start_time)),
        init_container_statuses: (!record.init_containers.is_empty()).then(|| {
            record
                .init_containers
                .iter()
                .map(ContainerRecord::status)
                .collect()
        }),
        container_statuses: Some(
            record
                .containers
                .iter()
                .map(ContainerRecord::status)
                .collect(),
        ),
        // The API server sets the QoS class from the pod's resources when the pod is
        // created and refuses any change to it, so the node leaves it alone.
        qos_class: None,
        ..PodStatus::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ContainerStateRunning;

    fn record(containers: Vec<ContainerRecord>) -> PodRecord {
        PodRecord {
            pod_ip: Some(Ipv4Addr::new(127, 101, 0, 2)),
            host_ip: Ipv4Addr::LOCALHOST,
            start_time: Timestamp::UNIX_EPOCH,
            init_containers: Vec::new(),
            containers,
            initialized: true,
            init_failed: false,
            blocked: None,
        }
    }

    fn running(ready: bool) -> ContainerRecord {
        ContainerRecord {
            name: "server".into(),
            state: ContainerState {
                running: Some(ContainerStateRunning { started_at: None }),
                ..ContainerState::default()
            },
            ready,
            started: true,
            ..ContainerRecord::default()
        }
    }

    fn condition<'a>(status: &'a PodStatus, type_: &str) -> Option<&'a str> {
        status
            .conditions
            .iter()
            .flatten()
            .find(|c| c.type_ == type_)
            .map(|c| c.status.as_str())
    }

    #[test]
    fn ready_follows_the_containers() {
        let status = pod_status(&record(vec![running(false)]), &[], Timestamp::UNIX_EPOCH);
        assert_eq!(status.phase.as_deref(), Some("Running"));
        assert_eq!(condition(&status, "Ready"), Some("False"));
        let status = pod_status(&record(vec![running(true)]), &[], Timestamp::UNIX_EPOCH);
        assert_eq!(condition(&status, "Ready"), Some("True"));
        assert_eq!(status.pod_ip.as_deref(), Some("127.101.0.2"));
    }

    #[test]
    fn phase_of_finished_pods() {
        let done = ContainerRecord {
            state: terminated(0, None, None, Timestamp::UNIX_EPOCH),
            finished: true,
            ..ContainerRecord::default()
        };
        assert_eq!(phase(&record(vec![done.clone()])), "Succeeded");
        let mut failed = done.clone();
        failed.state = terminated(3, None, None, Timestamp::UNIX_EPOCH);
        assert_eq!(phase(&record(vec![done, failed])), "Failed");
        let mut pending = record(vec![ContainerRecord::waiting("a", "i", "PodInitializing")]);
        pending.initialized = false;
        assert_eq!(phase(&pending), "Pending");
    }

    #[test]
    fn transition_times_survive_unchanged_conditions() {
        let first = pod_status(&record(vec![running(true)]), &[], Timestamp::UNIX_EPOCH);
        let later = Timestamp::from_second(100).unwrap_or(Timestamp::UNIX_EPOCH);
        let second = pod_status(
            &record(vec![running(true)]),
            first.conditions.as_deref().unwrap_or_default(),
            later,
        );
        let ready = second
            .conditions
            .iter()
            .flatten()
            .find(|c| c.type_ == "Ready")
            .and_then(|c| c.last_transition_time.clone());
        assert_eq!(ready, Some(Time(Timestamp::UNIX_EPOCH)));
    }
}

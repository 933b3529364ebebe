//! Events about pods, as the kubelet records them (`Started`, `Killing`, `BackOff`,
//! `Unhealthy`, `FailedMount`, `Failed`), so `kubectl describe pod` and
//! `kubectl get events` tell what the node did and why.
//!
//! Publishing is fire-and-forget: an Event that cannot be written is logged, and never
//! holds up a pod.

use k8s_openapi::api::core::v1::Pod;
use kube::Resource;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};

#[derive(Clone)]
pub struct PodEvents {
    recorder: Recorder,
}

/// Whether an Event reports something normal or something that went wrong.
#[derive(Clone, Copy)]
pub enum Severity {
    Normal,
    Warning,
}

impl PodEvents {
    pub fn new(client: kube::Client, node_name: &str) -> Self {
        let reporter = Reporter {
            controller: "kubelet".to_string(),
            instance: Some(node_name.to_string()),
        };
        Self {
            recorder: Recorder::new(client, reporter),
        }
    }

    pub fn publish(&self, pod: &Pod, severity: Severity, reason: &str, action: &str, note: String) {
        let event = Event {
            type_: match severity {
                Severity::Normal => EventType::Normal,
                Severity::Warning => EventType::Warning,
            },
            reason: reason.to_string(),
            // The API server refuses notes longer than 1 kB.
            note: Some(note.chars().take(1000).collect()),
            action: action.to_string(),
            secondary: None,
        };
        let reference = pod.object_ref(&());
        let recorder = self.recorder.clone();
        tokio::spawn(async move {
            if let Err(error) = recorder.publish(&event, &reference).await {
                tracing::debug!("publishing Event {}: {error}", event.reason);
            }
        });
    }
}

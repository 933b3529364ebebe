//! Volume health: the pool's state on a node, told to the volumes on it and to their
//! users, so that the database side can react to a degraded disk under it.
//!
//! After each pool pass the agent compares every PersistentVolume of the pool on its
//! node (labels `castellan.io/node`, `castellan.io/pool`) with the node's pool health
//! and, where they differ, writes the health onto the volume and its claim (the
//! annotations [`POOL_HEALTH_ANNOTATION`] and [`POOL_HEALTH_MESSAGE_ANNOTATION`]), a
//! `PoolHealthy` condition on the claim, and an Event on the volume and on the claim
//! when the volume turns unhealthy (`VolumeDegraded`, Warning) or healthy again
//! (`VolumeHealthy`). A PersistentVolume has no conditions in the Kubernetes API, so
//! the volume gets the annotations and the Event only; the volume's Event is for an
//! administrator who looks at volumes (`kubectl describe pv`), and for a volume whose
//! claim is gone. Nothing is written while nothing changes. The operator turns its
//! instances' claims' annotations into the DatabaseCluster's `VolumesHealthy`
//! condition and each instance's `volumeHealth`.

use castellan_crds::storage_pool::{
    POOL_HEALTH_ANNOTATION, POOL_HEALTH_MESSAGE_ANNOTATION, PoolNodeStatus,
};
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::events::{Event, EventType};
use kube::{Client, Resource, ResourceExt};
use serde_json::json;

use super::machine::HEALTHY;
use crate::events::Recorder;
use crate::kube_ops::{NODE_LABEL, POOL_LABEL, apply_status};

/// The claim's condition type.
pub const CONDITION: &str = "PoolHealthy";
/// Field manager of the claim's condition.
const MANAGER: &str = "castellan-agent-health";
/// Annotation values are kept short.
const MESSAGE_LIMIT: usize = 1024;

/// What a volume reports: its pool's health on its node, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    pub health: String,
    pub message: String,
}

impl Report {
    pub fn of(status: &PoolNodeStatus) -> Option<Self> {
        let health = status.health.clone()?;
        let mut message = status.message.clone().unwrap_or_default();
        if message.len() > MESSAGE_LIMIT {
            let mut end = MESSAGE_LIMIT;
            while !message.is_char_boundary(end) {
                end -= 1;
            }
            message.truncate(end);
            message.push('…');
        }
        Some(Self { health, message })
    }

    fn healthy(&self) -> bool {
        self.health == HEALTHY
    }
}

/// What the volume says now, from its annotations.
pub fn reported(pv: &PersistentVolume) -> Option<Report> {
    let annotations = pv.annotations();
    Some(Report {
        health: annotations.get(POOL_HEALTH_ANNOTATION)?.clone(),
        message: annotations
            .get(POOL_HEALTH_MESSAGE_ANNOTATION)
            .cloned()
            .unwrap_or_default(),
    })
}

/// The Event a change from `previous` to `now` deserves: turning unhealthy, or healthy
/// again; none for a volume first seen healthy or staying as it was.
pub fn event(previous: Option<&Report>, now: &Report) -> Option<(EventType, &'static str)> {
    let was_healthy = previous.is_none_or(Report::healthy);
    match (was_healthy, now.healthy()) {
        (true, false) => Some((EventType::Warning, "VolumeDegraded")),
        (false, true) => Some((EventType::Normal, "VolumeHealthy")),
        (false, false) if previous.is_some_and(|p| p.health != now.health) => {
            Some((EventType::Warning, "VolumeDegraded"))
        }
        _ => None,
    }
}

/// The Event that the volume and its claim both get when pool `pool` on `node` goes
/// from `previous` to `now` (see [`event`] for when), with one note for both: a user
/// who reads either learns the same thing.
pub fn notice(
    previous: Option<&Report>,
    now: &Report,
    (node, pool): (&str, &str),
) -> Option<Event> {
    let (type_, reason) = event(previous, now)?;
    let note = if now.healthy() {
        format!("pool {pool} is healthy again on node {node}")
    } else {
        format!(
            "pool {pool} is {} on node {node}, where this volume is: {}",
            now.health, now.message
        )
    };
    Some(Event {
        type_,
        reason: reason.to_string(),
        note: Some(crate::events::note(&note)),
        action: "Monitor".to_string(),
        secondary: None,
    })
}

/// Tells the volumes of pool `pool` on `node` the node's pool status.
pub async fn apply(
    client: &Client,
    recorder: &Recorder,
    (node, pool): (&str, &str),
    status: &PoolNodeStatus,
) -> Result<(), kube::Error> {
    let Some(now) = Report::of(status) else {
        return Ok(());
    };
    let volumes: Api<PersistentVolume> = Api::all(client.clone());
    let selector = format!("{NODE_LABEL}={node},{POOL_LABEL}={pool}");
    for pv in volumes
        .list(&ListParams::default().labels(&selector))
        .await?
    {
        let previous = reported(&pv);
        if previous.as_ref() == Some(&now) {
            continue;
        }
        let annotations = json!({ "metadata": { "annotations": {
            POOL_HEALTH_ANNOTATION: now.health,
            POOL_HEALTH_MESSAGE_ANNOTATION: now.message,
        }}});
        volumes
            .patch(
                &pv.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&annotations),
            )
            .await?;
        tracing::info!(%node, %pool, volume = %pv.name_any(), health = %now.health, "volume health written");
        let news = notice(previous.as_ref(), &now, (node, pool));
        // A PersistentVolume is cluster-scoped: the Recorder files its Event in the
        // namespace `default` (the agent may create Events in any namespace), where
        // `kubectl describe pv` finds it.
        if let Some(event) = &news
            && let Err(error) = recorder.publish(event, &pv.object_ref(&())).await
        {
            tracing::warn!(%node, %pool, volume = %pv.name_any(), %error, "publishing an Event failed");
        }
        let Some(reference) = pv.spec.as_ref().and_then(|spec| spec.claim_ref.clone()) else {
            continue;
        };
        let (Some(namespace), Some(name)) = (reference.namespace.clone(), reference.name.clone())
        else {
            continue;
        };
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &namespace);
        claims
            .patch(&name, &PatchParams::default(), &Patch::Merge(&annotations))
            .await?;
        let condition = json!({ "conditions": [{
                "type": CONDITION,
                "status": if now.healthy() { "True" } else { "False" },
                "reason": now.health,
                "message": format!("pool {pool} on node {node}: {}", if now.message.is_empty() { now.health.as_str() } else { now.message.as_str() }),
                "lastTransitionTime": Timestamp::now().to_string(),
        }]});
        apply_status(&claims, &name, MANAGER, &condition).await?;
        if let Some(event) = &news
            && let Err(error) = recorder.publish(event, &reference).await
        {
            tracing::warn!(%node, %pool, claim = %name, %error, "publishing an Event failed");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(health: &str) -> Report {
        Report {
            health: health.into(),
            message: String::new(),
        }
    }

    #[test]
    fn an_event_when_a_volume_turns_unhealthy_or_healthy_again_only() {
        let (healthy, degraded, failed) = (report("Healthy"), report("Degraded"), report("Failed"));
        assert_eq!(
            event(None, &healthy),
            None,
            "first seen healthy: nothing to say"
        );
        assert_eq!(
            event(None, &degraded),
            Some((EventType::Warning, "VolumeDegraded"))
        );
        assert_eq!(
            event(Some(&healthy), &degraded),
            Some((EventType::Warning, "VolumeDegraded"))
        );
        assert_eq!(
            event(Some(&degraded), &failed),
            Some((EventType::Warning, "VolumeDegraded")),
            "worse"
        );
        let mut other = degraded.clone();
        other.message = "replacing".into();
        assert_eq!(
            event(Some(&degraded), &other),
            None,
            "only the message changed"
        );
        assert_eq!(
            event(Some(&degraded), &healthy),
            Some((EventType::Normal, "VolumeHealthy"))
        );
    }

    #[test]
    fn the_volume_and_its_claim_get_one_event_that_says_which_pool_on_which_node() {
        let healthy = report("Healthy");
        let degraded = Report {
            health: "Degraded".into(),
            message: "1 disk reports I/O or checksum errors: /dev/vdb".into(),
        };
        let place = ("node-1", "fast");
        let warning = notice(Some(&healthy), &degraded, place).expect("turned unhealthy");
        assert_eq!(
            (
                warning.type_,
                warning.reason.as_str(),
                warning.note.as_deref()
            ),
            (
                EventType::Warning,
                "VolumeDegraded",
                Some(
                    "pool fast is Degraded on node node-1, where this volume is: \
                     1 disk reports I/O or checksum errors: /dev/vdb"
                )
            )
        );
        let again = notice(Some(&degraded), &healthy, place).expect("healthy again");
        assert_eq!(
            (again.type_, again.reason.as_str(), again.note.as_deref()),
            (
                EventType::Normal,
                "VolumeHealthy",
                Some("pool fast is healthy again on node node-1")
            )
        );
        assert!(notice(Some(&degraded), &degraded, place).is_none());
        assert!(notice(None, &healthy, place).is_none());
        let long = Report {
            health: "Failed".into(),
            message: "x".repeat(2 * crate::events::MAX_NOTE),
        };
        let cut = notice(None, &long, place).and_then(|e| e.note);
        assert!(
            cut.is_some_and(|note| note.len() <= crate::events::MAX_NOTE),
            "the API server takes the note"
        );
    }

    #[test]
    fn a_volumes_event_is_about_the_cluster_scoped_volume() {
        let pv: PersistentVolume = serde_json::from_value(json!({
            "metadata": { "name": "pvc-1234", "uid": "0f0e" },
        }))
        .unwrap_or_default();
        let reference = pv.object_ref(&());
        assert_eq!(
            (
                reference.kind.as_deref(),
                reference.api_version.as_deref(),
                reference.name.as_deref(),
                reference.namespace.as_deref(),
            ),
            (Some("PersistentVolume"), Some("v1"), Some("pvc-1234"), None),
            "no namespace: the Recorder files the Event in `default`"
        );
        assert_eq!(crate::events::namespace_of(&reference), "default");
    }

    #[test]
    fn the_report_is_the_node_status_with_a_bounded_message() {
        let status = PoolNodeStatus {
            health: Some("Degraded".into()),
            message: Some("é".repeat(600)),
            ..Default::default()
        };
        let report = Report::of(&status).unwrap_or_else(|| report("none"));
        assert_eq!(report.health, "Degraded");
        assert!(report.message.len() <= MESSAGE_LIMIT + '…'.len_utf8());
        assert!(report.message.ends_with('…'));
        assert_eq!(Report::of(&PoolNodeStatus::default()), None);
    }
}

//! What every part of the operator shares, and nothing that acts: the API client,
//! settings, metrics and the store of Nodes (`Shared`), Events recorded on a cluster, a
//! cluster's key and edition, and the restart policy of the actor tree. Shells, the
//! pass and `reconcile` import it; it imports none of them.

use std::sync::Arc;
use std::time::Duration;

use castellan_actors::RestartPolicy;
use castellan_crds::DatabaseCluster;
use k8s_openapi::api::core::v1::{ConfigMap, Node, ObjectReference};
use kube::runtime::events::{self, EventType, Reporter};
use kube::runtime::reflector::Store;
use kube::{Client, Resource, ResourceExt};

use super::build;
use super::cluster::Note;
use super::metrics::Metrics;
use crate::events::Recorder;

/// What every executor needs: the API client, settings, and the tokio runtime that
/// performs the I/O.
pub struct Shared {
    pub client: Client,
    pub metrics: Arc<Metrics>,
    pub settings: build::Settings,
    pub runtime: tokio::runtime::Handle,
    pub recorder: Recorder,
    /// Castellan's CAs: the one that issues the instances' certificates, and the ones
    /// everything trusts (two during a rotation, which replaces this).
    trust: std::sync::RwLock<Arc<crate::pki::Trust>>,
    /// Every Node, kept current by a watch (`operator::run`): a pass reads its pods'
    /// nodes from here instead of asking the API server each time.
    pub nodes: Store<Node>,
    /// The image catalog's ConfigMap, kept current by a watch, and its
    /// `namespace/name`.
    images: (Store<ConfigMap>, String),
    /// Permits for cluster passes (`CONCURRENT_PASSES`).
    pub passes: tokio::sync::Semaphore,
}

/// How many cluster passes run at once. An operator started onto many clusters starts
/// every cluster actor together, and each one's first pass reads and applies its
/// objects. Unbounded, the memory of all of them in flight at once stays with the
/// process as the heap's peak (docs/benchmarks.md, "Restarting onto 100 clusters").
/// A pass talks only to the API server, in milliseconds; a waiting pass holds next to
/// nothing ([`in_slot`]). This is controller-runtime's `MaxConcurrentReconciles` for the
/// cluster controller.
pub const CONCURRENT_PASSES: usize = 8;

/// Runs the work `make` returns once one of `slots` is free. The work's future is made
/// and boxed only then: a pass's future holds the state of every step it may take (tens
/// of KiB), and a hundred clusters' first passes queued for a slot would otherwise hold
/// all of them at once, the heap's peak that stays with the process.
pub async fn in_slot<F: Future>(
    slots: &tokio::sync::Semaphore,
    make: impl FnOnce() -> F,
) -> F::Output {
    // Never closed; the work runs without a permit rather than not at all.
    let _permit = slots.acquire().await.ok();
    Box::pin(make()).await
}

impl Shared {
    pub fn new(
        client: Client,
        metrics: Arc<Metrics>,
        settings: build::Settings,
        identity: &str,
        trust: crate::pki::Trust,
        nodes: Store<Node>,
        images: (Store<ConfigMap>, String),
    ) -> Self {
        let reporter = Reporter {
            controller: "castellan-operator".into(),
            instance: Some(identity.to_owned()),
        };
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            metrics,
            settings,
            runtime: tokio::runtime::Handle::current(),
            trust: std::sync::RwLock::new(Arc::new(trust)),
            nodes,
            images,
            passes: tokio::sync::Semaphore::new(CONCURRENT_PASSES),
        }
    }

    /// The image catalog as the watch has it now.
    pub fn catalog(&self) -> super::catalog::Catalog {
        super::catalog::Catalog::read(&self.images.0, &self.images.1)
    }

    /// The CAs as they stand now.
    pub fn trust(&self) -> Arc<crate::pki::Trust> {
        match self.trust.read() {
            Ok(trust) => trust.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Replaces the CAs (a rotation's step), and the instance API client's
    /// certificate and roots with them.
    pub fn set_trust(&self, trust: crate::pki::Trust) -> Result<(), crate::pki::PkiError> {
        super::instance_client::configure(crate::pki::tls::operator_client_config(&trust)?);
        let mut current = match self.trust.write() {
            Ok(current) => current,
            Err(poisoned) => poisoned.into_inner(),
        };
        *current = Arc::new(trust);
        Ok(())
    }

    /// Records a Kubernetes Event on the cluster. An Event that cannot be written is
    /// logged, never fatal.
    pub async fn record(&self, cluster: &DatabaseCluster, note: Note) {
        self.record_at(&object_reference(cluster), note).await;
    }

    /// [`Shared::record`] by the cluster's reference, which the cluster's actor keeps.
    pub async fn record_at(&self, reference: &ObjectReference, note: Note) {
        let event = events::Event {
            type_: if note.warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: note.reason.to_owned(),
            note: Some(crate::events::note(&note.message)),
            action: action(note.reason, &note.message),
            secondary: note.related.as_ref().map(|related| ObjectReference {
                api_version: Some(related.api_version.into()),
                kind: Some(related.kind.into()),
                name: Some(related.name.clone()),
                namespace: reference.namespace.clone(),
                ..ObjectReference::default()
            }),
        };
        if let Err(error) = self.recorder.publish(&event, reference).await {
            tracing::warn!(kind = ?reference.kind, name = ?reference.name, reason = note.reason, %error, "could not record an Event");
        }
    }
}

/// The Event's action: its reason and a digest of its message. The [`Recorder`] folds an
/// Event into the last one of the same type, action, reason, object and related object
/// (a series, for six minutes) and keeps that one's note, so without the digest
/// a new message would be shown as the old one (a second CA rotation naming the first
/// one's CA, a Secret back to one CA saying it trusts two). Only the same message
/// repeated forms a series.
fn action(reason: &str, message: &str) -> String {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut hasher = DefaultHasher::new();
    message.hash(&mut hasher);
    format!("{reason}-{:08x}", hasher.finish() as u32)
}

/// Where Events about `object` (a cluster, a schedule) go.
pub fn object_reference<K: Resource<DynamicType = ()>>(object: &K) -> ObjectReference {
    let mut reference = object.object_ref(&());
    reference.namespace = object.namespace();
    reference
}

/// Restart policy of both levels of the tree: quick first restarts, `Degraded` after
/// three failures within two minutes, then a minute's pause.
pub fn restart_policy() -> RestartPolicy {
    RestartPolicy {
        min_delay: Duration::from_millis(500),
        max_delay: Duration::from_secs(30),
        factor: 2.0,
        max_failures: 3,
        window: Duration::from_secs(120),
        cool_down: Duration::from_secs(60),
    }
}

/// What a person changes on a cluster: its spec (`generation`) and its annotations.
/// Not the resourceVersion, which the operator's own status writes move.
pub fn edition(cluster: &DatabaseCluster) -> String {
    format!(
        "{:?} {:?}",
        cluster.metadata.generation, cluster.metadata.annotations
    )
}

pub fn key(cluster: &DatabaseCluster) -> String {
    format!(
        "{}/{}",
        cluster.namespace().unwrap_or_default(),
        cluster.name_any()
    )
}

#[cfg(test)]
mod tests {
    use super::{action, in_slot};

    #[test]
    fn only_the_same_message_makes_a_series() {
        let first = action("CARotationStarted", "new CA 2280b3a95ee6");
        assert_eq!(first, action("CARotationStarted", "new CA 2280b3a95ee6"));
        assert_ne!(first, action("CARotationStarted", "new CA 8fa91745ea53"));
        assert!(first.starts_with("CARotationStarted-"), "{first}");
        // The API's limit for an Event's action.
        assert!(action(&"R".repeat(100), &"m".repeat(10_000)).len() <= 128);
    }

    #[tokio::test]
    async fn work_waiting_for_a_slot_is_not_made_until_it_may_run() {
        async fn large() -> usize {
            let buffer = [7u8; 64 * 1024];
            tokio::task::yield_now().await;
            buffer.iter().map(|&b| usize::from(b)).sum()
        }
        let slots = tokio::sync::Semaphore::new(1);
        let held = slots.acquire().await.expect("a slot");
        let made = std::sync::atomic::AtomicBool::new(false);
        let waiting = in_slot(&slots, || {
            made.store(true, std::sync::atomic::Ordering::SeqCst);
            large()
        });
        assert!(std::mem::size_of_val(&large()) > 64 * 1024);
        assert!(
            std::mem::size_of_val(&waiting) < 1024,
            "a waiting pass holds {} bytes",
            std::mem::size_of_val(&waiting)
        );
        let mut waiting = Box::pin(waiting);
        assert!(futures::poll!(waiting.as_mut()).is_pending());
        assert!(!made.load(std::sync::atomic::Ordering::SeqCst));
        drop(held);
        assert_eq!(waiting.await, 7 * 64 * 1024);
        assert!(made.load(std::sync::atomic::Ordering::SeqCst));
    }
}

//! The operator's metrics (names and meaning in docs/metrics.md): reconciles per
//! controller (counts, errors, durations, in flight), the actor tree's restarts,
//! leadership, instances created, and each cluster's newest completed and verified
//! Backup, read from the Backup controller's cache when scraped. `endpoints.rs` serves
//! them; the controllers and actor shells only call the recording methods here.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::OnceLock;
use std::time::Instant;

use castellan_crds::Backup;
use kube::ResourceExt;
use kube::runtime::reflector::Store;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Which controller a reconcile belongs to: `cluster` (a pass over a DatabaseCluster),
/// `backup`, `backupschedule`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ControllerLabel {
    controller: &'static str,
}

/// Which supervisor of the actor tree restarted a child: `clusters`, `replicas`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SupervisorLabel {
    supervisor: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClusterLabels {
    namespace: String,
    cluster: String,
}

type Durations = Family<ControllerLabel, Histogram, fn() -> Histogram>;

fn duration_histogram() -> Histogram {
    // 5 ms to about 80 s: a reconcile that only reads, up to a pass that waits for
    // the API server and an instance's answer.
    Histogram::new(exponential_buckets(0.005, 2.0, 15))
}

pub struct Metrics {
    registry: Registry,
    leader: Gauge,
    reconciles: Family<ControllerLabel, Counter>,
    reconcile_errors: Family<ControllerLabel, Counter>,
    reconcile_durations: Durations,
    in_flight: Family<ControllerLabel, Gauge>,
    actor_restarts: Family<SupervisorLabel, Counter>,
    actor_failing: Family<SupervisorLabel, Counter>,
    instances_created: Counter,
    /// The Backup controller's cache, once it runs (it starts after the lease).
    backups: OnceLock<Store<Backup>>,
}

impl Default for Metrics {
    fn default() -> Self {
        let metrics = Self {
            registry: Registry::default(),
            leader: Gauge::default(),
            reconciles: Family::default(),
            reconcile_errors: Family::default(),
            reconcile_durations: Durations::new_with_constructor(duration_histogram),
            in_flight: Family::default(),
            actor_restarts: Family::default(),
            actor_failing: Family::default(),
            instances_created: Counter::default(),
            backups: OnceLock::new(),
        };
        let mut registry = Registry::default();
        // prometheus-client appends `_total` to counters and the unit to the names
        // registered with one.
        registry.register(
            "castellan_leader",
            "Whether this operator replica holds the leader Lease (and acts)",
            metrics.leader.clone(),
        );
        registry.register(
            "castellan_reconciles",
            "Reconciles run, by controller (cluster: a pass over a DatabaseCluster)",
            metrics.reconciles.clone(),
        );
        registry.register(
            "castellan_reconcile_errors",
            "Reconciles that failed and will be retried, by controller",
            metrics.reconcile_errors.clone(),
        );
        registry.register(
            "castellan_reconcile_duration_seconds",
            "How long reconciles took, by controller",
            metrics.reconcile_durations.clone(),
        );
        registry.register(
            "castellan_reconciles_in_flight",
            "Reconciles running now, by controller (cluster: clusters whose pass is under way)",
            metrics.in_flight.clone(),
        );
        registry.register(
            "castellan_actor_restarts",
            "Actors restarted by their supervisor after a failure or panic",
            metrics.actor_restarts.clone(),
        );
        registry.register(
            "castellan_actor_failing",
            "Actors that failed too often in a row: restarts pause, the resource turns Degraded",
            metrics.actor_failing.clone(),
        );
        registry.register(
            "castellan_instances_created",
            "Database instance pods created",
            metrics.instances_created.clone(),
        );
        Self {
            registry,
            ..metrics
        }
    }
}

/// Leaves the in-flight gauge when a reconcile ends, also when its future is dropped.
struct InFlight<'a>(&'a Gauge);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl Metrics {
    pub fn set_leader(&self, leader: bool) {
        self.leader.set(i64::from(leader));
    }

    pub fn instance_created(&self) {
        self.instances_created.inc();
    }

    /// A supervisor restarts a failed child.
    pub fn actor_restarted(&self, supervisor: &'static str) {
        self.actor_restarts
            .get_or_create(&SupervisorLabel { supervisor })
            .inc();
    }

    /// A supervisor pauses a child that keeps failing.
    pub fn actor_failing(&self, supervisor: &'static str) {
        self.actor_failing
            .get_or_create(&SupervisorLabel { supervisor })
            .inc();
    }

    /// Runs one reconcile of `controller`, counting it, timing it and counting its
    /// failure.
    pub async fn reconcile<T, E>(
        &self,
        controller: &'static str,
        work: impl Future<Output = Result<T, E>>,
    ) -> Result<T, E> {
        let label = ControllerLabel { controller };
        let gauge = self.in_flight.get_or_create_owned(&label);
        gauge.inc();
        let _in_flight = InFlight(&gauge);
        let started = Instant::now();
        let outcome = work.await;
        self.reconciles.get_or_create(&label).inc();
        self.reconcile_durations
            .get_or_create(&label)
            .observe(started.elapsed().as_secs_f64());
        if outcome.is_err() {
            self.reconcile_errors.get_or_create(&label).inc();
        }
        outcome
    }

    /// The Backup controller's cache, read for the backup timestamps at each scrape.
    pub fn watch_backups(&self, store: Store<Backup>) {
        let _ = self.backups.set(store);
    }

    pub fn render(&self) -> String {
        let mut backups = Registry::default();
        if let Some(store) = self.backups.get() {
            register_backup_times(&mut backups, &latest_backups(store.state().iter()));
        }
        crate::exposition::encode(&[&self.registry, &backups])
    }
}

/// The newest completed and verified Backup of each cluster, as Unix seconds.
#[derive(Debug, Default, PartialEq)]
struct BackupTimes {
    completed: Option<f64>,
    verified: Option<f64>,
}

fn unix_seconds(rfc3339: Option<&str>) -> Option<f64> {
    let timestamp: k8s_openapi::jiff::Timestamp = rfc3339?.parse().ok()?;
    Some(timestamp.as_millisecond() as f64 / 1000.0)
}

fn later(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

/// By `(namespace, cluster)`: the latest `stoppedAt` of a `Completed` Backup and the
/// latest `verifiedAt` of any.
fn latest_backups<'a>(
    backups: impl Iterator<Item = &'a std::sync::Arc<Backup>>,
) -> BTreeMap<(String, String), BackupTimes> {
    let mut latest: BTreeMap<(String, String), BackupTimes> = BTreeMap::new();
    for backup in backups {
        let Some(status) = &backup.status else {
            continue;
        };
        let key = (
            backup.namespace().unwrap_or_default(),
            backup.spec.cluster.clone(),
        );
        let completed = (status.phase.as_deref() == Some("Completed"))
            .then(|| unix_seconds(status.stopped_at.as_deref()))
            .flatten();
        let verified = unix_seconds(status.verified_at.as_deref());
        if completed.is_none() && verified.is_none() {
            continue;
        }
        let times = latest.entry(key).or_default();
        times.completed = later(times.completed, completed);
        times.verified = later(times.verified, verified);
    }
    latest
}

fn register_backup_times(
    registry: &mut Registry,
    latest: &BTreeMap<(String, String), BackupTimes>,
) {
    let completed = Family::<ClusterLabels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
    let verified = Family::<ClusterLabels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
    for ((namespace, cluster), times) in latest {
        let labels = ClusterLabels {
            namespace: namespace.clone(),
            cluster: cluster.clone(),
        };
        if let Some(at) = times.completed {
            completed.get_or_create(&labels).set(at);
        }
        if let Some(at) = times.verified {
            verified.get_or_create(&labels).set(at);
        }
    }
    registry.register(
        "castellan_backup_last_completed_timestamp_seconds",
        "End of the newest Completed Backup of the cluster (Unix time)",
        completed,
    );
    registry.register(
        "castellan_backup_last_verified_timestamp_seconds",
        "When the newest restore verification of one of the cluster's Backups finished",
        verified,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use castellan_crds::{BackupSpec, BackupStatus};
    use std::sync::Arc;

    #[tokio::test]
    async fn reconciles_are_counted_timed_and_their_errors_counted() {
        let metrics = Metrics::default();
        let ok: Result<(), ()> = metrics.reconcile("cluster", async { Ok(()) }).await;
        assert!(ok.is_ok());
        let failed: Result<(), &str> = metrics.reconcile("cluster", async { Err("no") }).await;
        assert!(failed.is_err());
        let _ = metrics.reconcile("backup", async { Ok::<_, ()>(()) }).await;
        metrics.set_leader(true);
        metrics.actor_restarted("replicas");
        metrics.instance_created();
        let text = metrics.render();
        for line in [
            "castellan_leader 1\n",
            "castellan_reconciles_total{controller=\"cluster\"} 2\n",
            "castellan_reconciles_total{controller=\"backup\"} 1\n",
            "castellan_reconcile_errors_total{controller=\"cluster\"} 1\n",
            "castellan_reconcile_duration_seconds_count{controller=\"cluster\"} 2\n",
            "castellan_reconciles_in_flight{controller=\"cluster\"} 0\n",
            "castellan_actor_restarts_total{supervisor=\"replicas\"} 1\n",
            "castellan_instances_created_total 1\n",
            "# TYPE castellan_reconcile_duration_seconds histogram\n",
        ] {
            assert!(text.contains(line), "{line:?} missing from:\n{text}");
        }
        assert!(!text.contains("castellan_reconcile_errors_total{controller=\"backup\"}"));
    }

    fn backup(
        cluster: &str,
        phase: &str,
        stopped: Option<&str>,
        verified: Option<&str>,
    ) -> Arc<Backup> {
        let mut backup = Backup::new(
            "b",
            BackupSpec {
                cluster: cluster.to_owned(),
                method: Default::default(),
                verify: false,
            },
        );
        backup.metadata.namespace = Some("shop".to_owned());
        backup.status = Some(BackupStatus {
            phase: Some(phase.to_owned()),
            stopped_at: stopped.map(str::to_owned),
            verified_at: verified.map(str::to_owned),
            ..BackupStatus::default()
        });
        Arc::new(backup)
    }

    #[test]
    fn the_newest_completed_and_verified_backup_of_each_cluster_is_reported() {
        let backups = [
            backup("orders", "Completed", Some("2026-01-01T00:00:00Z"), None),
            backup(
                "orders",
                "Completed",
                Some("2026-01-02T00:00:00Z"),
                Some("2026-01-01T01:00:00Z"),
            ),
            // A failed backup's end is not a backup to restore.
            backup("orders", "Failed", Some("2026-01-03T00:00:00Z"), None),
            backup("carts", "Running", None, None),
        ];
        let latest = latest_backups(backups.iter());
        assert_eq!(latest.len(), 1, "{latest:?}");
        let orders = &latest[&("shop".to_owned(), "orders".to_owned())];
        assert_eq!(orders.completed, Some(1_767_312_000.0));
        assert_eq!(orders.verified, Some(1_767_229_200.0));

        let mut registry = Registry::default();
        register_backup_times(&mut registry, &latest);
        let text = crate::exposition::encode(&[&registry]);
        assert!(text.contains(
            "castellan_backup_last_completed_timestamp_seconds{namespace=\"shop\",cluster=\"orders\"} 1767312000.0\n"
        ), "{text}");
    }
}

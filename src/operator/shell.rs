//! The thin shell of the actor tree: the effect executors of the `ClusterActor` and
//! `ReplicaActor` machines, and the root that supervises one `ClusterActor` per
//! `DatabaseCluster`.
//!
//! The actors live on the actor system's own thread (`castellan_actors::ActorSystem`);
//! I/O runs on the operator's tokio runtime (`Shared::runtime`), and its outcome comes
//! back to the actor as an event. Nothing here decides anything: the machines in
//! `cluster.rs` and `replica.rs` do.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use castellan_actors::{
    ChildFailing, Effects, Event, FailureSink, GetChild, MachineActor, MachineSpec, RestartPolicy,
    StartChild, StopChild, Supervisor,
};
use castellan_crds::DatabaseCluster;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{self, EventType, Recorder, Reporter};
use kube::{Client, Resource, ResourceExt};
use serde_json::json;
use tracing::Instrument;

use super::build;
use super::cluster::{ClusterEffect, ClusterEvent, ClusterMachine, ClusterState, Note};
use super::converge;
use super::endpoints::Metrics;
use super::instance_client;
use super::replica::{Command, ReplicaEffect, ReplicaEvent, ReplicaMachine, ReplicaState};

pub type ClusterActor = MachineActor<ClusterMachine, ClusterEffects>;
pub type ReplicaActor = MachineActor<ReplicaMachine, ReplicaEffects>;
pub type Root = Supervisor<ClusterActor>;

/// How long a restart of PostgreSQL may take before the call counts as failed.
const RESTART_TIMEOUT: Duration = Duration::from_secs(90);

/// What every executor needs: the API client, settings, and the tokio runtime that
/// performs the I/O.
pub struct Shared {
    pub client: Client,
    pub metrics: Arc<Metrics>,
    pub settings: build::Settings,
    pub runtime: tokio::runtime::Handle,
    pub recorder: Recorder,
    /// Castellan's CA, which issues the instances' certificates.
    pub authority: Arc<crate::pki::Authority>,
}

impl Shared {
    pub fn new(
        client: Client,
        metrics: Arc<Metrics>,
        settings: build::Settings,
        identity: &str,
        authority: Arc<crate::pki::Authority>,
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
            authority,
        }
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
            note: Some(note.message.clone()),
            action: note.reason.to_owned(),
            secondary: note.instance.as_ref().map(|pod| ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: Some(pod.clone()),
                namespace: reference.namespace.clone(),
                ..ObjectReference::default()
            }),
        };
        if let Err(error) = self.recorder.publish(&event, reference).await {
            tracing::warn!(cluster = ?reference.name, reason = note.reason, %error, "could not record an Event");
        }
    }
}

fn object_reference(cluster: &DatabaseCluster) -> ObjectReference {
    let mut reference = cluster.object_ref(&());
    reference.namespace = cluster.namespace();
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

/// The spec a `ClusterActor` is (re)built from: an empty state, filled by the next
/// `Desired` (reconcile sends one on every resync), so a restarted actor carries on
/// from what status and the cluster show.
pub fn cluster_spec(
    shared: &Arc<Shared>,
    cluster: &DatabaseCluster,
) -> MachineSpec<ClusterState, ClusterEffects> {
    MachineSpec {
        initial: ClusterState::default(),
        effects: ClusterEffects {
            shared: shared.clone(),
            key: super::reconcile::key(cluster),
            reference: object_reference(cluster),
            replicas: None,
            tracked: BTreeSet::new(),
        },
    }
}

/// Executes a `ClusterActor`'s effects.
#[derive(Clone)]
pub struct ClusterEffects {
    shared: Arc<Shared>,
    /// `namespace/name` of the cluster.
    key: String,
    /// Where its Events go (no read of the cluster per Event).
    reference: ObjectReference,
    /// This incarnation's supervisor of `ReplicaActor`s; made on first use, so each
    /// incarnation has its own and its replicas stop with it.
    replicas: Option<Addr<Supervisor<ReplicaActor>>>,
    tracked: BTreeSet<String>,
}

impl ClusterEffects {
    fn replicas(
        &mut self,
        events: &Recipient<Event<ClusterMachine>>,
    ) -> Addr<Supervisor<ReplicaActor>> {
        let key = self.key.clone();
        self.replicas
            .get_or_insert_with(|| {
                Supervisor::new(
                    format!("replicas of {key}"),
                    restart_policy(),
                    ReplicaFailures(events.clone()),
                )
                .start()
            })
            .clone()
    }

    /// Runs I/O on the tokio runtime in `span` (a child of the actor event's span).
    fn spawn_io(&self, span: tracing::Span, future: impl Future<Output = ()> + Send + 'static) {
        self.shared.runtime.spawn(future.instrument(span));
    }
}

/// A replica actor that keeps failing is reported to its cluster's actor.
struct ReplicaFailures(Recipient<Event<ClusterMachine>>);

impl FailureSink for ReplicaFailures {
    fn child_failing(&self, failing: ChildFailing) {
        self.0.do_send(Event::new(ClusterEvent::ReplicaFailing {
            instance: failing.key,
            reason: failing.reason,
        }));
    }
}

impl Effects<ClusterMachine> for ClusterEffects {
    fn execute(&mut self, effect: ClusterEffect, events: &Recipient<Event<ClusterMachine>>) {
        let events = events.clone();
        match effect {
            ClusterEffect::Converge(order) => {
                let shared = self.shared.clone();
                let span = tracing::info_span!("converge", cluster = %self.key);
                self.spawn_io(span, async move {
                    Metrics::count(&shared.metrics.reconciles);
                    let outcome = converge::run(&order, &shared).await;
                    if let Err(error) = &outcome {
                        Metrics::count(&shared.metrics.reconcile_errors);
                        tracing::warn!(%error, "pass failed");
                    }
                    events.do_send(Event::new(ClusterEvent::Converged(
                        outcome.map_err(|e| e.to_string()),
                    )));
                });
            }
            ClusterEffect::Track(instances) => {
                let supervisor = self.replicas(&events);
                let wanted: BTreeSet<String> = instances.iter().map(|(n, _)| n.clone()).collect();
                for gone in self.tracked.difference(&wanted) {
                    supervisor.do_send(StopChild { key: gone.clone() });
                }
                self.tracked = wanted;
                for (instance, address) in instances {
                    let spec = MachineSpec {
                        initial: ReplicaState::new(instance.clone()),
                        effects: ReplicaEffects {
                            shared: self.shared.clone(),
                            instance: instance.clone(),
                            cluster: events.clone(),
                        },
                    };
                    let supervisor = supervisor.clone();
                    // The event names this actor event as its cause explicitly: the
                    // spawned future runs later, outside this handler's span.
                    let cause = tracing::Span::current();
                    actix::spawn(async move {
                        let started = supervisor
                            .send(StartChild {
                                key: instance,
                                spec,
                            })
                            .await;
                        if let Ok(Some(actor)) = started {
                            actor.do_send(Event {
                                event: ReplicaEvent::Track(address),
                                cause,
                            });
                        }
                    });
                }
            }
            ClusterEffect::Command { instance, command } => {
                let supervisor = self.replicas(&events);
                let cause = tracing::Span::current();
                actix::spawn(async move {
                    let child = GetChild::<ReplicaActor>::new(instance.clone());
                    match supervisor.send(child).await {
                        Ok(Some(actor)) => actor.do_send(Event {
                            event: ReplicaEvent::Run(command),
                            cause,
                        }),
                        _ => events.do_send(Event {
                            event: ClusterEvent::Finished {
                                outcome: Err(format!("the actor of {instance} is not running")),
                                instance,
                                command,
                            },
                            cause,
                        }),
                    }
                });
            }
            ClusterEffect::Record(note) => {
                let shared = self.shared.clone();
                let reference = self.reference.clone();
                let span = tracing::info_span!("record event", reason = note.reason);
                self.spawn_io(span, async move {
                    shared.record_at(&reference, note).await;
                });
            }
            ClusterEffect::RetryAfter(delay) => {
                self.spawn_io(tracing::Span::none(), async move {
                    tokio::time::sleep(delay).await;
                    events.do_send(Event::root(ClusterEvent::Retry));
                });
            }
        }
    }
}

/// Executes a `ReplicaActor`'s effects.
#[derive(Clone)]
pub struct ReplicaEffects {
    shared: Arc<Shared>,
    instance: String,
    cluster: Recipient<Event<ClusterMachine>>,
}

impl Effects<ReplicaMachine> for ReplicaEffects {
    fn execute(&mut self, effect: ReplicaEffect, events: &Recipient<Event<ReplicaMachine>>) {
        let events = events.clone();
        match effect {
            ReplicaEffect::Fetch { address, next_poll } => {
                let span = tracing::info_span!("read instance status", instance = %self.instance);
                self.shared.runtime.spawn(
                    async move {
                        let outcome = instance_client::call("GET", &address, "/status", None).await;
                        events.do_send(Event::new(ReplicaEvent::Polled {
                            outcome: outcome.map_err(|e| e.to_string()),
                            next_poll,
                        }));
                    }
                    .instrument(span),
                );
            }
            ReplicaEffect::Call(address, command) => {
                let span = tracing::info_span!(
                    "instance command",
                    instance = %self.instance,
                    command = command.name()
                );
                self.shared.runtime.spawn(
                    async move {
                        let outcome = match &command {
                            Command::Reload {
                                parameters,
                                sync_names,
                            } => {
                                let mut body = json!({ "parameters": parameters });
                                if let Some(names) = sync_names {
                                    body["synchronousStandbyNames"] = json!(names);
                                }
                                instance_client::call("POST", &address, "/reload", Some(&body))
                                    .await
                            }
                            Command::Restart => {
                                instance_client::call_within(
                                    "POST",
                                    &address,
                                    "/restart",
                                    None,
                                    RESTART_TIMEOUT,
                                )
                                .await
                            }
                        };
                        events.do_send(Event::new(ReplicaEvent::Ran(
                            outcome.map_err(|e| e.to_string()),
                        )));
                    }
                    .instrument(span),
                );
            }
            ReplicaEffect::Report(view) => {
                self.cluster
                    .do_send(Event::new(ClusterEvent::Observed(view)));
            }
            ReplicaEffect::Finished { command, outcome } => {
                self.cluster.do_send(Event::new(ClusterEvent::Finished {
                    instance: self.instance.clone(),
                    command,
                    outcome,
                }));
            }
            ReplicaEffect::PollAfter(delay) => {
                self.shared.runtime.spawn(async move {
                    tokio::time::sleep(delay).await;
                    events.do_send(Event::root(ReplicaEvent::Poll));
                });
            }
        }
    }
}

/// The root's failure sink: a `ClusterActor` that keeps failing marks its cluster
/// `Degraded` with the reason (its actor cannot, being the one failing), and says so in
/// an Event. Runs on the tokio runtime, fed by the root supervisor.
pub async fn report_failing_clusters(
    shared: Arc<Shared>,
    mut failing: tokio::sync::mpsc::UnboundedReceiver<ChildFailing>,
    failed: Arc<std::sync::Mutex<std::collections::BTreeMap<String, String>>>,
) {
    while let Some(report) = failing.recv().await {
        let Some((namespace, name)) = report.key.split_once('/') else {
            continue;
        };
        let clusters: kube::Api<DatabaseCluster> =
            kube::Api::namespaced(shared.client.clone(), namespace);
        let cluster = match clusters.get_opt(name).await {
            Ok(Some(cluster)) => cluster,
            Ok(None) => continue,
            Err(error) => {
                tracing::warn!(cluster = %report.key, %error, "could not read a failing cluster");
                continue;
            }
        };
        let reason = format!(
            "the cluster's actor failed {} times in a row ({}); retrying in {}s",
            report.failures,
            report.reason,
            report.retry_after.as_secs()
        );
        tracing::error!(cluster = %report.key, %reason, "cluster actor failing");
        if let Ok(mut failed) = failed.lock() {
            failed.insert(report.key.clone(), super::reconcile::edition(&cluster));
        }
        let patch = json!({ "status": {
            "phase": "Degraded",
            "conditions": [converge::degraded_condition(&cluster, Some(&reason))],
        }});
        if let Err(error) =
            converge::write_status_as(&shared.client, &cluster, &patch, "castellan-supervisor")
                .await
        {
            tracing::warn!(cluster = %report.key, %error, "could not mark the cluster Degraded");
        }
        shared
            .record(&cluster, Note::warning("Degraded", reason))
            .await;
    }
}

/// The root of the tree: one supervised `ClusterActor` per cluster key.
pub fn start_root(failing: tokio::sync::mpsc::UnboundedSender<ChildFailing>) -> Addr<Root> {
    Supervisor::new("clusters", restart_policy(), failing).start()
}

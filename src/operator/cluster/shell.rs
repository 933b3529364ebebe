//! The `ClusterActor`'s shell: it performs the effects of the cluster machine — a pass
//! over the owned objects (`pass.rs`), the `ReplicaActor`s it keeps, commands and lease
//! grants sent through them, Events, retries, the removal of a handled switchover
//! request — and feeds their outcomes back as events. It decides nothing.
//!
//! The actors live on the actor system's own thread; I/O runs on the operator's tokio
//! runtime (`Shared::runtime`).

use std::collections::BTreeSet;
use std::sync::Arc;

use actix::prelude::*;
use castellan_actors::{
    ChildFailing, Effects, Event, FailureSink, GetChild, MachineActor, MachineSpec, StartChild,
    StopChild, Supervisor,
};
use castellan_crds::DatabaseCluster;
use k8s_openapi::api::core::v1::ObjectReference;
use serde_json::json;
use tracing::Instrument;

use super::machine::ClusterMachine;
use super::pass;
use super::state::{ClusterEffect, ClusterEvent, ClusterState};
use super::switchover::SWITCHOVER_ANNOTATION;
use crate::operator::context::{Shared, in_slot, key, object_reference, restart_policy};
use crate::operator::metrics::Metrics;
use crate::operator::replica::shell::{ReplicaActor, ReplicaEffects};
use crate::operator::replica::{ReplicaEvent, ReplicaState};

pub type ClusterActor = MachineActor<ClusterMachine, ClusterEffects>;

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
            key: key(cluster),
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
                    ReplicaFailures {
                        cluster: events.clone(),
                        metrics: self.shared.metrics.clone(),
                    },
                )
                .start()
            })
            .clone()
    }

    /// Runs I/O on the tokio runtime in `span` (a child of the actor event's span).
    fn spawn_io(&self, span: tracing::Span, future: impl Future<Output = ()> + Send + 'static) {
        self.shared.runtime.spawn(future.instrument(span));
    }

    /// Sets (or with `None` removes) one annotation of the cluster by a merge patch:
    /// the annotations are the user's requests, so only this key is touched.
    fn annotate(&self, annotation: &'static str, value: Option<String>, what: &'static str) {
        let shared = self.shared.clone();
        let reference = self.reference.clone();
        let span = tracing::info_span!("annotate cluster", %annotation, %what);
        self.spawn_io(span, async move {
            let (Some(namespace), Some(name)) = (&reference.namespace, &reference.name) else {
                return;
            };
            let clusters: kube::Api<DatabaseCluster> =
                kube::Api::namespaced(shared.client.clone(), namespace);
            let patch = json!({"metadata": {"annotations": {annotation: value}}});
            if let Err(error) = clusters
                .patch(
                    name,
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(&patch),
                )
                .await
            {
                tracing::warn!(cluster = %name, %error, "could not {what}");
            }
        });
    }
}

/// A replica actor that keeps failing is reported to its cluster's actor; every
/// failure is counted.
struct ReplicaFailures {
    cluster: Recipient<Event<ClusterMachine>>,
    metrics: Arc<Metrics>,
}

impl FailureSink for ReplicaFailures {
    fn child_failing(&self, failing: ChildFailing) {
        self.metrics.actor_failing("replicas");
        self.cluster
            .do_send(Event::new(ClusterEvent::ReplicaFailing {
                instance: failing.key,
                reason: failing.reason,
            }));
    }

    fn child_failed(&self, _key: &castellan_actors::ChildKey, _reason: &str) {
        self.metrics.actor_restarted("replicas");
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
                    let outcome = in_slot(&shared.passes, || {
                        shared
                            .metrics
                            .reconcile("cluster", pass::run(&order, &shared))
                    })
                    .await;
                    if let Err(error) = &outcome {
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
                        effects: ReplicaEffects::new(
                            self.shared.clone(),
                            instance.clone(),
                            events.clone(),
                        ),
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
                                at: std::time::SystemTime::now(),
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
            ClusterEffect::ClearSwitchover => {
                self.annotate(SWITCHOVER_ANNOTATION, None, "clear switchover request");
            }
            ClusterEffect::Acknowledge { annotation, value } => {
                self.annotate(annotation, Some(value), "record declared action as handled");
            }
            ClusterEffect::Grant { instance, grant } => {
                let supervisor = self.replicas(&events);
                actix::spawn(async move {
                    if let Ok(Some(actor)) = supervisor
                        .send(GetChild::<ReplicaActor>::new(instance))
                        .await
                    {
                        actor.do_send(Event::root(ReplicaEvent::Grant(grant)));
                    }
                });
            }
        }
    }
}

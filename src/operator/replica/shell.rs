//! The `ReplicaActor`'s shell: status reads, commands and lease grants over the
//! instance API (`instance_client.rs`, bodies from `crate::instance_api`), poll timers,
//! and reports to the cluster's actor. It decides nothing.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use actix::prelude::*;
use castellan_actors::{Effects, Event, MachineActor};
use serde_json::json;
use tracing::Instrument;

use super::machine::{Command, ReplicaEffect, ReplicaEvent, ReplicaMachine};
use crate::instance_api::{FenceRequest, ReloadRequest, StatusReport};
use crate::operator::cluster::{ClusterEvent, ClusterMachine};
use crate::operator::context::Shared;
use crate::operator::instance_client;

pub type ReplicaActor = MachineActor<ReplicaMachine, ReplicaEffects>;

/// How long a command (a restart or promotion of PostgreSQL the longest) may take
/// before the call counts as failed.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(90);

/// How long a status read may take. Polls run every second; an instance that cannot
/// answer within two is not serving, and waiting longer would only delay a failover.
const STATUS_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a lease grant may take to arrive: past its own length it grants nothing
/// (the instance refuses a grant that has ended).
const LEASE_TIMEOUT: Duration = crate::operator::cluster::LEASE_DURATION;

/// Executes a `ReplicaActor`'s effects.
#[derive(Clone)]
pub struct ReplicaEffects {
    shared: Arc<Shared>,
    instance: String,
    cluster: Recipient<Event<ClusterMachine>>,
}

impl ReplicaEffects {
    /// The effects of the actor watching `instance`, reporting to its cluster's actor.
    pub fn new(
        shared: Arc<Shared>,
        instance: String,
        cluster: Recipient<Event<ClusterMachine>>,
    ) -> Self {
        Self {
            shared,
            instance,
            cluster,
        }
    }
}

impl Effects<ReplicaMachine> for ReplicaEffects {
    fn execute(&mut self, effect: ReplicaEffect, events: &Recipient<Event<ReplicaMachine>>) {
        let events = events.clone();
        match effect {
            ReplicaEffect::Fetch { address, next_poll } => {
                let span = tracing::info_span!("read instance status", instance = %self.instance);
                self.shared.runtime.spawn(
                    async move {
                        // Dated from when it was asked: a view is true at least then, and a
                        // lease granted from it ends no later than the operator counts.
                        let asked = SystemTime::now();
                        let outcome = instance_client::call_kept(
                            "GET",
                            &address,
                            "/status",
                            None,
                            STATUS_TIMEOUT,
                        )
                        .await
                        .map_err(|e| e.to_string())
                        .and_then(|body| {
                            serde_json::from_value::<StatusReport>(body)
                                .map(Box::new)
                                .map_err(|e| format!("reading the status report: {e}"))
                        });
                        events.do_send(Event::new(ReplicaEvent::Polled {
                            outcome,
                            at: asked,
                            next_poll,
                        }));
                    }
                    .instrument(span),
                );
            }
            ReplicaEffect::Lease(address, grant) => {
                let instance = self.instance.clone();
                self.shared.runtime.spawn(async move {
                    let body = json!(grant);
                    if let Err(error) = instance_client::call_kept(
                        "POST",
                        &address,
                        "/lease",
                        Some(&body),
                        LEASE_TIMEOUT,
                    )
                    .await
                    {
                        tracing::warn!(%instance, %error, "the lease grant did not arrive");
                    }
                });
            }
            ReplicaEffect::Call(address, command) => {
                let span = tracing::info_span!(
                    "instance command",
                    instance = %self.instance,
                    command = command.name()
                );
                self.shared.runtime.spawn(
                    async move {
                        let post = |path: &'static str, body: serde_json::Value| {
                            let address = address.clone();
                            async move {
                                instance_client::call_within(
                                    "POST",
                                    &address,
                                    path,
                                    Some(&body),
                                    COMMAND_TIMEOUT,
                                )
                                .await
                            }
                        };
                        let outcome = match &command {
                            Command::Reload {
                                parameters,
                                sync_names,
                                slots,
                                archive,
                                access,
                            } => {
                                let body = ReloadRequest {
                                    parameters: Some(parameters.clone()),
                                    synchronous_standby_names: sync_names.clone(),
                                    slots: slots.clone(),
                                    archive: archive.as_deref().cloned(),
                                    access: Some(access.clone()),
                                };
                                post("/reload", json!(body)).await
                            }
                            Command::Restart => post("/restart", json!({})).await,
                            Command::Promote(request) => post("/promote", json!(request)).await,
                            Command::Demote => post("/demote", json!({})).await,
                            Command::Restore(request) => post("/restore", json!(request)).await,
                            Command::Fence(fenced) => {
                                post("/fence", json!(FenceRequest { fenced: *fenced })).await
                            }
                        };
                        events.do_send(Event::new(ReplicaEvent::Ran {
                            outcome: outcome.map_err(|e| e.to_string()),
                            at: SystemTime::now(),
                        }));
                    }
                    .instrument(span),
                );
            }
            ReplicaEffect::Report(view) => {
                self.cluster
                    .do_send(Event::new(ClusterEvent::Observed(*view)));
            }
            ReplicaEffect::Finished {
                command,
                outcome,
                at,
            } => {
                self.cluster.do_send(Event::new(ClusterEvent::Finished {
                    instance: self.instance.clone(),
                    command,
                    outcome,
                    at,
                }));
            }
            ReplicaEffect::PollAfter(delay) => {
                self.shared.runtime.spawn(async move {
                    tokio::time::sleep(delay).await;
                    events.do_send(Event::root(ReplicaEvent::Poll(SystemTime::now())));
                });
            }
        }
    }
}

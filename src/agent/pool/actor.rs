//! The `PoolMemberActor`: this node's part of one `StoragePool`, one pass at a time
//! (`serial`), each pass the pool shell's (`shell::Pools::pass`: plan → wipe →
//! mkfs/add → mount → healthy/degraded, or deleting). Its supervisor restarts it with
//! back-off when a pass fails, and marks this node's entry of the pool `Failed` with
//! the reason once it keeps failing. This is its shell; it decides nothing.

use std::sync::Arc;

use actix::prelude::*;
use castellan_actors::{ChildFailing, Effects, Event, MachineActor};
use castellan_crds::storage_pool::StoragePool;
use tokio::runtime::Handle;

use super::shell::{Labels, Pools};
use crate::agent::children::{Ask, Next, NodeInbox, run_pass};
use crate::agent::disk::observe::Observed;
use crate::agent::serial::{Serial, SerialEffect};

/// A pass over a pool with one look's view.
#[derive(Clone, Debug)]
pub struct PoolRequest {
    pub pool: Arc<StoragePool>,
    pub labels: Arc<Labels>,
    pub observed: Arc<Vec<Observed>>,
}

pub type PoolMemberMachine = Serial<PoolRequest, Next>;
pub type PoolMemberActor = MachineActor<PoolMemberMachine, PoolMemberEffects>;

/// Executes a `PoolMemberActor`'s effects.
#[derive(Clone)]
pub struct PoolMemberEffects {
    pool: String,
    pools: Arc<Pools>,
    node: NodeInbox,
    runtime: Handle,
}

impl PoolMemberEffects {
    pub fn new(pool: &str, pools: Arc<Pools>, node: NodeInbox, runtime: Handle) -> Self {
        Self {
            pool: pool.to_string(),
            pools,
            node,
            runtime,
        }
    }
}

impl Effects<PoolMemberMachine> for PoolMemberEffects {
    fn execute(
        &mut self,
        effect: SerialEffect<PoolRequest, Next>,
        events: &Recipient<Event<PoolMemberMachine>>,
    ) {
        match effect {
            SerialEffect::Run(request) => {
                let pools = self.pools.clone();
                let pass = async move {
                    pools
                        .pass(&request.pool, &request.labels, &request.observed)
                        .await
                        .map_err(|error| error.to_string())
                };
                run_pass(
                    &self.runtime,
                    tracing::info_span!("pool pass", pool = %self.pool),
                    format!("the pass over pool {}", self.pool),
                    pass,
                    events,
                );
            }
            SerialEffect::Report(next) => {
                // A closed inbox: the agent is stopping.
                let _ = self.node.send(Ask::Next(next));
            }
        }
    }

    /// A new incarnation (a new pool, or a restart after a failure) asks for a look,
    /// which brings it a pass with a fresh view.
    fn started(&mut self, _events: &Recipient<Event<PoolMemberMachine>>) {
        let _ = self.node.send(Ask::Look("pool actor started"));
    }
}

/// The pool supervisor's failure sink: this node's entry of a pool whose actor keeps
/// failing says so (`Failed` with the reason); its next good pass overwrites it.
pub async fn report_failing_pools(
    pools: Arc<Pools>,
    mut failing: tokio::sync::mpsc::UnboundedReceiver<ChildFailing>,
) {
    while let Some(report) = failing.recv().await {
        let message = report.describe("the agent's actor for this pool");
        tracing::error!(pool = %report.key, %message, "pool actor failing");
        if let Err(error) = pools.report_failing(&report.key, message).await {
            tracing::warn!(pool = %report.key, %error, "could not mark the pool Failed on this node");
        }
    }
}

//! The `NodeActor`'s shell: one look at the node's disks, handed to the children.
//!
//! A look observes the disks (`disk::observe`, blocking, on the blocking pool), then,
//! holding the node's BlockDevice lock, tells every disk's `DiskActor` what was seen
//! of it (starting actors for new disks, stopping those whose object is gone) and
//! waits until their writes are made; then it lists the pools and hands each one's
//! `PoolMemberActor` a pass with this look's view. Pools' passes run on their own and
//! report back (`NodeEvent::Asked`). It decides nothing: when to look is the machine's.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix::prelude::*;
use castellan_actors::{
    Child, Effects, Event, GetChild, MachineActor, MachineSpec, RetainChildren, StartChild,
    Supervisor,
};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use tokio::runtime::Handle;
use tracing::Instrument;

use super::machine::{Cause, NodeEffect, NodeEvent, NodeMachine};
use crate::agent::children::{NodeInbox, StorageLock};
use crate::agent::disk::inventory::Inventory;
use crate::agent::disk::machine::{DiskEvent, DiskState, Done, Sighting};
use crate::agent::disk::observe::{self, AllowList, Sources};
use crate::agent::disk::shell::{DiskActor, DiskEffects, DiskWriter};
use crate::agent::pool::actor::{PoolMemberActor, PoolMemberEffects, PoolRequest};
use crate::agent::pool::lifecycle::{MemberEvent, MemberState};
use crate::agent::pool::shell::Pools;

pub type NodeActor = MachineActor<NodeMachine, NodeEffects>;

/// How long a look waits for its disks' writes before it goes on to the pools (a
/// write stuck on an unreachable API server must not hold the node forever).
const DISK_WRITES: Duration = Duration::from_secs(60);

/// The node's parts that exist before its actor tree: what `serve` wires.
pub struct NodeSetup {
    pub name: String,
    pub allow: AllowList,
    pub sources: Sources,
    pub inventory: Inventory,
    pub pools: Arc<Pools>,
    /// Held while the look writes BlockDevices (see `StorageLock`).
    pub storage: StorageLock,
    pub inbox: NodeInbox,
}

/// What every incarnation of the node actor shares: its setup, the supervisors of its
/// children, and its one timer.
pub struct NodeParts {
    pub name: String,
    pub allow: AllowList,
    pub sources: Sources,
    pub inventory: Inventory,
    /// The inventory, as the disks' actors write through it.
    writer: Arc<dyn DiskWriter>,
    pub pools: Arc<Pools>,
    pub storage: StorageLock,
    pub inbox: NodeInbox,
    pub disks: Addr<Supervisor<DiskActor>>,
    pub pool_members: Addr<Supervisor<PoolMemberActor>>,
    pub runtime: Handle,
    /// The one pending wake-up: when, and its task.
    timer: Mutex<Option<(tokio::time::Instant, tokio::task::JoinHandle<()>)>>,
}

impl NodeParts {
    pub fn new(
        setup: NodeSetup,
        disks: Addr<Supervisor<DiskActor>>,
        pool_members: Addr<Supervisor<PoolMemberActor>>,
        runtime: Handle,
    ) -> Self {
        let NodeSetup {
            name,
            allow,
            sources,
            inventory,
            pools,
            storage,
            inbox,
        } = setup;
        Self {
            writer: Arc::new(inventory.clone()),
            name,
            allow,
            sources,
            inventory,
            pools,
            storage,
            inbox,
            disks,
            pool_members,
            runtime,
            timer: Mutex::default(),
        }
    }
}

/// Executes the `NodeActor`'s effects.
#[derive(Clone)]
pub struct NodeEffects(pub Arc<NodeParts>);

impl Effects<NodeMachine> for NodeEffects {
    fn execute(&mut self, effect: NodeEffect, events: &Recipient<Event<NodeMachine>>) {
        match effect {
            NodeEffect::Look(cause) => {
                let (node, events) = (self.0.clone(), events.clone());
                let span = tracing::info_span!("look", node = %node.name, cause);
                self.0.runtime.spawn(
                    async move {
                        let outcome = look(&node, cause).await;
                        if let Err(error) = &outcome {
                            tracing::error!(node = %node.name, %error, "the look at the disks failed");
                        }
                        events.do_send(Event::new(NodeEvent::Looked(outcome)));
                    }
                    .instrument(span),
                );
            }
            NodeEffect::WakeIn(delay) => self.wake_in(delay, events),
        }
    }

    /// Every incarnation starts with a look: the first, and the one after a restart.
    fn started(&mut self, events: &Recipient<Event<NodeMachine>>) {
        events.do_send(Event::root(NodeEvent::Trigger("started")));
    }
}

impl NodeEffects {
    /// A missing member's grace period ends, a replacement or scrub runs, a scrub is
    /// due, a step is retried: look again then. One timer, the soonest: passes come
    /// every few seconds and must not pile up sleeping tasks.
    fn wake_in(&self, delay: Duration, events: &Recipient<Event<NodeMachine>>) {
        let at = tokio::time::Instant::now() + delay;
        let Ok(mut timer) = self.0.timer.lock() else {
            return;
        };
        let sooner_pending = timer
            .as_ref()
            .is_some_and(|(when, task)| !task.is_finished() && *when <= at);
        if sooner_pending {
            return;
        }
        if let Some((_, task)) = timer.take() {
            task.abort();
        }
        let events = events.clone();
        let task = self.0.runtime.spawn(async move {
            tokio::time::sleep_until(at).await;
            events.do_send(Event::root(NodeEvent::Trigger("timer")));
        });
        *timer = Some((at, task));
    }
}

/// One look: observe, the disks' writes, the pools' passes handed out.
async fn look(node: &Arc<NodeParts>, cause: Cause) -> Result<(), String> {
    let (name, allow, sources) = (node.name.clone(), node.allow.clone(), node.sources.clone());
    let observation =
        tokio::task::spawn_blocking(move || observe::observe(&name, &allow, &sources))
            .await
            .map_err(|error| format!("the disk scan panicked: {error}"))?
            .map_err(|error| format!("scanning the disks: {error}"))?;
    for reason in &observation.skipped {
        tracing::warn!(node = %node.name, reason = %reason, "disk skipped");
    }
    {
        let _storage = node.storage.lock().await;
        tell_disks(node, &observation.devices).await?;
    }
    let (pools, labels) = node.pools.list().await.map_err(|error| error.to_string())?;
    let labels = Arc::new(labels);
    let observed = Arc::new(observation.devices);
    let mut names = BTreeSet::new();
    for pool in pools {
        let key = pool.name_any();
        names.insert(key.clone());
        let spec = MachineSpec {
            initial: MemberState::new(),
            effects: PoolMemberEffects::new(
                &key,
                node.pools.clone(),
                node.inbox.clone(),
                node.runtime.clone(),
            ),
        };
        let request = PoolRequest {
            pool: Arc::new(pool),
            labels: labels.clone(),
            observed: observed.clone(),
        };
        // None: the pool's actor waits out a back-off; its restart asks for a look.
        if let Some(member) = start(&node.pool_members, &key, spec).await? {
            member.do_send(Event::new(MemberEvent::Request(request)));
        }
    }
    retain(&node.pool_members, names).await;
    tracing::debug!(node = %node.name, cause, devices = observed.len(), "look done");
    Ok(())
}

/// Tells every disk (seen now, or with an object) what the look found, and waits
/// until their writes are made (or `DISK_WRITES` passes).
async fn tell_disks(node: &Arc<NodeParts>, devices: &[observe::Observed]) -> Result<(), String> {
    let existing = node
        .inventory
        .existing()
        .await
        .map_err(|error| error.to_string())?;
    let now = Timestamp::now();
    let mut names: BTreeSet<String> = devices.iter().map(|device| device.name.clone()).collect();
    names.extend(existing.iter().map(ResourceExt::name_any));
    let mut waits = Vec::new();
    for name in &names {
        let sighting = Sighting {
            node: node.name.clone(),
            observed: devices.iter().find(|device| &device.name == name).cloned(),
            object: existing
                .iter()
                .find(|object| &object.name_any() == name)
                .cloned(),
            now,
        };
        let spec = MachineSpec {
            initial: DiskState::new(),
            effects: DiskEffects::new(name, node.writer.clone(), node.runtime.clone()),
        };
        // None: the disk's actor waits out a back-off; the others go on.
        let Some(disk) = start(&node.disks, name, spec).await? else {
            continue;
        };
        let (done, wait) = tokio::sync::oneshot::channel();
        disk.do_send(Event::new(DiskEvent::Seen(Box::new(sighting), Done(done))));
        waits.push(wait);
    }
    // A dropped token is a finished write, a write that failed, or a disk actor that
    // died: all end the wait.
    if tokio::time::timeout(DISK_WRITES, futures::future::join_all(waits))
        .await
        .is_err()
    {
        tracing::warn!(node = %node.name, "the disks' writes did not end within {}s; going on", DISK_WRITES.as_secs());
    }
    retain(&node.disks, names).await;
    Ok(())
}

/// Starts (or finds) the child `key` of `supervisor`.
async fn start<C: Child>(
    supervisor: &Addr<Supervisor<C>>,
    key: &str,
    spec: C::Spec,
) -> Result<Option<Addr<C>>, String>
where
    C::Spec: Send,
{
    supervisor
        .send(StartChild {
            key: key.to_string(),
            spec,
        })
        .await
        .map_err(|error| format!("asking the actor tree for {key}: {error}"))
}

/// Stops the children of `supervisor` whose key is not in `current` (their object is
/// gone).
async fn retain<C: Child>(supervisor: &Addr<Supervisor<C>>, current: BTreeSet<String>) {
    let stopped = supervisor
        .send(RetainChildren { keys: current })
        .await
        .unwrap_or_default();
    for key in stopped {
        tracing::info!(actor = %key, "its object is gone; stopped its actor");
    }
}

/// The running incarnation of a supervised child, found again after it restarted:
/// what outside the tree (timers, watches) sends to the node or volume actor.
pub struct Current<C: Child> {
    supervisor: Addr<Supervisor<C>>,
    key: String,
    addr: Option<Addr<C>>,
}

impl<C: Child> Current<C> {
    pub fn new(supervisor: Addr<Supervisor<C>>, key: &str) -> Self {
        Self {
            supervisor,
            key: key.to_string(),
            addr: None,
        }
    }

    /// Sends `message` to the running incarnation; drops it while the child waits to
    /// restart (its restart brings it up to date).
    pub async fn send<M>(&mut self, message: M)
    where
        M: Message + Send + 'static,
        M::Result: Send,
        C: Handler<M>,
    {
        if !self.addr.as_ref().is_some_and(Addr::connected) {
            self.addr = self
                .supervisor
                .send(GetChild::new(self.key.clone()))
                .await
                .ok()
                .flatten();
        }
        match &self.addr {
            Some(addr) => addr.do_send(message),
            None => {
                tracing::debug!(actor = %self.key, "the actor is restarting; a message dropped")
            }
        }
    }
}

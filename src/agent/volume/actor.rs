//! The `VolumeActor`: the node's volume provisioner, one pass at a time (`serial`),
//! each pass the provisioner's (`shell::Volumes::reconcile`: make, grow and release
//! the node's local volumes). Claims' and volumes' changes and the periodic timer
//! request passes; a pass that changed a pool's allocation asks the node for a look,
//! so the pools report it. Its supervisor restarts it with back-off when a pass fails.
//! This is its shell; it decides nothing.

use std::sync::Arc;

use actix::prelude::*;
use castellan_actors::{Effects, Event, MachineActor};
use tokio::runtime::Handle;

use super::shell::Volumes;
use crate::agent::children::{Ask, NodeInbox, run_pass};
use crate::agent::serial::{Serial, SerialEffect, SerialEvent};

/// A pass is requested for a cause; its outcome is whether an allocation changed.
pub type VolumeMachine = Serial<&'static str, bool>;
pub type VolumeActor = MachineActor<VolumeMachine, VolumeEffects>;

/// Executes the `VolumeActor`'s effects.
#[derive(Clone)]
pub struct VolumeEffects {
    volumes: Arc<Volumes>,
    node: NodeInbox,
    runtime: Handle,
}

impl VolumeEffects {
    pub fn new(volumes: Arc<Volumes>, node: NodeInbox, runtime: Handle) -> Self {
        Self {
            volumes,
            node,
            runtime,
        }
    }
}

impl Effects<VolumeMachine> for VolumeEffects {
    fn execute(
        &mut self,
        effect: SerialEffect<&'static str, bool>,
        events: &Recipient<Event<VolumeMachine>>,
    ) {
        match effect {
            SerialEffect::Run(cause) => {
                let volumes = self.volumes.clone();
                let pass =
                    async move { volumes.reconcile().await.map_err(|error| error.to_string()) };
                run_pass(
                    &self.runtime,
                    tracing::info_span!("volume pass", cause),
                    "the volume pass".to_string(),
                    pass,
                    events,
                    SerialEvent::Finished,
                );
            }
            // A claim or volume changed a pool's allocation: report the pools again.
            SerialEffect::Report(true) => {
                let _ = self.node.send(Ask::Look("volumes"));
            }
            SerialEffect::Report(false) => {}
        }
    }

    /// Every incarnation starts with a pass (at start, and after a failure).
    fn started(&mut self, events: &Recipient<Event<VolumeMachine>>) {
        events.do_send(Event::root(SerialEvent::Request("started")));
    }
}

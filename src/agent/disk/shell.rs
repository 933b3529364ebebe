//! The `DiskActor`'s shell: makes the writes its machine (`machine`) decides, through a
//! [`DiskWriter`] (the API server in production, a recorder in tests), and reports a
//! disk whose actor keeps failing: a `Degraded` condition on its `BlockDevice` and a
//! Warning Event. It decides nothing.

use std::sync::Arc;

use actix::prelude::*;
use castellan_actors::{ChildFailing, Effects, Event, MachineActor};
use castellan_crds::block_device::BlockDevice;
use futures::future::BoxFuture;
use kube::api::Api;
use kube::runtime::events::{Event as KubeEvent, EventType, Reporter};
use kube::{Client, Resource};
use tracing::Instrument;

use super::inventory::{Inventory, Write};
use super::machine::{DiskEffect, DiskEvent, DiskMachine};
use crate::agent::children::contained;
use crate::events::Recorder;

pub type DiskActor = MachineActor<DiskMachine, DiskEffects>;

/// Makes a disk's writes.
pub trait DiskWriter: Send + Sync + 'static {
    /// Applies one write of the inventory to the object of `generation`.
    fn write(
        &self,
        write: Write,
        generation: Option<i64>,
    ) -> BoxFuture<'static, Result<(), String>>;
    /// Removes the supervisor's `Degraded` condition from `device`.
    fn clear_degraded(&self, device: String) -> BoxFuture<'static, Result<(), String>>;
}

impl DiskWriter for Inventory {
    fn write(
        &self,
        write: Write,
        generation: Option<i64>,
    ) -> BoxFuture<'static, Result<(), String>> {
        let inventory = self.clone();
        Box::pin(async move {
            inventory
                .apply(&write, generation)
                .await
                .map_err(|error| error.to_string())
        })
    }

    fn clear_degraded(&self, device: String) -> BoxFuture<'static, Result<(), String>> {
        let inventory = self.clone();
        Box::pin(async move {
            inventory
                .set_degraded(&device, None)
                .await
                .map_err(|error| error.to_string())
        })
    }
}

/// Executes a `DiskActor`'s effects.
#[derive(Clone)]
pub struct DiskEffects {
    device: String,
    writer: Arc<dyn DiskWriter>,
    runtime: tokio::runtime::Handle,
}

impl DiskEffects {
    pub fn new(device: &str, writer: Arc<dyn DiskWriter>, runtime: tokio::runtime::Handle) -> Self {
        Self {
            device: device.to_string(),
            writer,
            runtime,
        }
    }
}

impl Effects<DiskMachine> for DiskEffects {
    fn execute(&mut self, effect: DiskEffect, events: &Recipient<Event<DiskMachine>>) {
        match effect {
            DiskEffect::Write {
                write,
                generation,
                done,
            } => {
                let events = events.clone();
                let (device, writer, runtime) = (
                    self.device.clone(),
                    self.writer.clone(),
                    self.runtime.clone(),
                );
                let span = tracing::info_span!("write BlockDevice", device = %device);
                let state = write.status.as_ref().and_then(|status| status.state);
                let spec = write.spec.is_some();
                self.runtime.spawn(
                    async move {
                        // A panic in the writer is this disk's failure, reported to its
                        // actor, not a crash of the agent.
                        let what = format!("writing BlockDevice {device}");
                        let outcome =
                            contained(&runtime, &what, writer.write(*write, generation)).await;
                        match &outcome {
                            Ok(()) => tracing::info!(%device, spec, ?state, "BlockDevice written"),
                            Err(error) => {
                                tracing::error!(%device, %error, "writing the BlockDevice failed")
                            }
                        }
                        done.finish();
                        events.do_send(Event::new(DiskEvent::Written(outcome)));
                    }
                    .instrument(span),
                );
            }
            DiskEffect::ClearDegraded => {
                let (device, writer) = (self.device.clone(), self.writer.clone());
                self.runtime.spawn(async move {
                    match writer.clear_degraded(device.clone()).await {
                        Ok(()) => tracing::info!(%device, "the disk's actor works again; Degraded cleared"),
                        Err(error) => {
                            tracing::warn!(%device, %error, "clearing the disk's Degraded condition failed");
                        }
                    }
                });
            }
        }
    }
}

/// The disk supervisor's failure sink: a disk whose actor keeps failing gets
/// `Degraded` with the reason and a Warning Event (its actor cannot report, being the
/// one failing). Runs on the tokio runtime, fed by the supervisor.
pub async fn report_failing_disks(
    client: Client,
    inventory: Inventory,
    mut failing: tokio::sync::mpsc::UnboundedReceiver<ChildFailing>,
) {
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "castellan-agent".into(),
            instance: Some(inventory.node().to_string()),
        },
    );
    let api = Api::<BlockDevice>::all(client);
    while let Some(report) = failing.recv().await {
        let message = report.describe("the disk's actor");
        let device = report.key;
        tracing::error!(%device, %message, "disk actor failing");
        if let Err(error) = inventory.set_degraded(&device, Some(&message)).await {
            tracing::warn!(%device, %error, "could not mark the BlockDevice Degraded");
        }
        let object = match api.get_opt(&device).await {
            Ok(Some(object)) => object,
            Ok(None) => continue,
            Err(error) => {
                tracing::warn!(%device, %error, "could not read a failing BlockDevice");
                continue;
            }
        };
        let event = KubeEvent {
            type_: EventType::Warning,
            reason: "Degraded".into(),
            note: Some(crate::events::note(&message)),
            action: "Supervise".into(),
            secondary: None,
        };
        if let Err(error) = recorder.publish(&event, &object.object_ref(&())).await {
            tracing::warn!(%device, %error, "publishing an Event failed");
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in tests a failed unwrap is a failed test
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Mutex;
    use std::time::Duration;

    use castellan_actors::{GetChildStatus, MachineSpec, RestartPolicy, StartChild, Supervisor};

    use super::*;
    use crate::agent::disk::machine::tests::observed_named;
    use crate::agent::disk::machine::{DiskState, Done, Sighting};

    /// Records the writes; the write of disk `bad` panics (in the write's task).
    #[derive(Default)]
    struct Recording {
        writes: Mutex<BTreeMap<String, u32>>,
    }

    impl DiskWriter for Arc<Recording> {
        fn write(
            &self,
            write: Write,
            _generation: Option<i64>,
        ) -> BoxFuture<'static, Result<(), String>> {
            let recording = self.clone();
            Box::pin(async move {
                assert_ne!(write.name, "bad", "the disk controller is on fire");
                *recording
                    .writes
                    .lock()
                    .unwrap()
                    .entry(write.name)
                    .or_default() += 1;
                Ok(())
            })
        }

        fn clear_degraded(&self, _device: String) -> BoxFuture<'static, Result<(), String>> {
            Box::pin(async { Ok(()) })
        }
    }

    #[actix::test]
    async fn a_panicking_disk_actor_is_restarted_and_reported_while_the_others_go_on() {
        let (sink, mut reports) = tokio::sync::mpsc::unbounded_channel::<ChildFailing>();
        let policy = RestartPolicy {
            min_delay: Duration::from_millis(10),
            max_delay: Duration::from_millis(20),
            factor: 2.0,
            max_failures: 3,
            window: Duration::from_secs(60),
            cool_down: Duration::from_secs(60),
        };
        let disks = Supervisor::<DiskActor>::new("disks", policy, sink).start();
        let recording = Arc::new(Recording::default());
        let writer: Arc<dyn DiskWriter> = Arc::new(recording.clone());
        let runtime = tokio::runtime::Handle::current();
        const LOOKS: u32 = 6;
        for _ in 0..LOOKS {
            let mut waits = Vec::new();
            for name in ["good-a", "bad", "good-b"] {
                let spec = MachineSpec {
                    initial: DiskState::new(),
                    effects: DiskEffects::new(name, writer.clone(), runtime.clone()),
                };
                let started = disks
                    .send(StartChild {
                        key: name.into(),
                        spec,
                    })
                    .await
                    .unwrap();
                // None: `bad` waits out its back-off or cool-down.
                let Some(disk) = started else { continue };
                let (done, wait) = tokio::sync::oneshot::channel();
                let sighting = Sighting {
                    node: "n1".into(),
                    observed: Some(observed_named(name, None)),
                    object: None,
                    now: k8s_openapi::jiff::Timestamp::now(),
                };
                disk.do_send(Event::new(DiskEvent::Seen(Box::new(sighting), Done(done))));
                waits.push(wait);
            }
            // Every disk's work ends, the panicking one's too (its token drops).
            tokio::time::timeout(Duration::from_secs(10), futures::future::join_all(waits))
                .await
                .expect("the look's disk work ended");
            tokio::time::sleep(Duration::from_millis(60)).await;
        }
        // The others' writes were made on every look.
        let writes = recording.writes.lock().unwrap().clone();
        assert_eq!(writes.get("good-a"), Some(&LOOKS));
        assert_eq!(writes.get("good-b"), Some(&LOOKS));
        assert_eq!(writes.get("bad"), None);
        // The panicking one was restarted, and reported once it kept failing.
        let status = disks
            .send(GetChildStatus { key: "bad".into() })
            .await
            .unwrap()
            .unwrap();
        assert!(status.restarts >= 2, "restarted: {status:?}");
        assert!(status.failing, "in its cool-down: {status:?}");
        let failure = status.last_failure.unwrap_or_default();
        assert!(failure.contains("panicked"), "{failure}");
        let report = tokio::time::timeout(Duration::from_secs(5), reports.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!((report.key.as_str(), report.failures), ("bad", 3));
        for good in ["good-a", "good-b"] {
            let status = disks
                .send(GetChildStatus { key: good.into() })
                .await
                .unwrap()
                .unwrap();
            assert_eq!((status.running, status.restarts), (true, 0), "{good}");
        }
    }
}

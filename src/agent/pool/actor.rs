//! The `PoolMemberActor`: this node's part of one `StoragePool` through its phases
//! (`lifecycle`: planning → wiping → formatting/adding → mounting → healthy/degraded,
//! replacing, deleting), one pass at a time, each pass the pool shell's
//! (`shell::Pools::pass`), which reports its steps and where it left the pool. Its
//! supervisor restarts it with back-off when a pass fails, and marks this node's entry
//! of the pool `Failed` with the reason once it keeps failing. This is its shell; it
//! decides nothing, and it works through a [`PoolWork`] (the pool shell in production,
//! a recorder in tests).

use std::sync::Arc;

use actix::prelude::*;
use castellan_actors::{ChildFailing, Effects, Event, MachineActor};
use castellan_crds::storage_pool::StoragePool;
use futures::future::BoxFuture;
use tokio::runtime::Handle;

use super::lifecycle::{MemberEffect, MemberEvent, OnStep, PassEnd, PoolMember};
use super::shell::{Labels, Pools};
use crate::agent::children::{Ask, NodeInbox, run_pass};
use crate::agent::disk::observe::Observed;

/// A pass over a pool with one look's view.
#[derive(Clone, Debug)]
pub struct PoolRequest {
    pub pool: Arc<StoragePool>,
    pub labels: Arc<Labels>,
    pub observed: Arc<Vec<Observed>>,
}

pub type PoolMemberMachine = PoolMember<PoolRequest>;

pub type PoolMemberActor = MachineActor<PoolMemberMachine, PoolMemberEffects>;

/// The work of a pool's actor (its passes) and of its supervisor's sink (marking the
/// node's entry `Failed`): [`Pools`] in production, a recorder in tests.
pub trait PoolWork: Send + Sync + 'static {
    /// One pass over the request's pool, telling `progress` each step it starts.
    fn run(
        self: Arc<Self>,
        request: PoolRequest,
        progress: OnStep,
    ) -> BoxFuture<'static, Result<PassEnd, String>>;
    /// Marks this node's entry of `pool` `Failed` with `message`.
    fn mark_failed(
        self: Arc<Self>,
        pool: String,
        message: String,
    ) -> BoxFuture<'static, Result<(), String>>;
}

impl PoolWork for Pools {
    fn run(
        self: Arc<Self>,
        request: PoolRequest,
        progress: OnStep,
    ) -> BoxFuture<'static, Result<PassEnd, String>> {
        Box::pin(async move {
            self.pass(&request.pool, &request.labels, &request.observed, progress)
                .await
                .map_err(|error| error.to_string())
        })
    }

    fn mark_failed(
        self: Arc<Self>,
        pool: String,
        message: String,
    ) -> BoxFuture<'static, Result<(), String>> {
        Box::pin(async move {
            self.report_failing(&pool, message)
                .await
                .map_err(|error| error.to_string())
        })
    }
}

/// Executes a `PoolMemberActor`'s effects.
#[derive(Clone)]
pub struct PoolMemberEffects {
    pool: String,
    pools: Arc<dyn PoolWork>,
    node: NodeInbox,
    runtime: Handle,
}

impl PoolMemberEffects {
    pub fn new(pool: &str, pools: Arc<dyn PoolWork>, node: NodeInbox, runtime: Handle) -> Self {
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
        effect: MemberEffect<PoolRequest>,
        events: &Recipient<Event<PoolMemberMachine>>,
    ) {
        match effect {
            MemberEffect::Run(request) => {
                let steps = events.clone();
                let progress: OnStep = Arc::new(move |kind| {
                    steps.do_send(Event::new(MemberEvent::Step(kind)));
                });
                let pass = self.pools.clone().run(request, progress);
                run_pass(
                    &self.runtime,
                    tracing::info_span!("pool pass", pool = %self.pool),
                    format!("the pass over pool {}", self.pool),
                    pass,
                    events,
                    MemberEvent::Finished,
                );
            }
            MemberEffect::Report(next) => {
                // A closed inbox: the agent is stopping.
                let _ = self.node.send(Ask::Next(next));
            }
            MemberEffect::Entered { from, to } => {
                tracing::info!(pool = %self.pool, %from, %to, "pool member phase");
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
    pools: Arc<dyn PoolWork>,
    mut failing: tokio::sync::mpsc::UnboundedReceiver<ChildFailing>,
) {
    while let Some(report) = failing.recv().await {
        let message = report.describe("the agent's actor for this pool");
        tracing::error!(pool = %report.key, %message, "pool actor failing");
        if let Err(error) = pools.clone().mark_failed(report.key.clone(), message).await {
            tracing::warn!(pool = %report.key, %error, "could not mark the pool Failed on this node");
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
    use castellan_crds::storage_pool::{
        DeviceFilter, Layout, PoolStorageClass, ReclaimPolicy, StoragePoolSpec,
    };
    use kube::ResourceExt;
    use tokio::sync::mpsc::unbounded_channel;

    use super::*;
    use crate::agent::children::{Ask, Next};
    use crate::agent::pool::lifecycle::{MemberPhase, MemberState, Settled, StepKind};

    /// Counts the passes, of which pool `bad`'s fail, and records the entries the sink
    /// marks `Failed`.
    #[derive(Default)]
    struct Recording {
        passes: Mutex<BTreeMap<String, u32>>,
        marked_failed: Mutex<Vec<(String, String)>>,
    }

    impl PoolWork for Recording {
        fn run(
            self: Arc<Self>,
            request: PoolRequest,
            progress: OnStep,
        ) -> BoxFuture<'static, Result<PassEnd, String>> {
            Box::pin(async move {
                let pool = request.pool.name_any();
                progress(StepKind::Mkfs);
                if pool == "bad" {
                    return Err("building pool bad: mkfs.btrfs: device busy".into());
                }
                progress(StepKind::Mount);
                *self.passes.lock().unwrap().entry(pool).or_default() += 1;
                Ok(PassEnd {
                    settled: Settled::Healthy,
                    next: Next::default(),
                })
            })
        }

        fn mark_failed(
            self: Arc<Self>,
            pool: String,
            message: String,
        ) -> BoxFuture<'static, Result<(), String>> {
            Box::pin(async move {
                self.marked_failed.lock().unwrap().push((pool, message));
                Ok(())
            })
        }
    }

    fn request(name: &str) -> PoolRequest {
        let spec = StoragePoolSpec {
            node_selector: None,
            devices: DeviceFilter::default(),
            layout: Layout::Single,
            storage_class: PoolStorageClass {
                name: format!("castellan-{name}"),
                reclaim_policy: ReclaimPolicy::Delete,
                default: false,
            },
            scrub: None,
        };
        PoolRequest {
            pool: Arc::new(StoragePool::new(name, spec)),
            labels: Arc::default(),
            observed: Arc::default(),
        }
    }

    #[actix::test]
    async fn a_failing_pool_actor_is_restarted_and_marked_failed_while_the_others_go_on() {
        let (sink, reports) = unbounded_channel::<ChildFailing>();
        let policy = RestartPolicy {
            min_delay: Duration::from_millis(10),
            max_delay: Duration::from_millis(20),
            factor: 2.0,
            max_failures: 3,
            window: Duration::from_secs(60),
            cool_down: Duration::from_secs(60),
        };
        let members = Supervisor::<PoolMemberActor>::new("pools", policy, sink).start();
        let recording = Arc::new(Recording::default());
        let work: Arc<dyn PoolWork> = recording.clone();
        let reporter = tokio::spawn(report_failing_pools(work.clone(), reports));
        let (inbox, mut asked) = unbounded_channel::<Ask>();
        let runtime = Handle::current();
        const LOOKS: u32 = 6;
        let mut members_now = BTreeMap::new();
        for _ in 0..LOOKS {
            for name in ["good-a", "bad", "good-b"] {
                let spec = MachineSpec {
                    initial: MemberState::new(),
                    effects: PoolMemberEffects::new(
                        name,
                        work.clone(),
                        inbox.clone(),
                        runtime.clone(),
                    ),
                };
                let started = members
                    .send(StartChild {
                        key: name.into(),
                        spec,
                    })
                    .await
                    .unwrap();
                // None: `bad` waits out its back-off or cool-down.
                let Some(member) = started else { continue };
                member.do_send(Event::new(MemberEvent::Request(request(name))));
                members_now.insert(name, member);
            }
            // Each good pass ends by telling the node what it needs next.
            let mut nexts = 0;
            while nexts < 2 {
                let ask = tokio::time::timeout(Duration::from_secs(10), asked.recv())
                    .await
                    .expect("the good pools' passes ended")
                    .unwrap();
                nexts += u32::from(matches!(ask, Ask::Next(_)));
            }
            tokio::time::sleep(Duration::from_millis(60)).await;
        }
        // The others' passes ran on every look.
        let passes = recording.passes.lock().unwrap().clone();
        assert_eq!(passes.get("good-a"), Some(&LOOKS));
        assert_eq!(passes.get("good-b"), Some(&LOOKS));
        assert_eq!(passes.get("bad"), None);
        // The failing one was restarted, then left in its cool-down…
        let status = members
            .send(GetChildStatus { key: "bad".into() })
            .await
            .unwrap()
            .unwrap();
        assert!(status.restarts >= 2, "restarted: {status:?}");
        assert!(status.failing, "in its cool-down: {status:?}");
        // …and this node's entry of its pool marked Failed, once, saying why.
        let marked = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                let marked = recording.marked_failed.lock().unwrap().clone();
                if !marked.is_empty() {
                    return marked;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the sink marked the pool");
        assert_eq!(
            marked,
            [(
                "bad".to_string(),
                "the agent's actor for this pool failed 3 times in a row \
                 (building pool bad: mkfs.btrfs: device busy); retrying in 60s"
                    .to_string()
            )]
        );
        for good in ["good-a", "good-b"] {
            let status = members
                .send(GetChildStatus { key: good.into() })
                .await
                .unwrap()
                .unwrap();
            assert_eq!((status.running, status.restarts), (true, 0), "{good}");
            // Their passes' steps and ends moved them through their phases.
            let state = members_now[good]
                .send(castellan_actors::GetState::default())
                .await
                .unwrap()
                .unwrap();
            assert_eq!(state.phase, MemberPhase::Healthy, "{good}");
        }
        reporter.abort();
    }
}

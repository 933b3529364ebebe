//! The parent half of Castellan's supervision tree: a [`Supervisor`] actor owns the
//! named children of one kind (keyed by resource name), starts them, holds their
//! [`Addr`]s, learns through a [`ChildLink`] when one stops, and restarts a child that
//! failed or panicked with exponential back-off. A child that keeps failing is reported
//! through a [`FailureSink`] and left stopped for a cool-down instead of looping.
//!
//! It owns restart policy only. It does not catch panics itself: the child side does,
//! either at the handler boundary ([`catch_panic`], used by the state-machine shell) or,
//! for a panic nothing caught, through the [`ChildLink`] that the child owns and that
//! reports from its `Drop` while the actor is torn down by the unwinding task. See
//! `docs/actors.md`.

use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{Duration, Instant};

use actix::WeakRecipient;
use actix::prelude::*;
use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use tracing::{info, warn};

/// Name of a child under its parent, e.g. a resource's `namespace/name`.
pub type ChildKey = String;

/// An actor that a [`Supervisor`] can start and restart.
///
/// `build` must store the [`ChildLink`] in the returned actor for as long as the actor
/// lives: the link reports the child's end to the parent when it is dropped. A child
/// that drops its link early is reported as stopped cleanly and is never restarted.
pub trait Child: Actor<Context = Context<Self>> + Handler<Shutdown> {
    /// What the parent needs to (re)build the child: restarts start from this, so state
    /// that must survive a restart belongs in the resource's status, not only here.
    type Spec: Clone + Unpin + Send + 'static;

    /// Builds a fresh child; called on the first start and on every restart.
    fn build(key: &ChildKey, spec: &Self::Spec, link: ChildLink) -> Self;
}

/// Asks a child to stop cleanly (its resource is gone, or the tree is shutting down).
/// A child handles it with `ctx.stop()`, after whatever tidying it needs.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct Shutdown;

/// How a child ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChildExit {
    /// The child stopped on purpose (or its parent asked it to): never restarted.
    Stopped,
    /// The child failed or panicked; the reason is what will be recorded and reported.
    Failed(String),
}

/// Sent to the parent when a child's actor is gone. Built only by [`ChildLink`].
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct ChildStopped {
    pub key: ChildKey,
    /// Which incarnation ended, so a late report from a replaced child is ignored.
    pub generation: u64,
    pub exit: ChildExit,
}

/// The child's end of the parent–child bond. Owned by the child actor; reports to the
/// parent exactly once, when dropped (the actor is dropped when it stops, and also when
/// a panic unwinds out of one of its handlers and the runtime drops the actor's task).
pub struct ChildLink {
    key: ChildKey,
    generation: u64,
    /// Weak, so that children never keep their parent alive: the parent owns the
    /// children, not the other way round, and a stopped parent takes them down.
    parent: WeakRecipient<ChildStopped>,
    failure: Option<String>,
}

impl ChildLink {
    /// A link to `parent`; useful for starting a [`Child`] without a [`Supervisor`]
    /// (tests, or a parent that supervises by hand).
    pub fn new(key: ChildKey, generation: u64, parent: Recipient<ChildStopped>) -> Self {
        Self {
            key,
            generation,
            parent: parent.downgrade(),
            failure: None,
        }
    }

    /// The child's name under its parent.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Records why the child is about to stop as a failure; call before `ctx.stop()`.
    pub fn fail(&mut self, reason: impl Into<String>) {
        self.failure = Some(reason.into());
    }
}

impl Drop for ChildLink {
    fn drop(&mut self) {
        let exit = match self.failure.take() {
            Some(reason) => ChildExit::Failed(reason),
            // The panic was not caught at a handler boundary: the runtime is dropping
            // the actor while unwinding. The payload is gone by now (the default hook
            // has logged it), so say where it happened.
            None if std::thread::panicking() => ChildExit::Failed(
                "panicked in a message handler (uncaught; see the log for the message)".to_owned(),
            ),
            None => ChildExit::Stopped,
        };
        // `do_send` never panics (a panic here, during unwinding, would abort); if the
        // parent is gone there is nobody left to tell.
        if let Some(parent) = self.parent.upgrade() {
            parent.do_send(ChildStopped {
                key: std::mem::take(&mut self.key),
                generation: self.generation,
                exit,
            });
        }
    }
}

/// Runs `work`, turning a panic into `Err(message)`, so a handler can record the reason
/// and stop its actor as failed instead of letting the panic unwind through actix.
pub fn catch_panic<T>(work: impl FnOnce() -> T) -> Result<T, String> {
    // AssertUnwindSafe: on a panic the caller stops the actor and the parent rebuilds
    // it from its spec, so state the panic may have left half-updated is never observed.
    catch_unwind(AssertUnwindSafe(work)).map_err(|payload| panic_message(payload.as_ref()))
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(message) = payload.downcast_ref::<&str>() {
        format!("panicked: {message}")
    } else if let Some(message) = payload.downcast_ref::<String>() {
        format!("panicked: {message}")
    } else {
        "panicked with a non-string payload".to_owned()
    }
}

/// A child that failed too often and is not being restarted for a while.
#[derive(Debug, Clone, PartialEq, Eq, Message)]
#[rtype(result = "()")]
pub struct ChildFailing {
    pub key: ChildKey,
    /// The latest failure's reason (in the operator: the `Degraded` condition message).
    pub reason: String,
    /// Consecutive failures inside the window that tripped the limit.
    pub failures: u32,
    /// How long the supervisor waits before trying again.
    pub retry_after: Duration,
}

impl ChildFailing {
    /// The report in words, about `actor` ("the cluster's actor"): what a sink shows
    /// the user (a condition's or Event's message).
    pub fn describe(&self, actor: &str) -> String {
        format!(
            "{actor} failed {} times in a row ({}); retrying in {}s",
            self.failures,
            self.reason,
            self.retry_after.as_secs()
        )
    }
}

/// Where a supervisor reports a child that keeps failing. The owner provides it: in the
/// operator it marks the resource `Degraded` with the reason.
pub trait FailureSink: 'static {
    fn child_failing(&self, failing: ChildFailing);

    /// Every failure of a child, before the supervisor schedules its restart: what a
    /// restart counter counts. Most sinks only care about children that keep failing.
    fn child_failed(&self, _key: &ChildKey, _reason: &str) {}
}

impl FailureSink for Recipient<ChildFailing> {
    fn child_failing(&self, failing: ChildFailing) {
        self.do_send(failing);
    }
}

impl FailureSink for tokio::sync::mpsc::UnboundedSender<ChildFailing> {
    fn child_failing(&self, failing: ChildFailing) {
        // A closed receiver means the owner is shutting down; nothing to report to.
        let _ = self.send(failing);
    }
}

/// Restart behaviour of a [`Supervisor`].
#[derive(Debug, Clone)]
pub struct RestartPolicy {
    /// First restart delay; later ones grow by `factor` up to `max_delay`.
    pub min_delay: Duration,
    pub max_delay: Duration,
    pub factor: f32,
    /// Failures within `window` that make a child "failing".
    pub max_failures: u32,
    /// Failures further apart than this are not consecutive: the count and the
    /// back-off start over.
    pub window: Duration,
    /// How long a failing child stays stopped before one more attempt.
    pub cool_down: Duration,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        Self {
            min_delay: Duration::from_millis(500),
            max_delay: Duration::from_secs(60),
            factor: 2.0,
            max_failures: 5,
            window: Duration::from_secs(300),
            cool_down: Duration::from_secs(600),
        }
    }
}

impl RestartPolicy {
    fn backoff(&self) -> ExponentialBackoff {
        ExponentialBuilder::new()
            .with_min_delay(self.min_delay)
            .with_max_delay(self.max_delay)
            .with_factor(self.factor)
            .without_max_times()
            .build()
    }
}

/// How many restart delays [`ChildStatus`] remembers.
pub const RESTART_HISTORY: usize = 32;

/// What the supervisor knows about one child, for status and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChildStatus {
    /// True while an incarnation is running (false while waiting to restart).
    pub running: bool,
    /// Restarts so far (after failures; a clean start does not count).
    pub restarts: u32,
    /// Delay chosen for each restart, oldest first (the last [`RESTART_HISTORY`]).
    pub restart_delays: Vec<Duration>,
    /// Reason of the latest failure.
    pub last_failure: Option<String>,
    /// True while the child is in its cool-down after being reported failing.
    pub failing: bool,
}

struct ChildEntry<C: Child> {
    spec: C::Spec,
    generation: u64,
    addr: Option<Addr<C>>,
    backoff: ExponentialBackoff,
    failures: VecDeque<Instant>,
    status: ChildStatus,
}

fn start_child<C: Child>(
    key: &ChildKey,
    entry: &mut ChildEntry<C>,
    generation: u64,
    parent: Recipient<ChildStopped>,
) -> Addr<C> {
    let link = ChildLink::new(key.clone(), generation, parent);
    let addr = C::build(key, &entry.spec, link).start();
    entry.generation = generation;
    entry.addr = Some(addr.clone());
    entry.status.running = true;
    addr
}

/// Parent of the children of one kind. A node of the tree that has children of several
/// kinds (a cluster with replicas and backups) owns one supervisor per kind.
pub struct Supervisor<C: Child> {
    name: String,
    policy: RestartPolicy,
    sink: Box<dyn FailureSink>,
    children: HashMap<ChildKey, ChildEntry<C>>,
    next_generation: u64,
}

impl<C: Child> Supervisor<C> {
    pub fn new(name: impl Into<String>, policy: RestartPolicy, sink: impl FailureSink) -> Self {
        Self {
            name: name.into(),
            policy,
            sink: Box::new(sink),
            children: HashMap::new(),
            next_generation: 0,
        }
    }

    fn spawn(&mut self, key: &ChildKey, ctx: &mut Context<Self>) {
        self.next_generation += 1;
        let generation = self.next_generation;
        if let Some(entry) = self.children.get_mut(key) {
            start_child(key, entry, generation, ctx.address().recipient());
        }
    }

    fn child_failed(&mut self, key: &ChildKey, reason: String, ctx: &mut Context<Self>) {
        let policy = self.policy.clone();
        let Some(entry) = self.children.get_mut(key) else {
            return;
        };
        let now = Instant::now();
        // Failures further apart than the window are not consecutive: the child served
        // well in between, so its back-off and count start over.
        if entry
            .failures
            .back()
            .is_some_and(|last| now.duration_since(*last) > policy.window)
        {
            entry.failures.clear();
            entry.backoff = policy.backoff();
        }
        entry.failures.push_back(now);
        entry.status.last_failure = Some(reason.clone());
        self.sink.child_failed(key, &reason);

        let failures = u32::try_from(entry.failures.len()).unwrap_or(u32::MAX);
        let delay = if failures >= policy.max_failures {
            warn!(supervisor = %self.name, child = %key, %reason, failures, "child keeps failing; pausing restarts");
            entry.status.failing = true;
            entry.failures.clear();
            entry.backoff = policy.backoff();
            self.sink.child_failing(ChildFailing {
                key: key.clone(),
                reason,
                failures,
                retry_after: policy.cool_down,
            });
            policy.cool_down
        } else {
            // The iterator is built without a limit, so it always yields; fall back to
            // the ceiling rather than restarting in a tight loop.
            let delay = entry.backoff.next().unwrap_or(policy.max_delay);
            warn!(supervisor = %self.name, child = %key, %reason, ?delay, "child failed; restarting after back-off");
            delay
        };
        entry.status.restart_delays.push(delay);
        // Keep the recent history only: a child may live for months.
        if entry.status.restart_delays.len() > RESTART_HISTORY {
            entry.status.restart_delays.remove(0);
        }
        let generation = entry.generation;
        let key = key.clone();
        ctx.run_later(delay, move |supervisor, ctx| {
            // Restart only if the child is still wanted and nothing replaced it meanwhile.
            let still_due = supervisor
                .children
                .get(&key)
                .is_some_and(|entry| entry.generation == generation && entry.addr.is_none());
            if still_due {
                if let Some(entry) = supervisor.children.get_mut(&key) {
                    entry.status.restarts += 1;
                    entry.status.failing = false;
                }
                supervisor.spawn(&key, ctx);
            }
        });
    }
}

impl<C: Child> Actor for Supervisor<C> {
    type Context = Context<Self>;

    fn stopped(&mut self, _ctx: &mut Self::Context) {
        // Children go with their parent; their final reports find this mailbox closed,
        // which is fine.
        info!(supervisor = %self.name, children = self.children.len(), "supervisor stopped");
        for (_, entry) in self.children.drain() {
            if let Some(addr) = entry.addr {
                addr.do_send(Shutdown);
            }
        }
    }
}

/// Starts (or, if present, keeps) a child and returns its address — `None` while a
/// failed child waits out its back-off or cool-down. The spec is stored as the seed
/// for restarts; a running child is not rebuilt when it changes. Idempotent.
#[derive(Message)]
#[rtype(result = "Option<Addr<C>>")]
pub struct StartChild<C: Child> {
    pub key: ChildKey,
    pub spec: C::Spec,
}

/// Restarts a child that waits out its back-off or cool-down now, e.g. because the
/// user changed the resource. Answers whether a restart happened.
#[derive(Debug, Message)]
#[rtype(result = "bool")]
pub struct RestartNow {
    pub key: ChildKey,
}

/// Stops a child for good (its resource was deleted). Not a failure.
#[derive(Debug, Message)]
#[rtype(result = "bool")]
pub struct StopChild {
    pub key: ChildKey,
}

/// Stops for good every child whose key is not in `keys` (their resources are gone),
/// as [`StopChild`] does for one; answers the keys it stopped. For an owner that knows
/// the whole set of resources, not which of them went.
#[derive(Debug, Message)]
#[rtype(result = "Vec<ChildKey>")]
pub struct RetainChildren {
    pub keys: std::collections::BTreeSet<ChildKey>,
}

/// The running child's address, if any (none while it waits to restart).
#[derive(Debug, Message)]
#[rtype(result = "Option<Addr<C>>")]
pub struct GetChild<C: Child> {
    pub key: ChildKey,
    _kind: std::marker::PhantomData<fn() -> C>,
}

impl<C: Child> GetChild<C> {
    pub fn new(key: impl Into<ChildKey>) -> Self {
        Self {
            key: key.into(),
            _kind: std::marker::PhantomData,
        }
    }
}

/// What the supervisor knows about one child.
#[derive(Debug, Message)]
#[rtype(result = "Option<ChildStatus>")]
pub struct GetChildStatus {
    pub key: ChildKey,
}

impl<C: Child> fmt::Debug for StartChild<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StartChild")
            .field("key", &self.key)
            .finish()
    }
}

impl<C: Child> Handler<StartChild<C>> for Supervisor<C> {
    type Result = Option<Addr<C>>;

    fn handle(&mut self, message: StartChild<C>, ctx: &mut Self::Context) -> Self::Result {
        if let Some(entry) = self.children.get_mut(&message.key) {
            // Known child: keep the spec current for the next restart, but never cut a
            // back-off or cool-down short here — reconcile sends this on every resync,
            // and that must not turn into a restart loop at resync rate.
            entry.spec = message.spec;
            return entry.addr.clone();
        }
        self.children.insert(
            message.key.clone(),
            ChildEntry {
                spec: message.spec,
                generation: 0,
                addr: None,
                backoff: self.policy.backoff(),
                failures: VecDeque::new(),
                status: ChildStatus::default(),
            },
        );
        self.spawn(&message.key, ctx);
        self.children
            .get(&message.key)
            .and_then(|entry| entry.addr.clone())
    }
}

impl<C: Child> Handler<RestartNow> for Supervisor<C> {
    type Result = bool;

    fn handle(&mut self, message: RestartNow, ctx: &mut Self::Context) -> bool {
        let waiting = self
            .children
            .get_mut(&message.key)
            .filter(|entry| entry.addr.is_none());
        let Some(entry) = waiting else {
            return false;
        };
        entry.status.restarts += 1;
        entry.status.failing = false;
        // The pending delayed restart finds the child running and does nothing.
        self.spawn(&message.key, ctx);
        true
    }
}

impl<C: Child> Handler<StopChild> for Supervisor<C> {
    type Result = bool;

    fn handle(&mut self, message: StopChild, _ctx: &mut Self::Context) -> bool {
        // Forgetting the entry first makes the child's final report unknown, so it is
        // not restarted whatever it says.
        match self.children.remove(&message.key) {
            Some(entry) => {
                if let Some(addr) = entry.addr {
                    addr.do_send(Shutdown);
                }
                true
            }
            None => false,
        }
    }
}

impl<C: Child> Handler<RetainChildren> for Supervisor<C> {
    type Result = Vec<ChildKey>;

    fn handle(&mut self, message: RetainChildren, _ctx: &mut Self::Context) -> Vec<ChildKey> {
        let mut gone: Vec<ChildKey> = self
            .children
            .keys()
            .filter(|key| !message.keys.contains(*key))
            .cloned()
            .collect();
        gone.sort();
        for key in &gone {
            // Forgotten first, as in `StopChild`: its final report restarts nothing.
            if let Some(addr) = self.children.remove(key).and_then(|entry| entry.addr) {
                addr.do_send(Shutdown);
            }
        }
        gone
    }
}

/// Stops the supervisor and, with it, all its children.
impl<C: Child> Handler<Shutdown> for Supervisor<C> {
    type Result = ();

    fn handle(&mut self, _: Shutdown, ctx: &mut Self::Context) {
        ctx.stop();
    }
}

impl<C: Child> Handler<GetChild<C>> for Supervisor<C> {
    type Result = Option<Addr<C>>;

    fn handle(&mut self, message: GetChild<C>, _ctx: &mut Self::Context) -> Self::Result {
        self.children
            .get(&message.key)
            .and_then(|entry| entry.addr.clone())
    }
}

impl<C: Child> Handler<GetChildStatus> for Supervisor<C> {
    type Result = Option<ChildStatus>;

    fn handle(&mut self, message: GetChildStatus, _ctx: &mut Self::Context) -> Self::Result {
        self.children
            .get(&message.key)
            .map(|entry| entry.status.clone())
    }
}

impl<C: Child> Handler<ChildStopped> for Supervisor<C> {
    type Result = ();

    fn handle(&mut self, message: ChildStopped, ctx: &mut Self::Context) {
        let Some(entry) = self.children.get_mut(&message.key) else {
            return; // stopped on request, already forgotten
        };
        if entry.generation != message.generation {
            return; // a replaced incarnation reporting late
        }
        entry.addr = None;
        entry.status.running = false;
        match message.exit {
            ChildExit::Stopped => {
                info!(supervisor = %self.name, child = %message.key, "child stopped cleanly");
                self.children.remove(&message.key);
            }
            ChildExit::Failed(reason) => self.child_failed(&message.key, reason, ctx),
        }
    }
}

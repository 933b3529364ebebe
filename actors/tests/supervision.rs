//! The supervision tree against real actix: panics, failures, back-off, the failing
//! report, sibling isolation, clean stops, and the parent taking its children down.
#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use actix::prelude::*;
use castellan_actors::{
    Child, ChildFailing, ChildKey, ChildLink, ChildStatus, FailureSink, GetChild, GetChildStatus,
    RestartNow, RestartPolicy, RetainChildren, Shutdown, StartChild, StopChild, Supervisor,
};
use tokio::sync::mpsc;

/// Counts starts and drops of every incarnation built from one spec.
#[derive(Clone, Default)]
struct Counters {
    starts: Arc<AtomicUsize>,
    drops: Arc<AtomicUsize>,
}

#[derive(Clone, Default)]
struct WorkerSpec {
    counters: Counters,
    /// Fail right after starting, every time (a child that cannot come up).
    fail_on_start: Option<String>,
}

struct Worker {
    link: ChildLink,
    spec: WorkerSpec,
    served: u32,
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.spec.counters.drops.fetch_add(1, Ordering::SeqCst);
    }
}

impl Actor for Worker {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        self.spec.counters.starts.fetch_add(1, Ordering::SeqCst);
        if let Some(reason) = &self.spec.fail_on_start {
            self.link.fail(reason.clone());
            ctx.stop();
        }
    }
}

impl Child for Worker {
    type Spec = WorkerSpec;

    fn build(_key: &ChildKey, spec: &WorkerSpec, link: ChildLink) -> Self {
        Self {
            link,
            spec: spec.clone(),
            served: 0,
        }
    }
}

impl Handler<Shutdown> for Worker {
    type Result = ();
    fn handle(&mut self, _: Shutdown, ctx: &mut Self::Context) {
        ctx.stop();
    }
}

/// Answers with how many pings this incarnation has served.
#[derive(Message)]
#[rtype(result = "u32")]
struct Ping;

impl Handler<Ping> for Worker {
    type Result = u32;
    fn handle(&mut self, _: Ping, _ctx: &mut Self::Context) -> u32 {
        self.served += 1;
        self.served
    }
}

/// A bug: panics inside the handler, uncaught.
#[derive(Message)]
#[rtype(result = "()")]
struct Explode;

impl Handler<Explode> for Worker {
    type Result = ();
    fn handle(&mut self, _: Explode, _ctx: &mut Self::Context) {
        panic!("worker exploded on purpose");
    }
}

/// Stops on its own, cleanly (its work is done).
#[derive(Message)]
#[rtype(result = "()")]
struct Finish;

impl Handler<Finish> for Worker {
    type Result = ();
    fn handle(&mut self, _: Finish, ctx: &mut Self::Context) {
        ctx.stop();
    }
}

fn fast_policy() -> RestartPolicy {
    RestartPolicy {
        min_delay: Duration::from_millis(10),
        max_delay: Duration::from_secs(5),
        factor: 2.0,
        max_failures: 10,
        window: Duration::from_secs(60),
        cool_down: Duration::from_secs(3600),
    }
}

type Reports = mpsc::UnboundedReceiver<ChildFailing>;

fn start_supervisor(policy: RestartPolicy) -> (Addr<Supervisor<Worker>>, Reports) {
    let (sink, reports) = mpsc::unbounded_channel();
    (
        Supervisor::<Worker>::new("test", policy, sink).start(),
        reports,
    )
}

async fn status(parent: &Addr<Supervisor<Worker>>, key: &str) -> Option<ChildStatus> {
    parent
        .send(GetChildStatus { key: key.into() })
        .await
        .expect("supervisor alive")
}

/// Polls `check` until it holds; generous deadline so a slow machine does not flake.
async fn wait_until<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn wait_restarts(parent: &Addr<Supervisor<Worker>>, key: &str, restarts: u32) {
    wait_until(&format!("{key} restarted {restarts} times"), || async {
        status(parent, key)
            .await
            .is_some_and(|s| s.running && s.restarts == restarts)
    })
    .await;
}

async fn child(parent: &Addr<Supervisor<Worker>>, key: &str) -> Addr<Worker> {
    parent
        .send(GetChild::new(key))
        .await
        .expect("supervisor alive")
        .expect("child running")
}

#[actix_rt::test]
async fn panicking_child_is_restarted_and_keeps_serving() {
    let (parent, mut reports) = start_supervisor(fast_policy());
    let spec = WorkerSpec::default();
    let first = parent
        .send(StartChild {
            key: "orders".into(),
            spec: spec.clone(),
        })
        .await
        .unwrap()
        .expect("child started");
    assert_eq!(first.send(Ping).await.unwrap(), 1);

    // The reply never comes: the actor dies mid-handler.
    assert!(first.send(Explode).await.is_err());
    wait_restarts(&parent, "orders", 1).await;

    let status = status(&parent, "orders").await.unwrap();
    let reason = status.last_failure.unwrap();
    assert!(reason.contains("panicked"), "reason: {reason}");
    assert_eq!(spec.counters.starts.load(Ordering::SeqCst), 2);
    assert_eq!(spec.counters.drops.load(Ordering::SeqCst), 1);

    // A fresh incarnation, serving again.
    let second = child(&parent, "orders").await;
    assert_eq!(second.send(Ping).await.unwrap(), 1);
    assert_eq!(second.send(Ping).await.unwrap(), 2);
    assert!(reports.try_recv().is_err(), "one panic is not 'failing'");
}

/// A sink that counts every failure, as the operator's restart counter does.
struct CountingSink(Arc<AtomicUsize>);

impl FailureSink for CountingSink {
    fn child_failing(&self, _failing: ChildFailing) {}

    fn child_failed(&self, key: &ChildKey, reason: &str) {
        assert_eq!(key, "orders");
        assert!(reason.contains("panicked"), "reason: {reason}");
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[actix_rt::test]
async fn every_failure_reaches_the_sink_before_its_restart() {
    let failures = Arc::new(AtomicUsize::new(0));
    let parent =
        Supervisor::<Worker>::new("test", fast_policy(), CountingSink(failures.clone())).start();
    parent
        .send(StartChild {
            key: "orders".into(),
            spec: WorkerSpec::default(),
        })
        .await
        .unwrap()
        .expect("child started");
    for restarts in 1..=3 {
        let _ = child(&parent, "orders").await.send(Explode).await;
        wait_restarts(&parent, "orders", restarts).await;
        assert_eq!(failures.load(Ordering::SeqCst), restarts as usize);
    }
}

#[actix_rt::test]
async fn restart_delays_grow() {
    let (parent, _reports) = start_supervisor(fast_policy());
    parent
        .send(StartChild {
            key: "orders".into(),
            spec: WorkerSpec::default(),
        })
        .await
        .unwrap()
        .expect("child started");
    for restarts in 1..=4 {
        let _ = child(&parent, "orders").await.send(Explode).await;
        wait_restarts(&parent, "orders", restarts).await;
    }
    let delays = status(&parent, "orders").await.unwrap().restart_delays;
    assert_eq!(delays.len(), 4);
    assert!(
        delays.windows(2).all(|pair| pair[1] > pair[0]),
        "delays must grow: {delays:?}"
    );
    assert_eq!(delays[0], Duration::from_millis(10));
}

#[actix_rt::test]
async fn child_that_keeps_failing_is_reported_and_not_restarted_in_a_loop() {
    let policy = RestartPolicy {
        max_failures: 3,
        ..fast_policy()
    };
    let (parent, mut reports) = start_supervisor(policy);
    let spec = WorkerSpec {
        fail_on_start: Some("disk /dev/loop3 is gone".into()),
        ..WorkerSpec::default()
    };
    parent
        .send(StartChild {
            key: "orders".into(),
            spec: spec.clone(),
        })
        .await
        .unwrap()
        .expect("child started");

    let report = tokio::time::timeout(Duration::from_secs(20), reports.recv())
        .await
        .expect("a failing report")
        .expect("sink open");
    assert_eq!(
        report,
        ChildFailing {
            key: "orders".into(),
            reason: "disk /dev/loop3 is gone".into(),
            failures: 3,
            retry_after: Duration::from_secs(3600),
        }
    );

    // Three starts, then quiet: give a tight loop every chance to show itself.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(spec.counters.starts.load(Ordering::SeqCst), 3);
    let status = status(&parent, "orders").await.unwrap();
    assert!(status.failing && !status.running);
    assert_eq!(status.restarts, 2);
    assert!(reports.try_recv().is_err(), "reported once");
}

#[actix_rt::test]
async fn only_the_failed_child_is_restarted() {
    let (parent, _reports) = start_supervisor(fast_policy());
    let (left, right) = (WorkerSpec::default(), WorkerSpec::default());
    let left_addr = parent
        .send(StartChild {
            key: "left".into(),
            spec: left.clone(),
        })
        .await
        .unwrap()
        .expect("child started");
    let right_addr = parent
        .send(StartChild {
            key: "right".into(),
            spec: right.clone(),
        })
        .await
        .unwrap()
        .expect("child started");
    assert_eq!(right_addr.send(Ping).await.unwrap(), 1);

    let _ = left_addr.send(Explode).await;
    wait_restarts(&parent, "left", 1).await;

    // The sibling is the same incarnation: its count goes on.
    assert_eq!(right_addr.send(Ping).await.unwrap(), 2);
    assert_eq!(right.counters.starts.load(Ordering::SeqCst), 1);
    assert_eq!(right.counters.drops.load(Ordering::SeqCst), 0);
    assert_eq!(status(&parent, "right").await.unwrap().restarts, 0);
    assert_eq!(left.counters.starts.load(Ordering::SeqCst), 2);
}

#[actix_rt::test]
async fn clean_stop_is_not_a_failure() {
    let (parent, mut reports) = start_supervisor(fast_policy());
    let spec = WorkerSpec::default();
    let addr = parent
        .send(StartChild {
            key: "orders".into(),
            spec: spec.clone(),
        })
        .await
        .unwrap()
        .expect("child started");
    addr.do_send(Finish);
    wait_until("the stopped child is forgotten", || async {
        status(&parent, "orders").await.is_none()
    })
    .await;

    // And a child stopped on request is not restarted either.
    let other = WorkerSpec::default();
    parent
        .send(StartChild {
            key: "deleted".into(),
            spec: other.clone(),
        })
        .await
        .unwrap()
        .expect("child started");
    assert!(
        parent
            .send(StopChild {
                key: "deleted".into()
            })
            .await
            .unwrap()
    );
    wait_until("the stopped child is dropped", || async {
        other.counters.drops.load(Ordering::SeqCst) == 1
    })
    .await;

    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(spec.counters.starts.load(Ordering::SeqCst), 1);
    assert_eq!(other.counters.starts.load(Ordering::SeqCst), 1);
    assert!(
        parent
            .send(GetChild::new("deleted"))
            .await
            .unwrap()
            .is_none()
    );
    assert!(reports.try_recv().is_err());
}

#[actix_rt::test]
async fn retaining_children_stops_the_others_for_good() {
    let (parent, mut reports) = start_supervisor(fast_policy());
    let specs: Vec<(&str, WorkerSpec)> = ["a", "b", "c"]
        .into_iter()
        .map(|key| (key, WorkerSpec::default()))
        .collect();
    for (key, spec) in &specs {
        parent
            .send(StartChild {
                key: (*key).into(),
                spec: spec.clone(),
            })
            .await
            .unwrap()
            .expect("child started");
    }
    let stopped = parent
        .send(RetainChildren {
            keys: ["b".to_string(), "z".to_string()].into(),
        })
        .await
        .unwrap();
    assert_eq!(stopped, vec!["a".to_string(), "c".to_string()]);
    wait_until("the others are dropped", || async {
        specs[0].1.counters.drops.load(Ordering::SeqCst) == 1
            && specs[2].1.counters.drops.load(Ordering::SeqCst) == 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    for (key, spec) in &specs {
        assert_eq!(spec.counters.starts.load(Ordering::SeqCst), 1, "{key}");
    }
    assert!(status(&parent, "a").await.is_none());
    assert!(parent.send(GetChild::new("b")).await.unwrap().is_some());
    // A key to keep that was never started is not started by it.
    assert!(status(&parent, "z").await.is_none());
    assert!(reports.try_recv().is_err());
}

#[actix_rt::test]
async fn stopping_the_parent_stops_its_children() {
    let (parent, _reports) = start_supervisor(fast_policy());
    let spec = WorkerSpec::default();
    for key in ["a", "b", "c"] {
        parent
            .send(StartChild {
                key: key.into(),
                spec: spec.clone(),
            })
            .await
            .unwrap()
            .expect("child started");
    }
    let held = child(&parent, "a").await; // an outside holder must not keep it alive
    // Stop the parent by dropping its only address.
    drop(parent);
    wait_until("all children are dropped", || async {
        spec.counters.drops.load(Ordering::SeqCst) == 3
    })
    .await;
    assert!(held.send(Ping).await.is_err());
    assert_eq!(spec.counters.starts.load(Ordering::SeqCst), 3);
}

#[actix_rt::test]
async fn failing_child_is_tried_again_after_its_cool_down() {
    let policy = RestartPolicy {
        max_failures: 2,
        cool_down: Duration::from_millis(200),
        ..fast_policy()
    };
    let (parent, mut reports) = start_supervisor(policy);
    let spec = WorkerSpec {
        fail_on_start: Some("no quorum".into()),
        ..WorkerSpec::default()
    };
    parent
        .send(StartChild {
            key: "orders".into(),
            spec: spec.clone(),
        })
        .await
        .unwrap();
    for _ in 0..2 {
        let report = tokio::time::timeout(Duration::from_secs(20), reports.recv())
            .await
            .expect("a failing report")
            .expect("sink open");
        assert_eq!(report.reason, "no quorum");
        assert_eq!(report.failures, 2);
    }
    // Two rounds of two attempts; each round starts from the minimum delay again.
    assert!(spec.counters.starts.load(Ordering::SeqCst) >= 4);
    let delays = status(&parent, "orders").await.unwrap().restart_delays;
    assert_eq!(
        &delays[..4],
        &[
            Duration::from_millis(10),
            Duration::from_millis(200),
            Duration::from_millis(10),
            Duration::from_millis(200),
        ]
    );
}

#[actix_rt::test]
async fn failures_further_apart_than_the_window_start_over() {
    let policy = RestartPolicy {
        max_failures: 2,
        window: Duration::from_millis(100),
        ..fast_policy()
    };
    let (parent, mut reports) = start_supervisor(policy);
    parent
        .send(StartChild {
            key: "orders".into(),
            spec: WorkerSpec::default(),
        })
        .await
        .unwrap();
    for restarts in 1..=3 {
        // Serve well for longer than the window before the next failure.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let _ = child(&parent, "orders").await.send(Explode).await;
        wait_restarts(&parent, "orders", restarts).await;
    }
    let delays = status(&parent, "orders").await.unwrap().restart_delays;
    assert_eq!(delays, vec![Duration::from_millis(10); 3]);
    assert!(
        reports.try_recv().is_err(),
        "never two failures in a window"
    );
}

#[actix_rt::test]
async fn resync_does_not_cut_a_cool_down_short_but_restart_now_does() {
    let policy = RestartPolicy {
        max_failures: 1,
        ..fast_policy()
    };
    let (parent, mut reports) = start_supervisor(policy);
    let failing = WorkerSpec {
        fail_on_start: Some("bad image".into()),
        ..WorkerSpec::default()
    };
    parent
        .send(StartChild {
            key: "orders".into(),
            spec: failing.clone(),
        })
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(20), reports.recv())
        .await
        .expect("a failing report");

    // The owner fixes the spec; a resync re-sends StartChild: still cooling down.
    let fixed = WorkerSpec::default();
    let during_cool_down = parent
        .send(StartChild {
            key: "orders".into(),
            spec: fixed.clone(),
        })
        .await
        .unwrap();
    assert!(during_cool_down.is_none());
    assert_eq!(fixed.counters.starts.load(Ordering::SeqCst), 0);

    // The owner knows the resource changed: restart now, from the new spec.
    assert!(
        parent
            .send(RestartNow {
                key: "orders".into()
            })
            .await
            .unwrap()
    );
    assert_eq!(child(&parent, "orders").await.send(Ping).await.unwrap(), 1);
    assert_eq!(fixed.counters.starts.load(Ordering::SeqCst), 1);
    let status = status(&parent, "orders").await.unwrap();
    assert!(status.running && !status.failing);
    assert!(
        !parent
            .send(RestartNow {
                key: "orders".into()
            })
            .await
            .unwrap(),
        "a running child is not restarted"
    );
}

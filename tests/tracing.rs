//! One operation is one trace across processes: a cluster is created and its
//! parameters changed, with both processes exporting over OTLP to a real OpenTelemetry
//! Collector (deploy/otel); the change's trace links the operator's
//! `reconcile` span, through its actors (ClusterActor, then the instance's
//! ReplicaActor), to the instance manager's span for the call it received (the trace
//! context travels in the instance API's `traceparent` header).

mod support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use support::cluster::{
    LocalVolumes, Operator, apply_cluster, describe, phase_and_ready, wait_for,
};
use support::otel::{Receiver, Span, spans};
use support::{TestNamespace, client};

const OPERATOR: &str = "127.0.64.1:8080";
const RECEIVER_PORT: u16 = 25400;

/// The chain from an instance manager's request span up to its trace's root, if that
/// chain is complete, crosses from the instance manager into the operator, and goes
/// through a `reconcile` (under kube-runtime's `reconciling object`).
fn cross_process_chain(spans: &[Span]) -> Option<Vec<Span>> {
    let by_id: HashMap<&str, &Span> = spans.iter().map(|s| (s.id.as_str(), s)).collect();
    for start in spans
        .iter()
        .filter(|s| s.service == "castellan-instance" && s.name == "instance api request")
    {
        let mut chain = vec![start.clone()];
        let mut current = start;
        while !current.parent.is_empty() {
            let Some(parent) = by_id.get(current.parent.as_str()) else {
                break;
            };
            assert_eq!(parent.trace, start.trace, "a parent in another trace");
            chain.push((*parent).clone());
            current = parent;
        }
        let from_a_reconcile = chain.iter().any(|s| s.name == "reconcile");
        if current.parent.is_empty() && from_a_reconcile {
            return Some(chain);
        }
    }
    None
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cluster_creation_is_one_trace_across_operator_and_instance() {
    let receiver = Receiver::start(RECEIVER_PORT);
    let client = client().await;
    let namespace = TestNamespace::create(&client, "trace").await;
    let ns = namespace.name.clone();
    let volumes = LocalVolumes::create("trace-local", 1);
    let endpoint = format!("http://127.0.0.1:{RECEIVER_PORT}");
    let operator = Operator::start_with_env(
        &ns,
        OPERATOR,
        &[],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_BSP_SCHEDULE_DELAY", "200"),
        ],
    );
    let logs = vec![operator.log.clone()];
    apply_cluster(&ns, "traced", 1, &volumes.class, "");
    wait_for(
        "the cluster is Ready",
        Duration::from_secs(180),
        || phase_and_ready(&ns, "traced") == "Ready/1",
        || describe(&ns, &logs),
    );

    // Status shows the instance's LSN once the instance's actor has read it, so the
    // cluster's actor knows the parameters the instance runs with.
    wait_for(
        "status shows the instance's LSN",
        Duration::from_secs(60),
        || {
            !support::cluster::jsonpath("dbc", "traced", &ns, "{.status.instances[0].lsn}")
                .is_empty()
        },
        || describe(&ns, &logs),
    );
    // A spec change: reconcile hands it to the cluster's actor, which has each
    // instance's actor reload it at once, within the same trace. At once only if the
    // instance is not waiting for a fresh view after a command (its first reload, a
    // moment after it became ready, can still be settling): then the next poll sends
    // it, in the poll's trace. So the change is made again, with another value, every
    // 5 s until one reload runs under its reconcile.
    let patch = |work_mem: u32| {
        support::kubectl_ok(&[
            "patch",
            "dbc",
            "traced",
            "-n",
            &ns,
            "--type",
            "merge",
            "-p",
            &format!(r#"{{"spec":{{"parameters":{{"work_mem":"{work_mem}MB"}}}}}}"#),
        ]);
    };
    let mut work_mem = 8;
    patch(work_mem);
    let mut patched = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(60);
    let chain = loop {
        let found = spans(&receiver.traces());
        if let Some(chain) = cross_process_chain(&found) {
            break chain;
        }
        assert!(
            Instant::now() < deadline,
            "no instance span linked to an operator reconcile within 60 s; {} spans from {:?}",
            found.len(),
            found
                .iter()
                .map(|s| (s.service.as_str(), s.name.as_str()))
                .collect::<std::collections::BTreeSet<_>>()
        );
        if patched.elapsed() > Duration::from_secs(5) {
            work_mem += 1;
            patch(work_mem);
            patched = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let names: Vec<String> = chain
        .iter()
        .map(|s| format!("{}: {}", s.service, s.name))
        .collect();
    println!("trace across processes (child → root): {names:#?}");
    // The instance manager's span hangs under the operator's call, which runs inside
    // an actor event, under the reconcile that started it all.
    assert_eq!(chain[1].service, "castellan-operator", "{names:#?}");
    assert_eq!(chain[1].name, "instance api call", "{names:#?}");
    assert!(
        chain.iter().filter(|s| s.name == "actor event").count() >= 2,
        "the path goes through the cluster's and the instance's actors: {names:#?}"
    );
    let root = chain.last().expect("a chain has a root");
    assert_eq!(root.service, "castellan-operator", "{names:#?}");
    drop(operator);
    drop(volumes);
}

//! `BackupSchedule` end to end on the local cluster, with kubectl as a user would: a
//! `* * * * *` schedule makes a Backup at the next minute, named for its slot and
//! labelled, and skips the following slot while that Backup is still pending;
//! `immediate` makes one at once; a suspended schedule makes none for a full minute;
//! an invalid cron or time zone is `Ready=False InvalidSchedule` with the reason;
//! retention (`keepLast: 2`) deletes the older Completed Backups and keeps the newest
//! and the unfinished ones; an operator that was down for several slots makes exactly
//! one catch-up Backup when it is back.
//!
//! No DatabaseCluster is needed: the schedule only makes `Backup` objects. Their
//! cluster does not exist, so the Backup controller (in the same operator) keeps them
//! `Pending`; the test completes them itself through the status subresource, as the
//! Backup controller would (`Completed` is final for it).

mod support;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use support::cluster::{Operator, events, jsonpath, wait_for};
use support::{TestNamespace, client, kubectl, kubectl_ok};

/// Where each test's operator serves its endpoints (and its identity in the Lease, and
/// its log's name); the tests of this file run at once, so each has its own, and no
/// other test uses these.
const OPERATOR: &str = "127.0.68.1:8080";
const RETENTION_OPERATOR: &str = "127.0.68.2:8080";
const CATCH_UP_OPERATOR: &str = "127.0.68.3:8080";

/// `kubectl apply`s a BackupSchedule of cluster `orders`; `extra` is more YAML under
/// `spec:` (two-space indented lines).
fn apply_schedule(namespace: &str, name: &str, schedule: &str, extra: &str) {
    let manifest = std::env::temp_dir().join(format!("{namespace}-{name}.yaml"));
    std::fs::write(
        &manifest,
        format!(
            "apiVersion: castellan.io/v1alpha1\nkind: BackupSchedule\nmetadata: {{name: {name}}}\n\
             spec:\n  cluster: orders\n  schedule: \"{schedule}\"\n{extra}"
        ),
    )
    .expect("writing the manifest");
    kubectl_ok(&[
        "apply",
        "-n",
        namespace,
        "-f",
        manifest.to_str().expect("utf-8 path"),
    ]);
}

/// Names of the Backups labelled with `schedule`'s name, oldest first.
fn backups_of(namespace: &str, schedule: &str) -> Vec<String> {
    let out = kubectl_ok(&[
        "get",
        "backups",
        "-n",
        namespace,
        "-l",
        &format!("castellan.io/schedule={schedule}"),
        "--sort-by=.metadata.name",
        "-o",
        "jsonpath={range .items[*]}{.metadata.name}{\"\\n\"}{end}",
    ]);
    out.lines().map(str::to_owned).collect()
}

/// `status/reason` of the schedule's `Ready` condition.
fn ready(namespace: &str, schedule: &str) -> String {
    jsonpath(
        "backupschedule",
        schedule,
        namespace,
        "{.status.conditions[?(@.type==\"Ready\")].status}/{.status.conditions[?(@.type==\"Ready\")].reason}",
    )
}

fn ready_message(namespace: &str, schedule: &str) -> String {
    jsonpath(
        "backupschedule",
        schedule,
        namespace,
        "{.status.conditions[?(@.type==\"Ready\")].message}",
    )
}

/// Sets a Backup's phase (and, for a finished one, `stoppedAt`) as the Backup
/// controller would, through the status subresource, until it holds: a pass of the
/// Backup controller that read the object just before may write `Pending` over it
/// once.
fn set_phase(namespace: &str, backup: &str, phase: &str) {
    for _ in 0..5 {
        patch_phase(namespace, backup, phase);
        std::thread::sleep(Duration::from_millis(1500));
        if jsonpath("backup", backup, namespace, "{.status.phase}") == phase {
            return;
        }
    }
    panic!("{backup} does not stay {phase}");
}

fn patch_phase(namespace: &str, backup: &str, phase: &str) {
    let status = if phase == "Completed" || phase == "Failed" {
        format!(
            "{{\"status\":{{\"phase\":\"{phase}\",\"stoppedAt\":\"{}\"}}}}",
            utc_now()
        )
    } else {
        format!("{{\"status\":{{\"phase\":\"{phase}\"}}}}")
    };
    kubectl_ok(&[
        "patch",
        "backup",
        backup,
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        &status,
    ]);
}

/// Creates a Backup by hand, labelled as one of `schedule`'s (as a predecessor of the
/// same name left it).
fn create_labelled_backup(namespace: &str, name: &str, schedule: &str) {
    let manifest = std::env::temp_dir().join(format!("{namespace}-{name}.yaml"));
    std::fs::write(
        &manifest,
        format!(
            "apiVersion: castellan.io/v1alpha1\nkind: Backup\nmetadata:\n  name: {name}\n  \
             labels: {{castellan.io/schedule: {schedule}, castellan.io/cluster: orders}}\n\
             spec: {{cluster: orders}}\n"
        ),
    )
    .expect("writing the manifest");
    kubectl_ok(&[
        "create",
        "-n",
        namespace,
        "-f",
        manifest.to_str().expect("utf-8 path"),
    ]);
}

fn utc_now() -> String {
    let out = std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%dT%H:%M:%SZ"])
        .output()
        .expect("running date");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// The second of the current UTC minute.
fn utc_second() -> u32 {
    let now = utc_now();
    now[17..19].parse().expect("seconds of date's output")
}

/// `2026-03-01T10:07:00Z` → `20260301100700`, the suffix of the Backup for that slot.
/// The slot a schedule's status records, once it records one: the Backup appears a
/// moment before the status write that names its slot.
fn recorded_slot(namespace: &str, schedule: &str, diagnostics: &impl Fn() -> String) -> String {
    let slot = || {
        jsonpath(
            "backupschedule",
            schedule,
            namespace,
            "{.status.lastScheduleTime}",
        )
    };
    wait_for(
        &format!("the schedule {schedule} records its slot"),
        Duration::from_secs(10),
        || !slot().is_empty(),
        diagnostics,
    );
    slot()
}

fn name_suffix(time: &str) -> String {
    time.chars().filter(char::is_ascii_digit).collect()
}

fn describe(namespace: &str, logs: &[PathBuf]) -> String {
    format!(
        "{}\n{}\n{}\n----\n{}",
        String::from_utf8_lossy(
            &kubectl(&[
                "get",
                "backupschedules,backups",
                "-n",
                namespace,
                "-o",
                "wide"
            ])
            .stdout
        ),
        String::from_utf8_lossy(
            &kubectl(&["get", "backupschedules", "-n", namespace, "-o", "yaml"]).stdout
        ),
        String::from_utf8_lossy(&kubectl(&["get", "events", "-n", namespace]).stdout),
        Operator::logs(logs)
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn schedules_fire_on_their_slots_skip_suspend_and_report_invalid_input() {
    let client = client().await;
    let namespace = TestNamespace::create(&client, "schedule").await;
    let ns = namespace.name.clone();
    let operator = Operator::start(&ns, OPERATOR);
    let logs = vec![operator.log.clone()];
    let diagnostics = || describe(&ns, &logs);
    let started = Instant::now();

    apply_schedule(&ns, "every-minute", "* * * * *", "");
    apply_schedule(&ns, "at-once", "0 3 * * *", "  immediate: true\n");
    apply_schedule(
        &ns,
        "paused",
        "* * * * *",
        "  suspend: true\n  immediate: true\n",
    );
    apply_schedule(&ns, "bad-cron", "61 * * * *", "");
    apply_schedule(
        &ns,
        "bad-zone",
        "0 3 * * *",
        "  timeZone: Mars/Olympus_Mons\n",
    );

    // Invalid input is a condition with the parser's reason, and a Warning.
    wait_for(
        "the invalid cron and time zone are Ready=False InvalidSchedule",
        Duration::from_secs(30),
        || {
            ready(&ns, "bad-cron") == "False/InvalidSchedule"
                && ready(&ns, "bad-zone") == "False/InvalidSchedule"
        },
        diagnostics,
    );
    let cron_message = ready_message(&ns, "bad-cron");
    assert!(
        cron_message.contains("\"61 * * * *\"") && cron_message.contains("five-field"),
        "{cron_message}"
    );
    let zone_message = ready_message(&ns, "bad-zone");
    assert!(
        zone_message.contains("timeZone \"Mars/Olympus_Mons\""),
        "{zone_message}"
    );
    assert!(
        events(&ns, "InvalidSchedule").contains("61 * * * *"),
        "a Warning Event names the bad cron\n{}",
        diagnostics()
    );
    assert!(backups_of(&ns, "bad-cron").is_empty() && backups_of(&ns, "bad-zone").is_empty());
    println!(
        "invalid input reported after {:.1} s",
        started.elapsed().as_secs_f64()
    );

    // immediate: one Backup at once, named for the second it was made.
    wait_for(
        "the immediate schedule makes a Backup",
        Duration::from_secs(20),
        || backups_of(&ns, "at-once").len() == 1,
        diagnostics,
    );
    let at_once = backups_of(&ns, "at-once").remove(0);
    let last = recorded_slot(&ns, "at-once", &diagnostics);
    assert_eq!(at_once, format!("at-once-{}", name_suffix(&last)));
    let next = jsonpath(
        "backupschedule",
        "at-once",
        &ns,
        "{.status.nextScheduleTime}",
    );
    assert!(
        next.ends_with("T03:00:00Z"),
        "the next slot is 03:00 UTC: {next}"
    );
    assert_eq!(
        jsonpath(
            "backup",
            &at_once,
            &ns,
            "{.spec.cluster} {.metadata.labels.castellan\\.io/cluster}"
        ),
        "orders orders"
    );
    assert_eq!(
        jsonpath("backup", &at_once, &ns, "{.metadata.ownerReferences}"),
        "",
        "a Backup outlives its schedule"
    );
    assert_eq!(
        jsonpath(
            "backup",
            &at_once,
            &ns,
            "{.metadata.annotations.castellan\\.io/schedule-uid}"
        ),
        jsonpath("backupschedule", "at-once", &ns, "{.metadata.uid}"),
        "the Backup names the schedule that made it"
    );
    println!(
        "immediate Backup after {:.1} s",
        started.elapsed().as_secs_f64()
    );

    // * * * * *: one Backup at the next minute, named for that slot.
    wait_for(
        "the every-minute schedule makes a Backup within 70 s",
        Duration::from_secs(70).saturating_sub(started.elapsed()),
        || !backups_of(&ns, "every-minute").is_empty(),
        diagnostics,
    );
    let first = backups_of(&ns, "every-minute");
    assert_eq!(first.len(), 1, "{first:?}");
    let first = first[0].clone();
    let slot = recorded_slot(&ns, "every-minute", &diagnostics);
    assert!(slot.ends_with(":00Z"), "a minute's slot: {slot}");
    assert_eq!(first, format!("every-minute-{}", name_suffix(&slot)));
    let next = jsonpath(
        "backupschedule",
        "every-minute",
        &ns,
        "{.status.nextScheduleTime}",
    );
    assert!(
        next > slot && next.ends_with(":00Z"),
        "next {next} after {slot}"
    );
    assert_eq!(ready(&ns, "every-minute"), "True/Scheduled");
    assert_eq!(
        jsonpath(
            "backup",
            &first,
            &ns,
            "{.metadata.labels.castellan\\.io/schedule}"
        ),
        "every-minute"
    );
    println!(
        "first scheduled Backup ({first}) after {:.1} s",
        started.elapsed().as_secs_f64()
    );

    // While it is still Pending (its cluster does not exist), the next slot is
    // skipped, with a Warning.
    wait_for(
        "the next slot is skipped while the first Backup is pending",
        Duration::from_secs(75),
        || events(&ns, "BackupSkipped").contains(&first),
        diagnostics,
    );
    assert_eq!(
        backups_of(&ns, "every-minute"),
        std::slice::from_ref(&first),
        "no second Backup"
    );
    assert_eq!(
        jsonpath(
            "backupschedule",
            "every-minute",
            &ns,
            "{.status.activeBackups[0]}"
        ),
        first
    );
    println!(
        "slot skipped after {:.1} s",
        started.elapsed().as_secs_f64()
    );

    // A suspended schedule made nothing over a full minute (and immediate does not
    // override suspend).
    assert!(started.elapsed() > Duration::from_secs(60));
    assert!(backups_of(&ns, "paused").is_empty(), "{}", diagnostics());
    assert_eq!(ready(&ns, "paused"), "True/Suspended");
    assert_eq!(
        jsonpath(
            "backupschedule",
            "paused",
            &ns,
            "{.status.nextScheduleTime}"
        ),
        ""
    );
    drop(operator);
}

#[tokio::test(flavor = "multi_thread")]
async fn retention_deletes_older_completed_backups_and_keeps_the_newest() {
    let client = client().await;
    let namespace = TestNamespace::create(&client, "retention").await;
    let ns = namespace.name.clone();
    // Backups left by an earlier schedule of the same name (a schedule finds its
    // Backups by label), all completed.
    let seeded = [
        "keep-20200101000000",
        "keep-20200102000000",
        "keep-20200103000000",
    ];
    for name in seeded {
        create_labelled_backup(&ns, name, "keep");
        set_phase(&ns, name, "Completed");
    }

    let operator = Operator::start(&ns, RETENTION_OPERATOR);
    let logs = vec![operator.log.clone()];
    let diagnostics = || describe(&ns, &logs);
    let started = Instant::now();
    apply_schedule(
        &ns,
        "keep",
        "0 3 * * *",
        "  immediate: true\n  retention: {keepLast: 2}\n",
    );

    // keepLast 2 of three Completed: the oldest goes at once; the immediate Backup is
    // made beside them.
    wait_for(
        "retention deletes the oldest Completed Backup and the immediate one is made",
        Duration::from_secs(30),
        || {
            let names = backups_of(&ns, "keep");
            !names.iter().any(|n| n == seeded[0]) && names.len() == 3
        },
        diagnostics,
    );
    let made: Vec<String> = backups_of(&ns, "keep")
        .into_iter()
        .filter(|name| !seeded.contains(&name.as_str()))
        .collect();
    assert_eq!(
        made.len(),
        1,
        "one immediate Backup: {made:?}\n{}",
        diagnostics()
    );
    let newest = made[0].clone();
    println!(
        "oldest pruned after {:.1} s",
        started.elapsed().as_secs_f64()
    );

    // An unfinished Backup, older than all of them, is never deleted (it stays
    // Pending: its cluster does not exist).
    create_labelled_backup(&ns, "keep-20191231000000", "keep");
    // The schedule's own Backup completes: it and the newest earlier one are the two
    // kept.
    set_phase(&ns, &newest, "Completed");
    let expected = vec![
        "keep-20191231000000".to_owned(),
        seeded[2].to_owned(),
        newest.clone(),
    ];
    wait_for(
        "retention keeps the 2 newest Completed and the pending Backup",
        Duration::from_secs(30),
        || backups_of(&ns, "keep") == expected,
        diagnostics,
    );
    wait_for(
        "the status names the newest Completed and the pending Backup",
        Duration::from_secs(10),
        || {
            jsonpath(
                "backupschedule",
                "keep",
                &ns,
                "{.status.lastSuccessfulBackup} {.status.activeBackups[*]}",
            ) == format!("{newest} keep-20191231000000")
        },
        diagnostics,
    );
    assert!(
        events(&ns, "BackupPruned").contains(seeded[1]),
        "{}",
        diagnostics()
    );
    // Settled: looking again deletes nothing more.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(backups_of(&ns, "keep"), expected);
    println!(
        "retention settled after {:.1} s",
        started.elapsed().as_secs_f64()
    );
    drop(operator);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_operator_that_was_down_for_several_slots_makes_exactly_one_catch_up_backup() {
    let client = client().await;
    let namespace = TestNamespace::create(&client, "catchup").await;
    let ns = namespace.name.clone();
    // The first operator must be stopped before its first regular slot (the next whole
    // minute), or it makes that slot's Backup itself and the catch-up for the same slot
    // is already done: start early in a minute, leaving the first part most of it.
    while !(1..=25).contains(&utc_second()) {
        std::thread::sleep(Duration::from_millis(500));
    }
    let operator = Operator::start(&ns, CATCH_UP_OPERATOR);
    let mut logs = vec![operator.log.clone()];
    let started = Instant::now();
    apply_schedule(&ns, "frequent", "* * * * *", "  immediate: true\n");
    wait_for(
        "the immediate Backup",
        Duration::from_secs(20),
        || backups_of(&ns, "frequent").len() == 1,
        || describe(&ns, &logs),
    );
    let first = backups_of(&ns, "frequent").remove(0);
    set_phase(&ns, &first, "Completed");
    wait_for(
        "the schedule has seen its Backup complete",
        Duration::from_secs(10),
        || {
            jsonpath(
                "backupschedule",
                "frequent",
                &ns,
                "{.status.lastSuccessfulBackup}",
            ) == first
        },
        || describe(&ns, &logs),
    );
    operator.terminate();
    assert_eq!(
        backups_of(&ns, "frequent"),
        vec![first.clone()],
        "the first operator was stopped before its first regular slot\n{}",
        describe(&ns, &logs)
    );

    // The operator "was down" for ten slots: its record of the first slot not handled
    // yet is ten minutes old (waiting ten real minutes would show the same).
    let ten_minutes_ago = {
        let out = std::process::Command::new("date")
            .args(["-u", "-d", "10 minutes ago", "+%Y-%m-%dT%H:%M:00Z"])
            .output()
            .expect("running date");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    kubectl_ok(&[
        "patch",
        "backupschedule",
        "frequent",
        "-n",
        &ns,
        "--subresource=status",
        "--type=merge",
        "-p",
        &format!("{{\"status\":{{\"nextScheduleTime\":\"{ten_minutes_ago}\"}}}}"),
    ]);

    let operator = Operator::start(&ns, CATCH_UP_OPERATOR);
    logs.push(operator.log.clone());
    let diagnostics = || describe(&ns, &logs);
    wait_for(
        "a catch-up Backup",
        Duration::from_secs(30),
        || backups_of(&ns, "frequent").len() >= 2,
        diagnostics,
    );
    // Give it time to (wrongly) make more. The catch-up Backup stays Pending (no
    // Backup controller acts on it here), so a minute boundary in these seconds makes
    // no Backup either: that slot is skipped.
    std::thread::sleep(Duration::from_secs(5));
    let backups = backups_of(&ns, "frequent");
    let caught_up: Vec<&String> = backups.iter().filter(|name| **name != first).collect();
    assert_eq!(
        caught_up.len(),
        1,
        "exactly one catch-up for the ten missed slots: {backups:?}\n{}",
        diagnostics()
    );
    let slot = jsonpath(
        "backupschedule",
        "frequent",
        &ns,
        "{.status.lastScheduleTime}",
    );
    assert_eq!(
        *caught_up[0],
        format!("frequent-{}", name_suffix(&slot)),
        "named for its slot"
    );
    assert!(
        caught_up[0].as_str() > format!("frequent-{}", name_suffix(&ten_minutes_ago)).as_str(),
        "for the latest missed slot, not the first: {caught_up:?}"
    );
    let next = jsonpath(
        "backupschedule",
        "frequent",
        &ns,
        "{.status.nextScheduleTime}",
    );
    assert!(next > slot, "next {next} after {slot}");
    assert!(
        events(&ns, "BackupCreated").contains("catch-up"),
        "the Event says it is a catch-up\n{}",
        diagnostics()
    );
    println!("catch-up after {:.1} s", started.elapsed().as_secs_f64());
    drop(operator);
}

//! The instance manager's `/metrics` (plain HTTP, its own port; names in
//! docs/metrics.md): PostgreSQL's state read at scrape time over the manager's
//! connection pool — role, WAL positions, replication per standby, the archiver,
//! connections, transactions, database sizes, slots. A scrape is bounded by
//! [`SCRAPE_TIMEOUT`]; when PostgreSQL is down or slow it answers `castellan_pg_up 0`
//! instead of failing, so that an alert sees the server, not the exporter, as down.
//! Reading ([`read`]) and rendering ([`render`]) are apart so the rendering of rows
//! into metric families is tested without a server.

use std::borrow::Cow;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use sqlx::{PgConnection, PgPool, Row};

/// How long a scrape may wait for PostgreSQL (a connection and every query), below
/// Prometheus' default scrape timeout of 10 s.
pub const SCRAPE_TIMEOUT: Duration = Duration::from_secs(5);

/// What one scrape read from PostgreSQL.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Snapshot {
    pub in_recovery: bool,
    pub max_connections: i64,
    /// Primary: `pg_current_wal_lsn()` in bytes.
    pub current_wal_lsn: Option<f64>,
    /// Replica: received and replayed positions, in bytes.
    pub receive_lsn: Option<f64>,
    pub replay_lsn: Option<f64>,
    /// Replica: age of the last replayed transaction, 0 when caught up.
    pub lag_seconds: Option<f64>,
    pub wal_receiver_up: bool,
    pub standbys: Vec<StandbyRow>,
    pub archiver: ArchiverRow,
    pub connections: Vec<ConnectionsRow>,
    pub databases: Vec<DatabaseRow>,
    pub slots: Vec<SlotRow>,
}

/// One row of `pg_stat_replication`, differences from the primary's position in bytes.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct StandbyRow {
    pub name: String,
    pub synchronous: bool,
    pub sent_diff: Option<f64>,
    pub write_diff: Option<f64>,
    pub flush_diff: Option<f64>,
    pub replay_diff: Option<f64>,
    pub write_lag: Option<f64>,
    pub flush_lag: Option<f64>,
    pub replay_lag: Option<f64>,
}

#[derive(Debug, Default, Clone, PartialEq)]
pub struct ArchiverRow {
    pub archived: i64,
    pub failed: i64,
    pub last_archived: Option<f64>,
    pub last_failed: Option<f64>,
}

#[derive(Debug, Default, Clone, PartialEq)]
pub struct ConnectionsRow {
    pub database: String,
    pub state: String,
    pub count: i64,
}

#[derive(Debug, Default, Clone, PartialEq)]
pub struct DatabaseRow {
    pub name: String,
    pub commits: i64,
    pub rollbacks: i64,
    pub size_bytes: i64,
}

#[derive(Debug, Default, Clone, PartialEq)]
pub struct SlotRow {
    pub name: String,
    pub active: bool,
    pub retained_bytes: Option<f64>,
}

/// The exposition of one scrape of the instance of `cluster`.
pub async fn scrape(pool: &PgPool, cluster: &str) -> String {
    let started = Instant::now();
    let snapshot = match tokio::time::timeout(SCRAPE_TIMEOUT, read(pool)).await {
        Ok(Ok(snapshot)) => Some(snapshot),
        Ok(Err(error)) => {
            tracing::debug!(%error, "reading PostgreSQL's metrics");
            None
        }
        Err(_) => {
            tracing::warn!(timeout = ?SCRAPE_TIMEOUT, "PostgreSQL's metrics took too long; answering castellan_pg_up 0");
            None
        }
    };
    let registry = render(cluster, snapshot.as_ref(), started.elapsed());
    crate::exposition::encode(&[&registry])
}

/// Reads everything on one connection of the pool, so that a scrape holds at most one
/// of the manager's few connections.
pub async fn read(pool: &PgPool) -> Result<Snapshot, sqlx::Error> {
    let mut connection = pool.acquire().await?;
    let connection: &mut PgConnection = &mut connection;
    let row = sqlx::query(
        "select pg_is_in_recovery() as in_recovery,
                current_setting('max_connections')::bigint as max_connections",
    )
    .fetch_one(&mut *connection)
    .await?;
    let mut snapshot = Snapshot {
        in_recovery: row.try_get("in_recovery")?,
        max_connections: row.try_get("max_connections")?,
        ..Snapshot::default()
    };
    if snapshot.in_recovery {
        let row = sqlx::query(
            "select pg_wal_lsn_diff(pg_last_wal_receive_lsn(), '0/0')::float8 as receive,
                    pg_wal_lsn_diff(pg_last_wal_replay_lsn(), '0/0')::float8 as replay,
                    (case when pg_last_wal_receive_lsn() is not distinct from pg_last_wal_replay_lsn()
                          then 0
                          else extract(epoch from clock_timestamp() - pg_last_xact_replay_timestamp())
                     end)::float8 as lag_seconds,
                    exists(select 1 from pg_stat_wal_receiver where status = 'streaming') as receiver_up",
        )
        .fetch_one(&mut *connection)
        .await?;
        snapshot.receive_lsn = row.try_get("receive")?;
        snapshot.replay_lsn = row.try_get("replay")?;
        snapshot.lag_seconds = row
            .try_get::<Option<f64>, _>("lag_seconds")?
            .map(|s| s.max(0.0));
        snapshot.wal_receiver_up = row.try_get("receiver_up")?;
    } else {
        snapshot.current_wal_lsn =
            sqlx::query_scalar("select pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::float8")
                .fetch_one(&mut *connection)
                .await?;
        snapshot.standbys = sqlx::query(
            "select coalesce(application_name, '') as name,
                    sync_state in ('sync', 'quorum') as synchronous,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), sent_lsn)::float8 as sent,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), write_lsn)::float8 as write,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), flush_lsn)::float8 as flush,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), replay_lsn)::float8 as replay,
                    extract(epoch from write_lag)::float8 as write_lag,
                    extract(epoch from flush_lag)::float8 as flush_lag,
                    extract(epoch from replay_lag)::float8 as replay_lag
               from pg_stat_replication order by application_name",
        )
        .fetch_all(&mut *connection)
        .await?
        .iter()
        .map(|row| {
            Ok(StandbyRow {
                name: row.try_get("name")?,
                synchronous: row
                    .try_get::<Option<bool>, _>("synchronous")?
                    .unwrap_or(false),
                sent_diff: row.try_get("sent")?,
                write_diff: row.try_get("write")?,
                flush_diff: row.try_get("flush")?,
                replay_diff: row.try_get("replay")?,
                write_lag: row.try_get("write_lag")?,
                flush_lag: row.try_get("flush_lag")?,
                replay_lag: row.try_get("replay_lag")?,
            })
        })
        .collect::<Result<_, sqlx::Error>>()?;
    }
    let row = sqlx::query(
        "select archived_count, failed_count,
                extract(epoch from last_archived_time)::float8 as last_archived,
                extract(epoch from last_failed_time)::float8 as last_failed
           from pg_stat_archiver",
    )
    .fetch_one(&mut *connection)
    .await?;
    snapshot.archiver = ArchiverRow {
        archived: row.try_get("archived_count")?,
        failed: row.try_get("failed_count")?,
        last_archived: row.try_get("last_archived")?,
        last_failed: row.try_get("last_failed")?,
    };
    snapshot.connections = sqlx::query(
        "select coalesce(datname, '') as datname, coalesce(state, 'unknown') as state,
                count(*) as count
           from pg_stat_activity where backend_type = 'client backend'
          group by 1, 2 order by 1, 2",
    )
    .fetch_all(&mut *connection)
    .await?
    .iter()
    .map(|row| {
        Ok(ConnectionsRow {
            database: row.try_get("datname")?,
            state: row.try_get("state")?,
            count: row.try_get("count")?,
        })
    })
    .collect::<Result<_, sqlx::Error>>()?;
    snapshot.databases = sqlx::query(
        "select d.datname::text as datname, s.xact_commit, s.xact_rollback,
                pg_database_size(d.oid) as size
           from pg_database d join pg_stat_database s on s.datid = d.oid
          where not d.datistemplate order by 1",
    )
    .fetch_all(&mut *connection)
    .await?
    .iter()
    .map(|row| {
        Ok(DatabaseRow {
            name: row.try_get("datname")?,
            commits: row.try_get("xact_commit")?,
            rollbacks: row.try_get("xact_rollback")?,
            size_bytes: row.try_get("size")?,
        })
    })
    .collect::<Result<_, sqlx::Error>>()?;
    // On a replica the slots' WAL is measured from what it received (it has no write
    // position); CASE evaluates only the branch taken.
    snapshot.slots = sqlx::query(
        "select slot_name::text as name, active,
                (case when pg_is_in_recovery()
                      then pg_wal_lsn_diff(pg_last_wal_receive_lsn(), restart_lsn)
                      else pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)
                 end)::float8 as retained
           from pg_replication_slots order by 1",
    )
    .fetch_all(&mut *connection)
    .await?
    .iter()
    .map(|row| {
        Ok(SlotRow {
            name: row.try_get("name")?,
            active: row.try_get("active")?,
            retained_bytes: row.try_get("retained")?,
        })
    })
    .collect::<Result<_, sqlx::Error>>()?;
    Ok(snapshot)
}

type FloatGauge = Gauge<f64, AtomicU64>;
type Labels = Vec<(&'static str, String)>;

/// Registers into one registry with the `cluster` label on every series.
struct Metrics(Registry);

impl Metrics {
    fn gauge(&mut self, name: &str, help: &str, value: f64) {
        let gauge = FloatGauge::default();
        gauge.set(value);
        self.0.register(name, help, gauge);
    }

    fn optional_gauge(&mut self, name: &str, help: &str, value: Option<f64>) {
        if let Some(value) = value {
            self.gauge(name, help, value);
        }
    }

    /// `name` without `_total`: prometheus-client appends it.
    fn counter(&mut self, name: &str, help: &str, value: i64) {
        let counter: Counter = Counter::default();
        counter.inc_by(u64::try_from(value).unwrap_or(0));
        self.0.register(name, help, counter);
    }

    /// A gauge family with one series per `(labels, value)` (prometheus-client writes
    /// nothing of an empty one, not even its help).
    fn gauges(&mut self, name: &str, help: &str, series: impl IntoIterator<Item = (Labels, f64)>) {
        let family = Family::<Labels, FloatGauge>::default();
        for (labels, value) in series {
            family.get_or_create(&labels).set(value);
        }
        self.0.register(name, help, family);
    }

    fn counters(
        &mut self,
        name: &str,
        help: &str,
        series: impl IntoIterator<Item = (Labels, i64)>,
    ) {
        let family = Family::<Labels, Counter>::default();
        for (labels, value) in series {
            family
                .get_or_create(&labels)
                .inc_by(u64::try_from(value).unwrap_or(0));
        }
        self.0.register(name, help, family);
    }
}

fn flag(value: bool) -> f64 {
    if value { 1.0 } else { 0.0 }
}

/// The metric families of one scrape: `snapshot` is `None` when PostgreSQL could not
/// be read.
pub fn render(cluster: &str, snapshot: Option<&Snapshot>, took: Duration) -> Registry {
    let labels = [(Cow::Borrowed("cluster"), Cow::Owned(cluster.to_owned()))];
    let mut m = Metrics(Registry::with_labels(labels.into_iter()));
    m.gauge(
        "castellan_pg_up",
        "Whether PostgreSQL answered this scrape",
        flag(snapshot.is_some()),
    );
    m.gauge(
        "castellan_pg_scrape_duration_seconds",
        "How long reading PostgreSQL took",
        took.as_secs_f64(),
    );
    let Some(s) = snapshot else {
        return m.0;
    };
    m.gauges(
        "castellan_pg_role",
        "The role the server runs in: 1 for its role, 0 for the other",
        [
            (vec![("role", "primary".to_owned())], flag(!s.in_recovery)),
            (vec![("role", "replica".to_owned())], flag(s.in_recovery)),
        ],
    );
    m.gauge(
        "castellan_pg_replication_in_recovery",
        "Whether the server is in recovery (a replica)",
        flag(s.in_recovery),
    );
    m.gauge(
        "castellan_pg_settings_max_connections",
        "max_connections",
        s.max_connections as f64,
    );
    m.optional_gauge(
        "castellan_pg_current_wal_lsn_bytes",
        "Primary: the current WAL write position, in bytes",
        s.current_wal_lsn,
    );
    if s.in_recovery {
        m.optional_gauge(
            "castellan_pg_last_wal_receive_lsn_bytes",
            "Replica: WAL received and flushed, in bytes",
            s.receive_lsn,
        );
        m.optional_gauge(
            "castellan_pg_last_wal_replay_lsn_bytes",
            "Replica: WAL replayed, in bytes",
            s.replay_lsn,
        );
        m.optional_gauge(
            "castellan_pg_replication_lag_seconds",
            "Replica: age of the last replayed transaction, 0 when all received WAL is replayed",
            s.lag_seconds,
        );
        if let (Some(receive), Some(replay)) = (s.receive_lsn, s.replay_lsn) {
            m.gauge(
                "castellan_pg_replication_replay_lag_bytes",
                "Replica: WAL received but not yet replayed",
                (receive - replay).max(0.0),
            );
        }
        m.gauge(
            "castellan_pg_replication_is_wal_receiver_up",
            "Replica: whether its WAL receiver streams",
            flag(s.wal_receiver_up),
        );
    } else {
        m.gauge(
            "castellan_pg_replication_streaming_replicas",
            "Primary: standbys connected",
            s.standbys.len() as f64,
        );
    }
    let standby = |row: &StandbyRow| vec![("standby", row.name.clone())];
    let per_standby = |value: fn(&StandbyRow) -> Option<f64>| {
        s.standbys
            .iter()
            .filter_map(move |row| value(row).map(|v| (standby(row), v)))
            .collect::<Vec<_>>()
    };
    for (name, help, value) in [
        (
            "castellan_pg_stat_replication_sent_diff_bytes",
            "Primary: WAL not yet sent to the standby",
            (|r: &StandbyRow| r.sent_diff) as fn(&StandbyRow) -> Option<f64>,
        ),
        (
            "castellan_pg_stat_replication_write_diff_bytes",
            "Primary: WAL not yet written by the standby",
            |r| r.write_diff,
        ),
        (
            "castellan_pg_stat_replication_flush_diff_bytes",
            "Primary: WAL not yet flushed by the standby",
            |r| r.flush_diff,
        ),
        (
            "castellan_pg_stat_replication_replay_diff_bytes",
            "Primary: WAL not yet replayed by the standby",
            |r| r.replay_diff,
        ),
        (
            "castellan_pg_stat_replication_write_lag_seconds",
            "Primary: the standby's write_lag",
            |r| r.write_lag,
        ),
        (
            "castellan_pg_stat_replication_flush_lag_seconds",
            "Primary: the standby's flush_lag",
            |r| r.flush_lag,
        ),
        (
            "castellan_pg_stat_replication_replay_lag_seconds",
            "Primary: the standby's replay_lag",
            |r| r.replay_lag,
        ),
        (
            "castellan_pg_stat_replication_synchronous",
            "Primary: whether the standby counts for synchronous commit",
            |r| Some(flag(r.synchronous)),
        ),
    ] {
        m.gauges(name, help, per_standby(value));
    }
    m.counter(
        "castellan_pg_stat_archiver_archived",
        "WAL files archived",
        s.archiver.archived,
    );
    m.counter(
        "castellan_pg_stat_archiver_failed",
        "Failed attempts to archive WAL files",
        s.archiver.failed,
    );
    m.optional_gauge(
        "castellan_pg_stat_archiver_last_archived_timestamp_seconds",
        "When the last WAL file was archived (Unix time)",
        s.archiver.last_archived,
    );
    m.optional_gauge(
        "castellan_pg_stat_archiver_last_failed_timestamp_seconds",
        "When archiving last failed (Unix time)",
        s.archiver.last_failed,
    );
    m.gauges(
        "castellan_pg_stat_activity_count",
        "Client backends by database and state",
        s.connections.iter().map(|row| {
            (
                vec![
                    ("datname", row.database.clone()),
                    ("state", row.state.clone()),
                ],
                row.count as f64,
            )
        }),
    );
    let database = |row: &DatabaseRow| vec![("datname", row.name.clone())];
    m.counters(
        "castellan_pg_stat_database_xact_commit",
        "Transactions committed",
        s.databases.iter().map(|row| (database(row), row.commits)),
    );
    m.counters(
        "castellan_pg_stat_database_xact_rollback",
        "Transactions rolled back",
        s.databases.iter().map(|row| (database(row), row.rollbacks)),
    );
    m.gauges(
        "castellan_pg_database_size_bytes",
        "Size of each database",
        s.databases
            .iter()
            .map(|row| (database(row), row.size_bytes as f64)),
    );
    let slot = |row: &SlotRow| vec![("slot_name", row.name.clone())];
    m.gauges(
        "castellan_pg_replication_slots_active",
        "Whether a standby uses the slot",
        s.slots.iter().map(|row| (slot(row), flag(row.active))),
    );
    m.gauges(
        "castellan_pg_replication_slots_retained_bytes",
        "WAL the slot holds back",
        s.slots
            .iter()
            .filter_map(|row| row.retained_bytes.map(|b| (slot(row), b))),
    );
    m.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(snapshot: Option<&Snapshot>) -> String {
        crate::exposition::encode(&[&render("orders", snapshot, Duration::from_millis(20))])
    }

    #[test]
    fn a_server_that_does_not_answer_is_up_0_and_nothing_else() {
        let text = text(None);
        assert!(
            text.contains("castellan_pg_up{cluster=\"orders\"} 0.0\n"),
            "{text}"
        );
        assert!(text.contains("castellan_pg_scrape_duration_seconds{cluster=\"orders\"} 0.02"));
        assert_eq!(text.matches("# TYPE").count(), 2, "{text}");
    }

    #[test]
    fn a_primary_reports_its_standbys_archiver_databases_and_slots() {
        let snapshot = Snapshot {
            in_recovery: false,
            max_connections: 100,
            current_wal_lsn: Some(50_331_648.0),
            standbys: vec![StandbyRow {
                name: "orders-2".into(),
                synchronous: true,
                sent_diff: Some(0.0),
                replay_diff: Some(8192.0),
                replay_lag: None,
                ..StandbyRow::default()
            }],
            archiver: ArchiverRow {
                archived: 7,
                failed: 1,
                last_archived: Some(1_767_312_000.5),
                last_failed: None,
            },
            connections: vec![ConnectionsRow {
                database: "app".into(),
                state: "idle in transaction".into(),
                count: 3,
            }],
            databases: vec![DatabaseRow {
                name: "app".into(),
                commits: 42,
                rollbacks: 2,
                size_bytes: 7_000_000,
            }],
            slots: vec![SlotRow {
                name: "orders_2".into(),
                active: true,
                retained_bytes: Some(16384.0),
            }],
            ..Snapshot::default()
        };
        let text = text(Some(&snapshot));
        for line in [
            "castellan_pg_up{cluster=\"orders\"} 1.0\n",
            "castellan_pg_role{cluster=\"orders\",role=\"primary\"} 1.0\n",
            "castellan_pg_role{cluster=\"orders\",role=\"replica\"} 0.0\n",
            "castellan_pg_replication_in_recovery{cluster=\"orders\"} 0.0\n",
            "castellan_pg_current_wal_lsn_bytes{cluster=\"orders\"} 50331648.0\n",
            "castellan_pg_replication_streaming_replicas{cluster=\"orders\"} 1.0\n",
            "castellan_pg_stat_replication_replay_diff_bytes{cluster=\"orders\",standby=\"orders-2\"} 8192.0\n",
            "castellan_pg_stat_replication_synchronous{cluster=\"orders\",standby=\"orders-2\"} 1.0\n",
            "# TYPE castellan_pg_stat_archiver_archived counter\n",
            "castellan_pg_stat_archiver_archived_total{cluster=\"orders\"} 7\n",
            "castellan_pg_stat_archiver_failed_total{cluster=\"orders\"} 1\n",
            "castellan_pg_stat_archiver_last_archived_timestamp_seconds{cluster=\"orders\"} 1767312000.5\n",
            "castellan_pg_stat_activity_count{cluster=\"orders\",datname=\"app\",state=\"idle in transaction\"} 3.0\n",
            "castellan_pg_stat_database_xact_commit_total{cluster=\"orders\",datname=\"app\"} 42\n",
            "castellan_pg_stat_database_xact_rollback_total{cluster=\"orders\",datname=\"app\"} 2\n",
            "castellan_pg_database_size_bytes{cluster=\"orders\",datname=\"app\"} 7000000.0\n",
            "castellan_pg_replication_slots_active{cluster=\"orders\",slot_name=\"orders_2\"} 1.0\n",
            "castellan_pg_replication_slots_retained_bytes{cluster=\"orders\",slot_name=\"orders_2\"} 16384.0\n",
        ] {
            assert!(text.contains(line), "{line:?} missing from:\n{text}");
        }
        // What a standby has not reported, and a replica's figures, are absent.
        for absent in [
            "castellan_pg_stat_replication_replay_lag_seconds",
            "castellan_pg_stat_archiver_last_failed_timestamp_seconds",
            "castellan_pg_replication_lag_seconds",
            "castellan_pg_last_wal_replay_lsn_bytes",
        ] {
            assert!(!text.contains(absent), "{absent} in:\n{text}");
        }
    }

    #[test]
    fn a_replica_reports_its_positions_and_lag() {
        let snapshot = Snapshot {
            in_recovery: true,
            receive_lsn: Some(10_000.0),
            replay_lsn: Some(9_000.0),
            lag_seconds: Some(1.5),
            wal_receiver_up: true,
            ..Snapshot::default()
        };
        let text = text(Some(&snapshot));
        for line in [
            "castellan_pg_role{cluster=\"orders\",role=\"replica\"} 1.0\n",
            "castellan_pg_replication_in_recovery{cluster=\"orders\"} 1.0\n",
            "castellan_pg_last_wal_receive_lsn_bytes{cluster=\"orders\"} 10000.0\n",
            "castellan_pg_last_wal_replay_lsn_bytes{cluster=\"orders\"} 9000.0\n",
            "castellan_pg_replication_replay_lag_bytes{cluster=\"orders\"} 1000.0\n",
            "castellan_pg_replication_lag_seconds{cluster=\"orders\"} 1.5\n",
            "castellan_pg_replication_is_wal_receiver_up{cluster=\"orders\"} 1.0\n",
        ] {
            assert!(text.contains(line), "{line:?} missing from:\n{text}");
        }
        assert!(!text.contains("castellan_pg_replication_streaming_replicas"));
        // A replica has no standbys, slots or connections here: no empty families.
        assert!(!text.contains("castellan_pg_stat_replication_"), "{text}");
        assert!(!text.contains("castellan_pg_replication_slots_"), "{text}");
        assert!(!text.contains("castellan_pg_current_wal_lsn_bytes"));
    }
}

//! The PostgreSQL configuration Castellan owns, rendered from the instance's settings:
//! `castellan.conf` (included last from `postgresql.conf`, so it wins) and
//! `pg_hba.conf`. Pure functions; writing the files is `bootstrap`'s and
//! `postmaster`'s job.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

/// Name of the role replicas stream with.
pub const REPLICATION_USER: &str = "streaming_replica";

/// The role an instance plays, and for a replica where its primary is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    Primary,
    Replica(Upstream),
}

/// How a replica reaches its primary: through the cluster's `-rw` Service, not a pod
/// address, so that after a failover replicas follow the new primary without being
/// reconfigured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Upstream {
    pub host: String,
    pub port: u16,
    /// Replication slot on the primary this replica streams from.
    pub slot: String,
}

/// Everything `castellan.conf` depends on.
#[derive(Clone, Debug)]
pub struct Settings<'a> {
    pub cluster_name: &'a str,
    pub instance_name: &'a str,
    pub listen_address: &'a str,
    pub port: u16,
    pub socket_dir: &'a Path,
    pub role: &'a Role,
    /// Where the replication password is read from; it never appears in a file
    /// Castellan writes, only in the password file libpq reads (`passfile`).
    pub passfile: &'a Path,
    /// `synchronous_standby_names`, as the operator computed it (empty: asynchronous).
    pub synchronous_standby_names: &'a str,
    /// The user's parameters from the `DatabaseCluster` spec (reserved ones were
    /// refused at admission).
    pub parameters: &'a BTreeMap<String, String>,
    /// `max_slot_wal_keep_size`: the most WAL a slot may hold back, so that a standby
    /// that is gone can never fill the primary's volume (the operator derives it from
    /// the volume's size).
    pub max_slot_wal_keep_size: &'a str,
    /// `archive_command`: hands each completed WAL file to the instance manager.
    pub archive_command: &'a str,
    /// `restore_command`: the instance manager fetches a WAL file from the archive (a
    /// replica catching up past what its primary still has).
    pub restore_command: &'a str,
    /// While a restore replays its source's WAL: where to stop (the end of the archive
    /// without a target), after which the server promotes itself.
    pub recovery: Option<&'a RecoveryTarget>,
}

/// Where a restore's recovery stops: at most one of the two.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoveryTarget {
    pub time: Option<String>,
    pub lsn: Option<String>,
}

/// Quotes a value for postgresql.conf: single quotes, with `'` doubled.
fn quote(value: &str) -> String {
    format!("'{}'", value.replace('\\', "\\\\").replace('\'', "''"))
}

/// Quotes a value inside a libpq connection string.
fn conninfo_value(value: &str) -> String {
    format!("'{}'", value.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// Renders `castellan.conf`. The user's parameters come first and Castellan's own
/// after them, so that nothing the user sets can override what failover and
/// replication depend on, even if admission were bypassed.
pub fn render_castellan_conf(settings: &Settings<'_>) -> String {
    let mut conf = String::from(
        "# Written by castellan instance on every start and reload; edits are lost.\n",
    );
    for (name, value) in settings.parameters {
        let _ = writeln!(conf, "{name} = {}", quote(value));
    }
    let socket_dir = settings.socket_dir.to_string_lossy();
    let owned: [(&str, String); 18] = [
        ("listen_addresses", quote(settings.listen_address)),
        ("port", settings.port.to_string()),
        ("unix_socket_directories", quote(&socket_dir)),
        ("cluster_name", quote(settings.cluster_name)),
        ("wal_level", quote("replica")),
        ("hot_standby", quote("on")),
        ("max_wal_senders", "16".to_owned()),
        ("max_replication_slots", "16".to_owned()),
        // pg_rewind needs hint bits WAL-logged to rejoin a former primary (data
        // checksums, which initdb enables, imply it; this covers restored clusters).
        ("wal_log_hints", quote("on")),
        ("wal_keep_size", quote("128MB")),
        // Every instance archives (the manager skips what is already stored), so that a
        // promoted replica has archived everything it received: no gap after a
        // failover. With no object store the manager lets the files go.
        ("archive_mode", quote("always")),
        ("archive_command", quote(settings.archive_command)),
        // Answered "missing" at once while archiving is off, and within 5 s whatever
        // the object store does, so it never holds up streaming or a failover.
        ("restore_command", quote(settings.restore_command)),
        (
            "max_slot_wal_keep_size",
            quote(settings.max_slot_wal_keep_size),
        ),
        // A replica whose primary went away retries every second rather than every
        // five (the default), so that it follows a new primary within a second.
        ("wal_retrieve_retry_interval", quote("1s")),
        // A replica notices an upstream that stopped answering (a frozen process, a
        // partitioned node: its TCP connection stays open) within 5 s rather than 60,
        // and so follows a new primary; a primary drops such a standby within 10 s.
        ("wal_receiver_timeout", quote("5s")),
        ("wal_sender_timeout", quote("10s")),
        (
            "synchronous_standby_names",
            quote(settings.synchronous_standby_names),
        ),
    ];
    for (name, value) in owned {
        let _ = writeln!(conf, "{name} = {value}");
    }
    if let Role::Replica(upstream) = settings.role {
        // connect_timeout: a connection to a frozen primary (its kernel still accepts
        // TCP) would otherwise wait forever, before wal_receiver_timeout applies, and
        // the replica would never try the new primary behind -rw.
        let conninfo = format!(
            "host={} port={} user={} passfile={} application_name={} sslmode=disable \
             connect_timeout=5",
            conninfo_value(&upstream.host),
            upstream.port,
            REPLICATION_USER,
            conninfo_value(&settings.passfile.to_string_lossy()),
            conninfo_value(settings.instance_name),
        );
        let _ = writeln!(conf, "primary_conninfo = {}", quote(&conninfo));
        let _ = writeln!(conf, "primary_slot_name = {}", quote(&upstream.slot));
    }
    // For both roles: it needs a restart to change, so a promoted primary whose file
    // dropped it would report a pending restart for nothing.
    let _ = writeln!(conf, "recovery_target_timeline = 'latest'");
    if let Some(target) = settings.recovery {
        if let Some(time) = &target.time {
            let _ = writeln!(conf, "recovery_target_time = {}", quote(time));
        }
        if let Some(lsn) = &target.lsn {
            let _ = writeln!(conf, "recovery_target_lsn = {}", quote(lsn));
        }
        // Commits at exactly the target time are kept; then a new timeline begins.
        let _ = writeln!(conf, "recovery_target_action = 'promote'");
    }
    conf
}

/// Renders `pg_hba.conf`: the local socket (in a directory only the instance's user
/// can enter) is trusted; everything over TCP needs a SCRAM password; replication
/// only as the replication role.
pub fn render_pg_hba() -> String {
    format!(
        "# Written by castellan instance; edits are lost.\n\
         local all all trust\n\
         local replication all trust\n\
         host replication {REPLICATION_USER} 0.0.0.0/0 scram-sha-256\n\
         host replication {REPLICATION_USER} ::/0 scram-sha-256\n\
         host all all 0.0.0.0/0 scram-sha-256\n\
         host all all ::/0 scram-sha-256\n"
    )
}

/// The `.pgpass` file libpq reads when this instance connects to its primary: the
/// replication role for streaming and base backups, the superuser for `pg_rewind`.
pub fn render_passfile(superuser_password: &str, replication_password: &str) -> String {
    let escape = |password: &str| password.replace('\\', "\\\\").replace(':', "\\:");
    format!(
        "*:*:*:{REPLICATION_USER}:{}\n*:*:*:postgres:{}\n",
        escape(replication_password),
        escape(superuser_password)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::instance_api::slot_name;

    fn settings<'a>(role: &'a Role, parameters: &'a BTreeMap<String, String>) -> Settings<'a> {
        Settings {
            cluster_name: "orders",
            instance_name: "orders-2",
            listen_address: "127.1.0.7",
            port: 5432,
            socket_dir: Path::new("/var/run/pg"),
            role,
            passfile: Path::new("/data/.pgpass"),
            synchronous_standby_names: "ANY 1 (\"orders-1\", \"orders-3\")",
            parameters,
            max_slot_wal_keep_size: "256MB",
            archive_command: "'/bin/castellan' wal-archive --socket '/run/a.sock' %p",
            restore_command: "'/bin/castellan' wal-restore --socket '/run/a.sock' %f %p",
            recovery: None,
        }
    }

    #[test]
    fn primary_conf_has_no_upstream() {
        let parameters = BTreeMap::from([("max_connections".to_owned(), "200".to_owned())]);
        let conf = render_castellan_conf(&settings(&Role::Primary, &parameters));
        assert!(conf.contains("max_connections = '200'\n"));
        assert!(conf.contains("listen_addresses = '127.1.0.7'\n"));
        assert!(conf.contains("port = 5432\n"));
        assert!(
            conf.contains("synchronous_standby_names = 'ANY 1 (\"orders-1\", \"orders-3\")'\n")
        );
        assert!(!conf.contains("primary_conninfo"));
        assert!(conf.contains("max_slot_wal_keep_size = '256MB'\n"));
        assert!(conf.contains("archive_mode = 'always'\n"));
        assert!(conf.contains(
            "restore_command = '''/bin/castellan'' wal-restore --socket ''/run/a.sock'' %f %p'\n"
        ));
        assert!(conf.contains(
            "archive_command = '''/bin/castellan'' wal-archive --socket ''/run/a.sock'' %p'\n"
        ));
    }

    #[test]
    fn castellan_settings_come_after_the_users() {
        let parameters = BTreeMap::from([("wal_level".to_owned(), "minimal".to_owned())]);
        let conf = render_castellan_conf(&settings(&Role::Primary, &parameters));
        let user = conf
            .find("wal_level = 'minimal'")
            .expect("user value rendered");
        let ours = conf
            .find("wal_level = 'replica'")
            .expect("castellan value rendered");
        assert!(ours > user, "the last setting wins in postgresql.conf");
    }

    #[test]
    fn replica_conf_follows_the_service() {
        let role = Role::Replica(Upstream {
            host: "orders-rw.db.svc".to_owned(),
            port: 5432,
            slot: slot_name("orders-2"),
        });
        let conf = render_castellan_conf(&settings(&role, &BTreeMap::new()));
        assert!(conf.contains(
            "primary_conninfo = 'host=''orders-rw.db.svc'' port=5432 user=streaming_replica \
             passfile=''/data/.pgpass'' application_name=''orders-2'' sslmode=disable \
             connect_timeout=5'"
        ));
        assert!(conf.contains("primary_slot_name = 'castellan_orders_2'"));
        assert!(conf.contains("recovery_target_timeline = 'latest'"));
    }

    #[test]
    fn values_are_quoted() {
        assert_eq!(quote("it's"), "'it''s'");
        assert_eq!(quote("a\\b"), "'a\\\\b'");
        assert_eq!(conninfo_value("x'y"), "'x\\'y'");
    }

    #[test]
    fn passfile_escapes_separators() {
        assert_eq!(
            render_passfile("s", "a:b\\c"),
            "*:*:*:streaming_replica:a\\:b\\\\c\n*:*:*:postgres:s\n"
        );
    }

    #[test]
    fn hba_requires_passwords_over_tcp() {
        let hba = render_pg_hba();
        assert!(hba.contains("host all all 0.0.0.0/0 scram-sha-256"));
        assert!(!hba.contains("host all all 0.0.0.0/0 trust"));
    }
}

//! The PostgreSQL configuration Castellan owns, rendered from the instance's settings:
//! `castellan.conf` (included last from `postgresql.conf`, so it wins) and
//! `pg_hba.conf`. Pure functions; writing the files is `bootstrap`'s and
//! `postmaster`'s job.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use super::tls::{Files, Transport};
use crate::instance_api::Access;

/// Name of the role replicas stream with (their client certificate's common name).
pub const REPLICATION_USER: &str = crate::pki::REPLICATION_ROLE;

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
    /// The Service's address (or a name, outside a cluster).
    pub host: String,
    pub port: u16,
    /// Replication slot on the primary this replica streams from.
    pub slot: String,
    /// The name the primary's certificate is verified for (the `-rw` Service's), and
    /// the files to verify it with and to authenticate with, over TLS.
    pub tls: Option<UpstreamTls>,
}

/// How a replica reaches its primary over TLS.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UpstreamTls {
    pub server_name: String,
    pub files: Files,
}

impl Upstream {
    /// A libpq connection string to the primary as the replication role: streaming,
    /// base backups, the slot, the timeline check and pg_rewind all connect with it
    /// (`dbname` for the ones that are not replication connections). Over TLS the
    /// role authenticates with its client certificate and the primary's certificate
    /// is verified for the `-rw` Service's name, dialled at the Service's address
    /// (libpq's `hostaddr`); without TLS with the password in `passfile`.
    pub fn conninfo(&self, passfile: &Path, dbname: Option<&str>) -> String {
        let mut parts: Vec<(&str, String)> = Vec::new();
        match (&self.tls, self.host.parse::<std::net::IpAddr>()) {
            (Some(tls), Ok(_)) => {
                parts.push(("host", tls.server_name.clone()));
                parts.push(("hostaddr", self.host.clone()));
            }
            _ => parts.push(("host", self.host.clone())),
        }
        parts.push(("port", self.port.to_string()));
        parts.push(("user", REPLICATION_USER.to_owned()));
        if let Some(dbname) = dbname {
            parts.push(("dbname", dbname.to_owned()));
        }
        parts.push(("passfile", passfile.to_string_lossy().into_owned()));
        match &self.tls {
            Some(tls) => {
                let path = |p: PathBuf| p.to_string_lossy().into_owned();
                parts.push(("sslmode", "verify-full".to_owned()));
                parts.push(("sslrootcert", path(tls.files.server_ca())));
                parts.push(("sslcert", path(tls.files.client_cert())));
                parts.push(("sslkey", path(tls.files.client_key())));
            }
            None => parts.push(("sslmode", "disable".to_owned())),
        }
        parts
            .iter()
            .map(|(key, value)| format!("{key}={}", conninfo_value(value)))
            .collect::<Vec<_>>()
            .join(" ")
    }
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
    /// TLS, or plain TCP.
    pub transport: &'a Transport,
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
    // Castellan's defaults of settings the user may change: the user's line below
    // wins (PostgreSQL takes the last one). A segment with writes in it is closed and
    // archived within 5 minutes, so a point-in-time recovery of a quiet database
    // misses at most that (CloudNativePG's default).
    let _ = writeln!(conf, "archive_timeout = '5min'");
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
    // PostgreSQL's log goes as jsonlog into pipes the manager passes on (`pglog`).
    for (name, value) in super::pglog::settings(settings.socket_dir) {
        let _ = writeln!(conf, "{name} = {}", quote(&value));
    }
    match settings.transport {
        Transport::Tls(files) => {
            let path = |p: PathBuf| quote(&p.to_string_lossy());
            let _ = writeln!(conf, "ssl = on");
            let _ = writeln!(conf, "ssl_cert_file = {}", path(files.server_cert()));
            let _ = writeln!(conf, "ssl_key_file = {}", path(files.server_key()));
            let _ = writeln!(conf, "ssl_ca_file = {}", path(files.client_ca()));
        }
        Transport::Plain => {
            let _ = writeln!(conf, "ssl = off");
        }
    }
    if let Role::Replica(upstream) = settings.role {
        // connect_timeout: a connection to a frozen primary (its kernel still accepts
        // TCP) would otherwise wait forever, before wal_receiver_timeout applies, and
        // the replica would never try the new primary behind -rw.
        let conninfo = format!(
            "{} application_name={} connect_timeout=5",
            upstream.conninfo(settings.passfile, None),
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

/// Renders `pg_hba.conf`. The first line that matches decides, so the order is the
/// policy:
/// 1. the local socket (in a directory only the instance's user can enter) is trusted;
/// 2. the replication role: over TLS with its client certificate (streaming, and in
///    the `postgres` database for pg_rewind and the timeline check) and nowhere else;
///    without TLS (a build that cannot serve it, with plain text allowed) by password;
/// 3. the superuser is refused over the network unless `access.superuser`;
/// 4. the user's lines (`spec.pgHba`, checked by [`pg_hba::rule_problem`]; the caller
///    leaves them out when any is refused), which can narrow or refuse access or admit
///    by certificate, but cannot reach 1–3, which come first;
/// 5. everyone else by SCRAM password over TLS, and over plain TCP too when
///    `access.allow_plaintext`; then everything else is refused, said explicitly so
///    that a refused client reads "pg_hba.conf rejects".
///
/// An instance with neither TLS nor plain text allowed accepts nothing over TCP.
pub fn render_pg_hba(transport: &Transport, access: &Access) -> String {
    let mut hba = String::from(
        "# Written by castellan instance; edits are lost.\n\
         local all all trust\n\
         local replication all trust\n",
    );
    let serving = match transport {
        Transport::Tls(_) => {
            let _ = write!(
                hba,
                "hostssl replication {REPLICATION_USER} all cert\n\
                 hostssl postgres {REPLICATION_USER} all cert\n\
                 host all {REPLICATION_USER} all reject\n"
            );
            true
        }
        Transport::Plain if access.allow_plaintext => {
            let _ = writeln!(hba, "host replication {REPLICATION_USER} all scram-sha-256");
            true
        }
        Transport::Plain => false,
    };
    if serving {
        if !access.superuser {
            hba.push_str("host all postgres all reject\n");
        }
        if !access.hba.is_empty() {
            hba.push_str("# spec.pgHba\n");
            for line in &access.hba {
                let _ = writeln!(hba, "{line}");
            }
        }
        match transport {
            Transport::Tls(_) => {
                hba.push_str("hostssl all all all scram-sha-256\n");
                if access.allow_plaintext {
                    hba.push_str("hostnossl all all all scram-sha-256\n");
                }
            }
            Transport::Plain => hba.push_str("host all all all scram-sha-256\n"),
        }
    }
    hba.push_str("host replication all all reject\nhost all all all reject\n");
    hba
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
            transport: &Transport::Plain,
        }
    }

    fn tls_files() -> Files {
        Files::new(PathBuf::from("/data/run/tls"))
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
    fn archive_timeout_is_5min_unless_the_user_sets_it() {
        let conf = render_castellan_conf(&settings(&Role::Primary, &BTreeMap::new()));
        assert!(conf.contains("archive_timeout = '5min'\n"));
        let parameters = BTreeMap::from([("archive_timeout".to_owned(), "60s".to_owned())]);
        let conf = render_castellan_conf(&settings(&Role::Primary, &parameters));
        let ours = conf.find("archive_timeout = '5min'").expect("the default");
        let user = conf.find("archive_timeout = '60s'").expect("the user's");
        assert!(user > ours, "the last setting wins in postgresql.conf");
    }

    #[test]
    fn replica_conf_follows_the_service() {
        let role = Role::Replica(Upstream {
            host: "orders-rw.db.svc".to_owned(),
            port: 5432,
            slot: slot_name("orders-2"),
            tls: None,
        });
        let conf = render_castellan_conf(&settings(&role, &BTreeMap::new()));
        assert!(
            conf.contains(
                "primary_conninfo = 'host=''orders-rw.db.svc'' port=''5432'' \
                 user=''streaming_replica'' passfile=''/data/.pgpass'' sslmode=''disable'' \
                 application_name=''orders-2'' connect_timeout=5'"
            ),
            "{conf}"
        );
        assert!(conf.contains("primary_slot_name = 'castellan_orders_2'"));
        assert!(conf.contains("recovery_target_timeline = 'latest'"));
        assert!(conf.contains("ssl = off\n"));
    }

    #[test]
    fn over_tls_a_replica_verifies_the_service_name_at_its_address() {
        let upstream = Upstream {
            host: "10.96.0.7".to_owned(),
            port: 5432,
            slot: slot_name("orders-2"),
            tls: Some(UpstreamTls {
                server_name: "orders-rw.db.svc".to_owned(),
                files: tls_files(),
            }),
        };
        assert_eq!(
            upstream.conninfo(Path::new("/data/.pgpass"), Some("postgres")),
            "host='orders-rw.db.svc' hostaddr='10.96.0.7' port='5432' \
             user='streaming_replica' dbname='postgres' passfile='/data/.pgpass' \
             sslmode='verify-full' sslrootcert='/data/run/tls/server-ca.crt' \
             sslcert='/data/run/tls/client.crt' sslkey='/data/run/tls/client.key'"
        );
        let transport = Transport::Tls(tls_files());
        let role = Role::Replica(upstream);
        let parameters = BTreeMap::new();
        let conf = render_castellan_conf(&Settings {
            transport: &transport,
            ..settings(&role, &parameters)
        });
        assert!(conf.contains("ssl = on\n"), "{conf}");
        assert!(conf.contains("ssl_cert_file = '/data/run/tls/server.crt'\n"));
        assert!(conf.contains("ssl_key_file = '/data/run/tls/server.key'\n"));
        assert!(
            conf.contains("ssl_ca_file = '/data/run/tls/client-ca.crt'\n"),
            "client certificates are checked against the replication CA"
        );
        assert!(conf.contains("sslmode=''verify-full''"));
    }

    #[test]
    fn a_name_that_is_no_address_is_dialled_as_it_is() {
        let upstream = Upstream {
            host: "localhost".to_owned(),
            port: 5433,
            slot: slot_name("orders-2"),
            tls: Some(UpstreamTls {
                server_name: "orders-rw.db.svc".to_owned(),
                files: tls_files(),
            }),
        };
        let conninfo = upstream.conninfo(Path::new("/p"), None);
        assert!(
            conninfo.starts_with("host='localhost' port='5433'"),
            "{conninfo}"
        );
        assert!(!conninfo.contains("hostaddr"));
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

    /// The method of the first line that matches a TCP connection (`ssl` or not) to
    /// `database` as `user`, as PostgreSQL reads pg_hba.conf.
    fn method(hba: &str, ssl: bool, database: &str, user: &str) -> String {
        hba.lines()
            .filter(|line| !line.starts_with('#'))
            .map(|line| line.split_whitespace().collect::<Vec<_>>())
            .find(|f| {
                let kind = match f[0] {
                    "host" => true,
                    "hostssl" => ssl,
                    "hostnossl" => !ssl,
                    _ => false,
                };
                let db = match f[1] {
                    "all" => database != "replication",
                    other => other == database,
                };
                kind && db && (f[2] == "all" || f[2] == user)
            })
            .map(|f| f[4].to_owned())
            .unwrap_or_else(|| "none".to_owned())
    }

    fn plaintext(allow_plaintext: bool) -> Access {
        Access {
            allow_plaintext,
            ..Access::default()
        }
    }

    #[test]
    fn the_superuser_logs_in_over_the_network_only_when_allowed() {
        for transport in [Transport::Tls(tls_files()), Transport::Plain] {
            let closed = render_pg_hba(&transport, &plaintext(true));
            assert_eq!(method(&closed, true, "app", "postgres"), "reject");
            assert_eq!(method(&closed, false, "app", "postgres"), "reject");
            let open = render_pg_hba(
                &transport,
                &Access {
                    superuser: true,
                    ..plaintext(true)
                },
            );
            assert_eq!(method(&open, true, "app", "postgres"), "scram-sha-256");
        }
    }

    #[test]
    fn the_users_lines_come_after_castellans_and_before_the_default() {
        let access = Access {
            hba: vec![
                "hostssl audit all 10.0.0.0/8 reject".to_owned(),
                "hostssl shop auditor all cert".to_owned(),
            ],
            ..Access::default()
        };
        let hba = render_pg_hba(&Transport::Tls(tls_files()), &access);
        // Their lines decide for their users…
        assert_eq!(method(&hba, true, "shop", "auditor"), "cert");
        assert_eq!(method(&hba, true, "audit", "clerk"), "reject");
        // …but cannot reach replication or the superuser, which come first…
        assert_eq!(method(&hba, true, "replication", REPLICATION_USER), "cert");
        assert_eq!(method(&hba, true, "app", "postgres"), "reject");
        // …and everyone else still gets the default.
        assert_eq!(method(&hba, true, "app", "clerk"), "scram-sha-256");
        let lines: Vec<&str> = hba.lines().collect();
        let position = |wanted: &str| lines.iter().position(|l| *l == wanted);
        assert!(
            position("host all postgres all reject")
                < position("hostssl audit all 10.0.0.0/8 reject")
                && position("hostssl shop auditor all cert")
                    < position("hostssl all all all scram-sha-256"),
            "{hba}"
        );
    }

    #[test]
    fn without_a_transport_the_users_lines_open_nothing() {
        let access = Access {
            superuser: true,
            hba: vec!["host all all 10.0.0.0/8 md5".to_owned()],
            ..Access::default()
        };
        let hba = render_pg_hba(&Transport::Plain, &access);
        assert!(!hba.contains("10.0.0.0/8"), "{hba}");
        assert_eq!(method(&hba, false, "app", "postgres"), "reject");
    }

    #[test]
    fn over_tls_replication_needs_its_certificate_and_plain_text_is_refused() {
        let hba = render_pg_hba(&Transport::Tls(tls_files()), &Access::default());
        assert_eq!(method(&hba, true, "replication", REPLICATION_USER), "cert");
        assert_eq!(method(&hba, true, "postgres", REPLICATION_USER), "cert");
        assert_eq!(method(&hba, true, "app", REPLICATION_USER), "reject");
        assert_eq!(method(&hba, true, "app", "clerk"), "scram-sha-256");
        assert_eq!(method(&hba, true, "replication", "clerk"), "reject");
        assert_eq!(method(&hba, false, "app", "clerk"), "reject");
        assert_eq!(
            method(&hba, false, "replication", REPLICATION_USER),
            "reject"
        );
        assert!(
            hba.lines()
                .filter(|line| line.starts_with("host"))
                .all(|line| !line.ends_with("trust")),
            "no TCP line trusts: {hba}"
        );
    }

    #[test]
    fn allowed_plain_text_takes_passwords_but_never_replication() {
        let hba = render_pg_hba(&Transport::Tls(tls_files()), &plaintext(true));
        assert_eq!(method(&hba, false, "app", "clerk"), "scram-sha-256");
        assert_eq!(method(&hba, true, "app", "clerk"), "scram-sha-256");
        assert_eq!(
            method(&hba, false, "replication", REPLICATION_USER),
            "reject"
        );
    }

    #[test]
    fn without_tls_only_allowed_plain_text_reaches_the_server() {
        let allowed = render_pg_hba(&Transport::Plain, &plaintext(true));
        assert_eq!(
            method(&allowed, false, "replication", REPLICATION_USER),
            "scram-sha-256"
        );
        assert_eq!(method(&allowed, false, "app", "clerk"), "scram-sha-256");
        let refused = render_pg_hba(&Transport::Plain, &plaintext(false));
        assert_eq!(method(&refused, false, "app", "clerk"), "reject");
        assert_eq!(method(&refused, true, "app", "clerk"), "reject");
        assert_eq!(
            method(&refused, false, "replication", REPLICATION_USER),
            "reject"
        );
    }
}

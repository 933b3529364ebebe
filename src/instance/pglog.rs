//! PostgreSQL's own log, passed on as the manager's: the server's logging collector
//! writes `jsonlog` into a named pipe in the instance's private run directory, and the
//! manager re-emits every record as one of its own lines (target `postgres`), so that
//! the line carries the cluster and instance like every other and `kubectl logs` is one
//! format. What the server prints on stderr before its collector runs (a setting it
//! refuses at start) is passed on the same way, as text.
//!
//! The pipes are opened for reading *and* writing by the manager before any server
//! starts and stay open for its life: the collector's open for writing never waits for
//! a reader, a restarted server writes into the same pipe, and the reader never sees
//! the end of a file. (CloudNativePG's instance manager does the same with its
//! `/controller/log` pipes.) A rotation (`log_rotation_age`, `log_rotation_size`,
//! `pg_rotate_logfile()`) reopens the same pipe: `log_filename` has no time in it.

use std::path::{Path, PathBuf};

use anyhow::Context;
use serde_json::{Map, Value};
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};

/// `log_filename`: the collector's file for stderr output (it always opens one, even
/// when `log_destination` has no `stderr`), and with `.json` appended its `jsonlog`.
const FILE: &str = "postgres";

/// The directory of the pipes inside the instance's private run directory.
pub fn directory(socket_dir: &Path) -> PathBuf {
    socket_dir.join("log")
}

/// The server settings that route its log into the pipes; Castellan owns them
/// (`castellan_crds::database_cluster::RESERVED_POSTGRESQL_PARAMETERS`).
pub fn settings(socket_dir: &Path) -> [(&'static str, String); 4] {
    [
        ("logging_collector", "on".to_owned()),
        ("log_destination", "jsonlog".to_owned()),
        (
            "log_directory",
            directory(socket_dir).to_string_lossy().into_owned(),
        ),
        ("log_filename", FILE.to_owned()),
    ]
}

/// Makes the pipes (replacing whatever else stands at their names) and starts passing
/// on what arrives in them. Called once, before the first server starts.
pub async fn open(socket_dir: &Path) -> anyhow::Result<()> {
    let dir = directory(socket_dir);
    super::private_dir(&dir).await?;
    for (name, kind) in [
        (FILE.to_owned(), Kind::Text),
        (format!("{FILE}.json"), Kind::Json),
    ] {
        let path = dir.join(name);
        make_pipe(&path)?;
        let receiver = tokio::net::unix::pipe::OpenOptions::new()
            .read_write(true)
            .open_receiver(&path)
            .with_context(|| format!("opening the log pipe {}", path.display()))?;
        tokio::spawn(pass_on(BufReader::new(receiver), kind));
    }
    Ok(())
}

/// Passes on what a server process prints on `stdout` and `stderr` (before its
/// collector runs, or when it refuses to start).
pub fn pass_on_output(child: &mut tokio::process::Child) {
    if let Some(stdout) = child.stdout.take() {
        tokio::spawn(pass_on(BufReader::new(stdout), Kind::Text));
    }
    if let Some(stderr) = child.stderr.take() {
        tokio::spawn(pass_on(BufReader::new(stderr), Kind::Text));
    }
}

/// A named pipe at `path` readable by this user only; a pipe already there is kept
/// (the manager restarted), anything else is removed first.
fn make_pipe(path: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_fifo() => return Ok(()),
        Ok(meta) if meta.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(error) => Err(error),
    }
    .with_context(|| format!("removing {} to put a log pipe there", path.display()))?;
    nix::unistd::mkfifo(
        path,
        nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR,
    )
    .with_context(|| format!("making the log pipe {}", path.display()))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// One `jsonlog` record per line.
    Json,
    /// PostgreSQL's text log lines (`2026-12-05 05:13:05.604 UTC [12876] FATAL:  …`).
    Text,
}

/// Re-emits every line of `reader` until it ends (a pipe opened for writing too never
/// does). Lines are read as bytes: a statement in another encoding is passed on
/// lossily rather than stopping the log.
async fn pass_on<R: AsyncRead + Unpin>(mut reader: BufReader<R>, kind: Kind) {
    let mut line = Vec::new();
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line).await {
            Ok(0) => return,
            Ok(_) => {
                let text = String::from_utf8_lossy(&line);
                let text = text.trim_end_matches(['\n', '\r']);
                if !text.is_empty() {
                    emit(&record(kind, text));
                }
            }
            Err(error) => {
                tracing::warn!(%error, "reading PostgreSQL's log; its lines may be lost");
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
        }
    }
}

/// One of PostgreSQL's log records as the manager writes it.
#[derive(Debug, Default, PartialEq)]
struct Record {
    /// PostgreSQL's severity (`LOG`, `ERROR`, `FATAL`…), as it says it.
    severity: String,
    message: String,
    /// The other fields of a `jsonlog` record that say what happened to whom, by the
    /// names [`FIELDS`] gives them.
    fields: Vec<(&'static str, String)>,
}

/// The `jsonlog` keys passed on, and the names they take on the manager's line (a few
/// renamed: `timestamp`, `user` and the like would be read as the line's own).
const FIELDS: [(&str, &str); 17] = [
    ("timestamp", "pg_time"),
    ("pid", "pid"),
    ("backend_type", "backend_type"),
    ("state_code", "sql_state"),
    ("user", "db_user"),
    ("dbname", "database"),
    ("application_name", "application"),
    ("remote_host", "client"),
    ("session_id", "session_id"),
    ("vxid", "vxid"),
    ("txid", "txid"),
    ("query_id", "query_id"),
    ("detail", "detail"),
    ("hint", "hint"),
    ("context", "context"),
    ("statement", "statement"),
    ("internal_query", "internal_query"),
];

fn record(kind: Kind, line: &str) -> Record {
    match kind {
        Kind::Json => match serde_json::from_str::<Map<String, Value>>(line) {
            Ok(object) => json_record(&object),
            // Not a record (a partial write cannot happen on a pipe; this is another
            // writer): passed on as it is.
            Err(_) => text_record(line),
        },
        Kind::Text => text_record(line),
    }
}

fn json_record(object: &Map<String, Value>) -> Record {
    let text = |key: &str| match object.get(key)? {
        Value::String(text) if text.is_empty() => None,
        Value::String(text) => Some(text.clone()),
        Value::Null => None,
        other => Some(other.to_string()),
    };
    Record {
        severity: text("error_severity").unwrap_or_else(|| "LOG".to_owned()),
        message: text("message").unwrap_or_default(),
        fields: FIELDS
            .iter()
            .filter_map(|(key, name)| Some((*name, text(key)?)))
            // PostgreSQL writes `"query_id":0` and `"txid":0` when there is none.
            .filter(|(name, value)| !(matches!(*name, "query_id" | "txid") && value == "0"))
            .collect(),
    }
}

/// A text line's severity is the first `WORD:  ` of PostgreSQL's list after its
/// prefix; the line itself is the message.
fn text_record(line: &str) -> Record {
    const SEVERITIES: [&str; 12] = [
        "PANIC",
        "FATAL",
        "ERROR",
        "WARNING",
        "NOTICE",
        "INFO",
        "LOG",
        "DETAIL",
        "HINT",
        "STATEMENT",
        "CONTEXT",
        "DEBUG",
    ];
    let severity = line
        .match_indices(":  ")
        .find_map(|(at, _)| {
            let word = line[..at].rsplit(' ').next()?;
            let word = word.trim_end_matches(|c: char| c.is_ascii_digit());
            SEVERITIES.contains(&word).then_some(word)
        })
        .unwrap_or("LOG");
    Record {
        severity: severity.to_owned(),
        message: line.to_owned(),
        fields: Vec::new(),
    }
}

/// The manager's level for a PostgreSQL severity: errors that end a session or the
/// server and errors are `error`, warnings `warn`, debug levels `debug`, the rest
/// (`LOG`, `INFO`, `NOTICE` and a text line's `DETAIL`…) `info`.
fn level(severity: &str) -> tracing::Level {
    match severity {
        "PANIC" | "FATAL" | "ERROR" => tracing::Level::ERROR,
        "WARNING" => tracing::Level::WARN,
        s if s.starts_with("DEBUG") => tracing::Level::DEBUG,
        _ => tracing::Level::INFO,
    }
}

fn emit(record: &Record) {
    // A tracing event's fields are fixed where it is written: each of the record's
    // optional fields goes in as an `Option`, which records nothing when absent.
    let field = |name: &str| {
        record
            .fields
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, value)| value.as_str())
    };
    macro_rules! event {
        ($level:expr) => {
            tracing::event!(
                target: "postgres",
                $level,
                severity = %record.severity,
                pg_time = field("pg_time"),
                pid = field("pid"),
                backend_type = field("backend_type"),
                sql_state = field("sql_state"),
                db_user = field("db_user"),
                database = field("database"),
                application = field("application"),
                client = field("client"),
                session_id = field("session_id"),
                vxid = field("vxid"),
                txid = field("txid"),
                query_id = field("query_id"),
                detail = field("detail"),
                hint = field("hint"),
                context = field("context"),
                statement = field("statement"),
                internal_query = field("internal_query"),
                "{}",
                record.message
            )
        };
    }
    match level(&record.severity) {
        tracing::Level::ERROR => event!(tracing::Level::ERROR),
        tracing::Level::WARN => event!(tracing::Level::WARN),
        tracing::Level::DEBUG => event!(tracing::Level::DEBUG),
        _ => event!(tracing::Level::INFO),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_jsonlog_record_keeps_what_says_what_happened_to_whom() {
        let line = r#"{"timestamp":"2026-12-05 05:13:05.604 UTC","user":"app","dbname":"shop","pid":4242,"remote_host":"10.0.0.7","remote_port":51234,"session_id":"6751b2a1.1092","line_num":3,"ps":"SELECT","session_start":"2026-12-05 05:13:01 UTC","vxid":"3/17","txid":0,"error_severity":"ERROR","state_code":"42P01","message":"relation \"nope\" does not exist","statement":"select * from nope","cursor_position":15,"application_name":"psql","backend_type":"client backend","query_id":0}"#;
        let record = record(Kind::Json, line);
        assert_eq!(record.severity, "ERROR");
        assert_eq!(record.message, "relation \"nope\" does not exist");
        assert_eq!(
            record.fields,
            vec![
                ("pg_time", "2026-12-05 05:13:05.604 UTC".to_owned()),
                ("pid", "4242".to_owned()),
                ("backend_type", "client backend".to_owned()),
                ("sql_state", "42P01".to_owned()),
                ("db_user", "app".to_owned()),
                ("database", "shop".to_owned()),
                ("application", "psql".to_owned()),
                ("client", "10.0.0.7".to_owned()),
                ("session_id", "6751b2a1.1092".to_owned()),
                ("vxid", "3/17".to_owned()),
                ("statement", "select * from nope".to_owned()),
            ]
        );
        assert_eq!(level(&record.severity), tracing::Level::ERROR);
    }

    #[test]
    fn a_line_that_is_no_record_is_passed_on_as_text() {
        let record = record(Kind::Json, "could not open file: No space left");
        assert_eq!(record.message, "could not open file: No space left");
        assert_eq!(record.severity, "LOG");
    }

    #[test]
    fn a_text_lines_severity_follows_its_prefix() {
        let cases = [
            (
                "2026-12-05 05:13:05.604 UTC [12876] FATAL:  invalid value for parameter \"wal_level\": \"bogus\"",
                "FATAL",
                tracing::Level::ERROR,
            ),
            (
                "2026-12-05 05:13:05.604 UTC [12876] LOG:  redirecting log output to logging collector process",
                "LOG",
                tracing::Level::INFO,
            ),
            (
                "2026-12-05 05:13:05.604 UTC [12876] WARNING:  could not create listen socket for \"::1\"",
                "WARNING",
                tracing::Level::WARN,
            ),
            (
                "2026-12-05 05:13:05.604 UTC [1] DEBUG2:  checkpointer updated shared memory",
                "DEBUG",
                tracing::Level::DEBUG,
            ),
            (
                "postgres: could not access directory",
                "LOG",
                tracing::Level::INFO,
            ),
        ];
        for (line, severity, expected) in cases {
            let record = text_record(line);
            assert_eq!(record.severity, severity, "{line}");
            assert_eq!(record.message, line);
            assert_eq!(level(&record.severity), expected, "{line}");
        }
    }

    #[test]
    fn the_settings_route_the_log_into_the_run_directorys_pipes() {
        let settings = settings(Path::new("/var/lib/pg/run"));
        assert!(settings.contains(&("logging_collector", "on".to_owned())));
        assert!(settings.contains(&("log_destination", "jsonlog".to_owned())));
        assert!(settings.contains(&("log_directory", "/var/lib/pg/run/log".to_owned())));
        assert!(settings.contains(&("log_filename", "postgres".to_owned())));
    }

    #[tokio::test]
    async fn what_the_collector_writes_into_the_pipe_is_read_and_the_pipe_outlives_writers() {
        let dir = std::env::temp_dir().join(format!("castellan-pglog-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temporary directory");
        let path = dir.join("postgres.json");
        // Something else there first: replaced by a pipe.
        std::fs::write(&path, "stale").expect("a stale file");
        make_pipe(&path).expect("making the pipe");
        make_pipe(&path).expect("a pipe already there is kept");
        let receiver = tokio::net::unix::pipe::OpenOptions::new()
            .read_write(true)
            .open_receiver(&path)
            .expect("opening for reading and writing");
        let mut reader = BufReader::new(receiver);
        for n in 0..2 {
            // The collector's open (O_WRONLY|O_APPEND) does not wait, and a writer
            // closing does not end the reader's stream.
            let mut writer = std::fs::OpenOptions::new()
                .append(true)
                .open(&path)
                .expect("opening for writing without a waiting reader");
            use std::io::Write;
            writeln!(
                writer,
                "{{\"error_severity\":\"LOG\",\"message\":\"start {n}\"}}"
            )
            .expect("writing");
            drop(writer);
            let mut line = Vec::new();
            reader.read_until(b'\n', &mut line).await.expect("reading");
            let record = record(Kind::Json, String::from_utf8_lossy(&line).trim_end());
            assert_eq!(record.message, format!("start {n}"));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

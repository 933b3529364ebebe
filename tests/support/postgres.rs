//! PostgreSQL for the end-to-end tests: the `postgres` user the servers run as, and
//! connections with a deadline.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, PgConnection};

/// Where PostgreSQL's programs are (`CASTELLAN_TEST_PG_BIN_DIR`, else Debian's 15).
pub fn pg_bin_dir() -> PathBuf {
    let dir = PathBuf::from(
        std::env::var("CASTELLAN_TEST_PG_BIN_DIR")
            .unwrap_or_else(|_| "/usr/lib/postgresql/15/bin".into()),
    );
    assert!(
        dir.join("postgres").exists(),
        "PostgreSQL server binaries are missing in {} (deploy/local/deps.sh installs postgresql-15)",
        dir.display()
    );
    dir
}

/// uid and gid of the `postgres` user (PostgreSQL refuses to run as root).
pub fn postgres_ids() -> (u32, u32) {
    let id = |flag: &str| -> u32 {
        let out = Command::new("id")
            .args([flag, "postgres"])
            .output()
            .expect("running id");
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .expect("the postgres user exists")
    };
    (id("-u"), id("-g"))
}

/// Connects over TCP on port 5432, failing the test after 10 s.
pub async fn connect(host: &str, user: &str, password: &str, database: &str) -> PgConnection {
    try_connect(host, user, password, database)
        .await
        .unwrap_or_else(|error| panic!("{error}"))
}

/// Connects over TCP on port 5432, giving up after 10 s; the error says to what.
pub async fn try_connect(
    host: &str,
    user: &str,
    password: &str,
    database: &str,
) -> Result<PgConnection, String> {
    let options = PgConnectOptions::new()
        .host(host)
        .port(5432)
        .username(user)
        .password(password)
        .database(database);
    match tokio::time::timeout(Duration::from_secs(10), options.connect()).await {
        Ok(Ok(connection)) => Ok(connection),
        Ok(Err(e)) => Err(format!("connecting to {database} on {host} as {user}: {e}")),
        Err(_) => Err(format!(
            "connecting to {database} on {host} as {user}: timed out"
        )),
    }
}

/// `pgbench -i` at `scale` (100 000 accounts a step, about 15 MB) into database `shop`
/// as its owner `clerk` with `password`, through `host` over TLS, with Debian's pgbench
/// (as the tests' clusters are bootstrapped: `initdb: {database: shop, owner: clerk}`).
pub fn pgbench_init(host: &str, password: &str, scale: u32) {
    let output = Command::new("/usr/lib/postgresql/15/bin/pgbench")
        .args(["-i", "-s", &scale.to_string(), "-q", "-h", host])
        .args(["-U", "clerk", "shop"])
        .env("PGPASSWORD", password)
        .env("PGSSLMODE", "require")
        .output()
        .expect("running pgbench");
    assert!(
        output.status.success(),
        "pgbench -i -s {scale} on {host}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

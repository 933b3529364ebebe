//! The checks a scratch instance runs on a restored backup before reporting it sound:
//! the server reached consistency and finished recovery (the caller's part), every
//! database's catalog indexes pass `amcheck`'s `bt_index_check`, and the largest tables
//! of every database can be read in full (`count(*)`).

use std::path::Path;

use sqlx::PgPool;

use super::database;

/// How many of each database's largest tables are read in full.
const LARGEST: i64 = 5;

/// Runs the checks; `Ok` with what was found, `Err` with the first failure.
pub async fn check(pool: &PgPool, socket_dir: &Path, port: u16) -> Result<String, String> {
    let databases: Vec<String> = sqlx::query_scalar(
        "select datname from pg_database where datallowconn and not datistemplate order by datname",
    )
    .fetch_all(pool)
    .await
    .map_err(|e| format!("listing databases: {e}"))?;
    let mut found = Vec::new();
    for name in databases {
        let pool = database::connect(socket_dir, port, &name);
        let outcome = check_database(&pool, &name).await;
        pool.close().await;
        found.push(outcome?);
    }
    Ok(found.join("; "))
}

async fn check_database(pool: &PgPool, name: &str) -> Result<String, String> {
    let failed = |what: &str| {
        let what = format!("{what} in database {name}");
        move |e: sqlx::Error| format!("{what}: {e}")
    };
    sqlx::query("create extension if not exists amcheck")
        .execute(pool)
        .await
        .map_err(failed("installing amcheck"))?;
    let indexes: i64 = sqlx::query_scalar(
        "select count(bt_index_check(c.oid)) from pg_index i \
         join pg_class c on c.oid = i.indexrelid join pg_am am on am.oid = c.relam \
         where am.amname = 'btree' and c.relnamespace = 'pg_catalog'::regnamespace \
         and c.relpersistence = 'p'",
    )
    .fetch_one(pool)
    .await
    .map_err(failed("checking the catalog's indexes"))?;
    let tables: Vec<String> = sqlx::query_scalar(
        "select format('%I.%I', n.nspname, c.relname) from pg_class c \
         join pg_namespace n on n.oid = c.relnamespace \
         where c.relkind = 'r' and c.relpersistence = 'p' \
         and n.nspname not in ('pg_catalog', 'information_schema') \
         and n.nspname not like 'pg_toast%' \
         order by pg_relation_size(c.oid) desc limit $1",
    )
    .bind(LARGEST)
    .fetch_all(pool)
    .await
    .map_err(failed("listing the largest tables"))?;
    let mut counts = Vec::new();
    for table in tables {
        // `table` was quoted by format('%I.%I') in the server.
        let rows: i64 =
            sqlx::query_scalar(sqlx::AssertSqlSafe(format!("select count(*) from {table}")))
                .fetch_one(pool)
                .await
                .map_err(failed(&format!("reading {table}")))?;
        counts.push(format!("{table} {rows} rows"));
    }
    let tables = if counts.is_empty() {
        "no tables".to_owned()
    } else {
        counts.join(", ")
    };
    Ok(format!(
        "{name}: {indexes} catalog indexes intact, {tables}"
    ))
}

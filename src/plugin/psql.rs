//! `kubectl castellan psql CLUSTER`: the local `psql`, connected as a client connects
//! (README, Quickstart): through the `<cluster>-rw` Service (`-ro` with `--replica`) as
//! the application user of `<cluster>-app`, verifying the server with that Secret's
//! `ca.crt` (`sslmode=verify-full` against the Service's name). The Service's address
//! goes in `PGHOSTADDR`, since the Service's DNS name may not resolve where the plugin
//! runs; the password goes in `PGPASSWORD`, never on the command line, where any user
//! of the machine could read it in the process list.

use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::Args;
use k8s_openapi::api::core::v1::{Secret, Service};
use kube::api::Api;

use super::Target;
use crate::operator::build::POSTGRES_PORT;

#[derive(Args)]
pub struct PsqlArgs {
    cluster: String,
    /// Connect to a replica (the `-ro` Service) instead of the primary.
    #[arg(long)]
    replica: bool,
    /// The psql program to run.
    #[arg(long, default_value = "psql", env = "CASTELLAN_PSQL")]
    psql: PathBuf,
    /// More arguments for psql (after `--`), such as `-c 'select 1'`.
    #[arg(last = true)]
    psql_args: Vec<String>,
}

/// What psql is told, besides its arguments: the environment of the connection.
#[derive(Debug, PartialEq)]
pub struct Connection {
    pub env: Vec<(&'static str, String)>,
}

/// A key of the Secret, as text.
fn secret_text(secret: &Secret, key: &str) -> anyhow::Result<String> {
    let bytes = secret
        .data
        .as_ref()
        .and_then(|data| data.get(key))
        .with_context(|| {
            format!(
                "Secret {} has no {key}",
                secret.metadata.name.as_deref().unwrap_or("?")
            )
        })?;
    String::from_utf8(bytes.0.clone()).with_context(|| format!("{key} is not text"))
}

/// The connection to `service` (`<cluster>-rw` or `-ro`) at `address`, with the
/// app Secret and the CA file at `ca_file`.
pub fn connection(
    app: &Secret,
    namespace: &str,
    service: &str,
    address: &str,
    ca_file: &str,
) -> anyhow::Result<Connection> {
    Ok(Connection {
        env: vec![
            // The name the server certificate carries; PGHOSTADDR is where to dial.
            ("PGHOST", format!("{service}.{namespace}.svc")),
            ("PGHOSTADDR", address.to_owned()),
            ("PGPORT", POSTGRES_PORT.to_string()),
            ("PGUSER", secret_text(app, "username")?),
            ("PGDATABASE", secret_text(app, "dbname")?),
            ("PGPASSWORD", secret_text(app, "password")?),
            ("PGSSLMODE", "verify-full".to_owned()),
            ("PGSSLROOTCERT", ca_file.to_owned()),
        ],
    })
}

pub async fn run(target: &Target, args: PsqlArgs) -> anyhow::Result<()> {
    let namespace = &target.namespace;
    let secrets: Api<Secret> = Api::namespaced(target.client.clone(), namespace);
    let secret_name = format!("{}-app", args.cluster);
    let app = secrets
        .get(&secret_name)
        .await
        .with_context(|| format!("reading Secret {namespace}/{secret_name}"))?;
    let service = format!(
        "{}-{}",
        args.cluster,
        if args.replica { "ro" } else { "rw" }
    );
    let services: Api<Service> = Api::namespaced(target.client.clone(), namespace);
    let address = services
        .get(&service)
        .await
        .with_context(|| format!("reading Service {namespace}/{service}"))?
        .spec
        .and_then(|spec| spec.cluster_ip)
        .filter(|ip| ip != "None")
        .with_context(|| format!("Service {service} has no cluster IP"))?;
    // The CA in a private temporary file, removed when psql ends.
    let ca = tempfile_with(&secret_text(&app, "ca.crt")?)?;
    let ca_path = ca
        .path()
        .to_str()
        .context("a temporary path in UTF-8")?
        .to_owned();
    let connection = connection(&app, namespace, &service, &address, &ca_path)?;
    let status = tokio::process::Command::new(&args.psql)
        .args(&args.psql_args)
        .envs(connection.env.iter().map(|(k, v)| (*k, v.as_str())))
        .status()
        .await
        .with_context(|| format!("running {}", args.psql.display()))?;
    drop(ca);
    if !status.success() {
        // psql said why; its exit status is the command's, as with `kubectl exec`
        // (scripts tell a failed statement, 1, from a lost connection, 2, by it).
        match status.code() {
            Some(code) => std::process::exit(code),
            None => bail!("{} ended by {status}", args.psql.display()),
        }
    }
    Ok(())
}

/// A file only this user can read, holding `text`, deleted on drop.
fn tempfile_with(text: &str) -> anyhow::Result<TempFile> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = std::env::temp_dir().join(format!(
        "kubectl-castellan-ca-{}-{}.crt",
        std::process::id(),
        jiff::Timestamp::now().as_nanosecond()
    ));
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("creating {}", path.display()))?;
    file.write_all(text.as_bytes())
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(TempFile(path))
}

struct TempFile(PathBuf);

impl TempFile {
    fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::ByteString;

    #[test]
    fn the_password_travels_in_the_environment_and_the_certificate_is_verified() {
        let app = Secret {
            data: Some(
                [
                    ("username", "clerk"),
                    ("dbname", "shop"),
                    ("password", "s3cret"),
                ]
                .into_iter()
                .map(|(k, v)| (k.to_owned(), ByteString(v.as_bytes().to_vec())))
                .collect(),
            ),
            ..Secret::default()
        };
        let connection =
            connection(&app, "prod", "shop-ro", "10.0.0.7", "/tmp/ca.crt").expect("complete");
        let env: std::collections::BTreeMap<_, _> = connection.env.into_iter().collect();
        assert_eq!(env["PGPASSWORD"], "s3cret");
        assert_eq!(env["PGHOST"], "shop-ro.prod.svc");
        assert_eq!(env["PGHOSTADDR"], "10.0.0.7");
        assert_eq!(env["PGSSLMODE"], "verify-full");
        assert_eq!(env["PGUSER"], "clerk");
    }
}

//! `castellan pki`: the CA and its certificates as files, made with the same code the
//! operator uses. For tests, and for calling an instance's API by hand (with curl)
//! while debugging: an operator certificate needs the CA's key, so only someone who
//! may read the `castellan-ca` Secret can make one.
//!
//! Every directory has the layout of the Secret it stands for: a CA directory holds
//! `tls.crt` and `tls.key` (as `castellan-ca`), an issued one `ca.crt`, `tls.crt` and
//! `tls.key` (as `<cluster>-instance-tls`, `-server-tls`, `-replication-tls`). Existing files are never overwritten.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use anyhow::Context;

use super::{Authority, Issued};

#[derive(Debug, clap::Args)]
pub struct PkiArgs {
    #[command(subcommand)]
    command: PkiCommand,
}

#[derive(Debug, clap::Subcommand)]
enum PkiCommand {
    /// Make a new CA in DIR (tls.crt, tls.key).
    Ca {
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
    },
    /// Issue the server certificate of a cluster's instances into DIR (as
    /// `<cluster>-instance-tls`).
    Instance(ClusterCertificate),
    /// Issue PostgreSQL's server certificate of a cluster into DIR (as
    /// `<cluster>-server-tls`).
    Postgres(ClusterCertificate),
    /// Issue a cluster's replication client certificate into DIR (as
    /// `<cluster>-replication-tls`).
    Replication(ClusterCertificate),
    /// Issue an operator client certificate into DIR.
    Operator {
        /// Directory of the CA (tls.crt, tls.key).
        #[arg(long, value_name = "DIR")]
        ca: PathBuf,
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
    },
}

/// Which cluster a certificate is issued for, by which CA, into which directory.
#[derive(Debug, clap::Args)]
struct ClusterCertificate {
    /// Directory of the CA (tls.crt, tls.key).
    #[arg(long, value_name = "DIR")]
    ca: PathBuf,
    #[arg(long)]
    cluster: String,
    #[arg(long)]
    namespace: String,
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
}

type IssueFor = fn(&Authority, &str, &str, SystemTime) -> Result<Issued, super::PkiError>;

fn issue_for(args: &ClusterCertificate, issue: IssueFor, now: SystemTime) -> anyhow::Result<()> {
    let ca = read_ca(&args.ca)?;
    let issued = issue(&ca, &args.cluster, &args.namespace, now)?;
    write_issued(&args.out, &ca, &issued)
}

/// Writes a file that must not exist yet, readable by its owner only if `private`.
fn write_new(dir: &Path, name: &str, contents: &str, private: bool) -> anyhow::Result<()> {
    let path = dir.join(name);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(if private { 0o600 } else { 0o644 })
        .open(&path)
        .with_context(|| format!("creating {}", path.display()))?;
    file.write_all(contents.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

fn read_ca(dir: &Path) -> anyhow::Result<Authority> {
    let read = |name: &str| {
        let path = dir.join(name);
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
    };
    Authority::from_pem(&read("tls.crt")?, &read("tls.key")?)
        .with_context(|| format!("reading the CA in {}", dir.display()))
}

fn write_issued(out: &Path, ca: &Authority, issued: &Issued) -> anyhow::Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    write_new(out, "ca.crt", ca.cert_pem(), false)?;
    write_new(out, "tls.crt", &issued.cert_pem, false)?;
    write_new(out, "tls.key", &issued.key_pem, true)
}

pub fn run(args: PkiArgs) -> anyhow::Result<()> {
    let now = SystemTime::now();
    match args.command {
        PkiCommand::Ca { out } => {
            let ca = Authority::generate(now)?;
            std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
            write_new(&out, "tls.crt", ca.cert_pem(), false)?;
            write_new(&out, "tls.key", ca.key_pem(), true)
        }
        PkiCommand::Instance(args) => issue_for(&args, Authority::issue_server, now),
        PkiCommand::Postgres(args) => issue_for(&args, Authority::issue_postgres_server, now),
        PkiCommand::Replication(args) => issue_for(&args, Authority::issue_replication, now),
        PkiCommand::Operator { ca, out } => {
            let ca = read_ca(&ca)?;
            let issued = ca.issue_operator(now)?;
            write_issued(&out, &ca, &issued)
        }
    }
}

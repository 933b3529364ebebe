//! Rotating Castellan's CA without downtime: the shell. `machine.rs` decides; this
//! reads the CA Secret, asks every instance to show what the step under way needs,
//! and moves the Secret and the operator's own trust one step at a time.
//!
//! Everything a rotation must remember is in the CA Secret (`next.crt` present: the
//! new CA is being trusted; `ca.crt` holding a CA that does not issue: the old one is
//! retiring), so an operator that takes over the lease mid-rotation carries on where
//! the last one stopped. Each write is a replace conditional on what was read. The
//! clusters' Secrets follow by their own passes (`certificates::ensure_certificate`
//! rewrites `ca.crt` or issues again whenever they are not right for the CAs as they
//! stand); this only waits for them, and for the instances to load them.
//!
//! Like the BackupSchedule controller, this is a loop of a few API calls rather than
//! an actor: it runs under the lease, beside the controllers, one step at a time.

pub mod machine;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use castellan_crds::DatabaseCluster;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::json;
use tracing::Instrument;

use super::certificates::{self, CA_SECRET, ClusterCertificate};
use super::cluster::Note;
use super::context::{Shared, object_reference};
use super::instance_client;
use crate::instance_api::{LoadedCertificates, StatusReport};
use crate::kube_ops::CLUSTER_LABEL;
use crate::pki::{self, Authority, Trust};
use machine::{PROGRESS_ANNOTATION, Phase, Proof, ROTATE_ANNOTATION, ROTATED_ANNOTATION, Step};

/// How often the CA Secret and the instances are looked at.
const INTERVAL: Duration = Duration::from_secs(5);

/// Runs until the process ends. `namespace` holds the CA Secret; `clusters` is the API
/// of the watched namespace (or of all of them).
pub async fn run(shared: Arc<Shared>, namespace: String, clusters: Api<DatabaseCluster>) {
    tracing::info!("CA rotation watch starting");
    let mut told = None;
    loop {
        let span = tracing::info_span!("ca rotation");
        if let Err(error) = tick(&shared, &namespace, &clusters, &mut told)
            .instrument(span)
            .await
        {
            tracing::warn!(error = %format!("{error:#}"), "CA rotation: trying again");
        }
        tokio::time::sleep(INTERVAL).await;
    }
}

/// One look: read, decide, act. `told` is the last waiting reason recorded, so that
/// a wait is told once, not every five seconds.
async fn tick(
    shared: &Shared,
    namespace: &str,
    clusters: &Api<DatabaseCluster>,
    told: &mut Option<String>,
) -> anyhow::Result<()> {
    let secrets: Api<Secret> = Api::namespaced(shared.client.clone(), namespace);
    let secret = secrets
        .get_opt(CA_SECRET)
        .await
        .with_context(|| format!("reading Secret {namespace}/{CA_SECRET}"))?
        .with_context(|| {
            format!("Secret {namespace}/{CA_SECRET} is gone; restart the operator to make a CA")
        })?;
    let trust = certificates::read_trust(&secret, namespace)?;
    // The Secret is the truth: a previous leader may have moved it on.
    if !trust.same(&shared.trust()) {
        shared.set_trust(trust.clone())?;
    }
    let phase = Phase::of(&trust);
    let proofs = match phase {
        Phase::Steady => Vec::new(),
        Phase::Trusting | Phase::Retiring => prove(shared, clusters, &trust, phase).await?,
    };
    let annotations = secret.annotations();
    let step = machine::decide(
        phase,
        annotations.get(ROTATE_ANNOTATION).map(String::as_str),
        annotations.get(ROTATED_ANNOTATION).map(String::as_str),
        trust.expiring(SystemTime::now()),
        &proofs,
    );
    let (next, note) = match step {
        Step::Nothing => return Ok(()),
        Step::Wait(why) => {
            if told.as_ref() != Some(&why) {
                let progress = format!("{}: waiting for {why}", describe(phase));
                tracing::info!(%progress, "CA rotation waits");
                annotate(&secrets, &progress).await?;
                // A reason per step: Events of one reason form a series that keeps its
                // first message (the annotation always has the current one).
                let reason = match phase {
                    Phase::Trusting => "CARotationWaitingForTrust",
                    _ => "CARotationWaitingForCertificates",
                };
                record(shared, &secret, Note::normal(reason, progress)).await;
                *told = Some(why);
            }
            return Ok(());
        }
        Step::Begin(why) => {
            let coming = Authority::generate(SystemTime::now()).context("making the new CA")?;
            let next = Trust::new(
                trust.authority.clone(),
                Some(Arc::new(coming)),
                trust.bundle_pem().as_bytes(),
            )?;
            let note = format!(
                "started ({why}): the new CA {} is trusted beside the current one before it issues anything",
                short(
                    &next
                        .next
                        .as_ref()
                        .map(|n| n.fingerprint())
                        .unwrap_or_default()
                )
            );
            (next, Note::normal("CARotationStarted", note))
        }
        Step::Switch => {
            let next = trust
                .switched()
                .context("switching to the new CA: the Secret holds none")?;
            let note = format!(
                "every instance trusts the new CA {}: it issues from now on, and every certificate is issued again",
                short(&next.authority.fingerprint())
            );
            (next, Note::normal("CARotationSwitched", note))
        }
        Step::Finish => {
            let next = trust.retired();
            let note = format!(
                "finished: every instance serves certificates of the CA {}; the old CA is no longer trusted",
                short(&next.authority.fingerprint())
            );
            (next, Note::normal("CARotationFinished", note))
        }
    };
    let done = Phase::of(&next) == Phase::Steady;
    let progress = (!done).then(|| format!("{}: started", describe(Phase::of(&next))));
    let rotated = done
        .then(|| annotations.get(ROTATE_ANNOTATION).cloned())
        .flatten();
    if !store(&secrets, secret.clone(), &next, progress, rotated).await? {
        return Ok(());
    }
    shared.set_trust(next)?;
    tracing::info!(reason = note.reason, message = %note.message, "CA rotation");
    record(shared, &secret, note).await;
    *told = None;
    Ok(())
}

fn describe(phase: Phase) -> &'static str {
    match phase {
        Phase::Steady => "steady",
        Phase::Trusting => "trusting the new CA",
        Phase::Retiring => "retiring the old CA",
    }
}

/// The first twelve hex digits of a fingerprint, enough to tell CAs apart in a message.
fn short(fingerprint: &str) -> &str {
    fingerprint.get(..12).unwrap_or(fingerprint)
}

/// Replaces the CA Secret with `trust`'s data, conditionally on what was read; `false`
/// when someone else wrote it meanwhile (the next look reads theirs).
async fn store(
    secrets: &Api<Secret>,
    mut secret: Secret,
    trust: &Trust,
    progress: Option<String>,
    rotated: Option<String>,
) -> anyhow::Result<bool> {
    secret.data = Some(certificates::trust_data(trust));
    secret.string_data = None;
    let annotations = secret.annotations_mut();
    match progress {
        Some(progress) => annotations.insert(PROGRESS_ANNOTATION.to_owned(), progress),
        None => annotations.remove(PROGRESS_ANNOTATION),
    };
    if let Some(rotated) = rotated {
        annotations.insert(ROTATED_ANNOTATION.to_owned(), rotated);
    }
    match secrets
        .replace(CA_SECRET, &PostParams::default(), &secret)
        .await
    {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
        Err(error) => Err(error).context(format!("writing the CA Secret {CA_SECRET}")),
    }
}

/// Says where the rotation stands on the CA Secret.
async fn annotate(secrets: &Api<Secret>, progress: &str) -> anyhow::Result<()> {
    let patch = json!({"metadata": {"annotations": {PROGRESS_ANNOTATION: progress}}});
    secrets
        .patch(CA_SECRET, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .with_context(|| format!("annotating the CA Secret {CA_SECRET}"))?;
    Ok(())
}

async fn record(shared: &Shared, secret: &Secret, note: Note) {
    shared.record_at(&object_reference(secret), note).await;
}

/// What every instance of every cluster shows for `phase`.
async fn prove(
    shared: &Shared,
    clusters: &Api<DatabaseCluster>,
    trust: &Trust,
    phase: Phase,
) -> anyhow::Result<Vec<Proof>> {
    // Trusting: a client certificate of the new CA must get through, the server may
    // still serve the old one. Retiring: the server must serve one of the new CA.
    let (client_ca, roots, ca) = match (phase, &trust.next) {
        (Phase::Trusting, Some(next)) => (next.clone(), trust.bundle().to_vec(), next.clone()),
        _ => (
            trust.authority.clone(),
            vec![trust.authority.cert_der().clone()],
            trust.authority.clone(),
        ),
    };
    let tls = Arc::new(
        pki::tls::client_config(client_ca, &roots)
            .context("a client configuration to prove with")?,
    );
    let wanted = ca.fingerprint();
    let mut proofs = Vec::new();
    for cluster in clusters
        .list(&ListParams::default())
        .await
        .context("listing the DatabaseClusters")?
    {
        let namespace = cluster.namespace().unwrap_or_default();
        let brought = cluster.spec.server_certificate_secret().is_some();
        // The cluster's Secrets first: the instances can only load what they hold.
        let mut leaves = Leaves::default();
        let mut unsettled = Vec::new();
        for which in ClusterCertificate::ALL {
            if brought && which == ClusterCertificate::Postgres {
                continue;
            }
            match certificates::settled_certificate(&shared.client, &cluster, trust, which).await {
                Ok(fingerprint) => leaves.set(which, fingerprint),
                Err(why) => unsettled.push(why),
            }
        }
        if !unsettled.is_empty() {
            proofs.push(Proof {
                instance: format!("{namespace}/{}", cluster.name_any()),
                missing: Some(unsettled.join(", ")),
            });
            continue;
        }
        let pods: Api<Pod> = Api::namespaced(shared.client.clone(), &namespace);
        let selector = format!("{CLUSTER_LABEL}={}", cluster.name_any());
        let listed = pods
            .list(&ListParams::default().labels(&selector))
            .await
            .with_context(|| format!("listing the pods of {namespace}/{}", cluster.name_any()))?;
        for pod in listed {
            let instance = format!("{namespace}/{}", pod.name_any());
            let missing = match instance_client::pod_address(&cluster, &pod) {
                None => Some("it has no address yet".to_owned()),
                Some(address) => {
                    let shown = instance_client::get_as(tls.clone(), &address, "/status")
                        .await
                        .map_err(|error| match phase {
                            Phase::Trusting => format!(
                                "its instance API does not accept the new CA yet ({error})"
                            ),
                            _ => format!(
                                "its instance API does not serve a certificate of the new CA yet ({error})"
                            ),
                        })
                        .and_then(|answer| {
                            serde_json::from_value::<StatusReport>(answer)
                                .map_err(|error| format!("its status cannot be read ({error})"))
                        });
                    match shown {
                        Ok(report) => shows(phase, &report, &wanted, brought, &leaves).err(),
                        Err(why) => Some(why),
                    }
                }
            };
            proofs.push(Proof { instance, missing });
        }
    }
    Ok(proofs)
}

/// The fingerprints of a cluster's certificates as its Secrets hold them.
#[derive(Default)]
struct Leaves {
    served: Option<String>,
    client: Option<String>,
}

impl Leaves {
    fn set(&mut self, which: ClusterCertificate, fingerprint: String) {
        match which {
            ClusterCertificate::Postgres => self.served = Some(fingerprint),
            ClusterCertificate::Replication => self.client = Some(fingerprint),
            // Proven by the handshake itself.
            ClusterCertificate::Instance => {}
        }
    }
}

/// Whether an instance's report shows what `phase` needs of its PostgreSQL: the new
/// CA `wanted` loaded as an issuer (Trusting), or the cluster's current certificates
/// loaded (Retiring). Without TLS, PostgreSQL holds no certificate to rotate.
fn shows(
    phase: Phase,
    report: &StatusReport,
    wanted: &str,
    brought: bool,
    leaves: &Leaves,
) -> Result<(), String> {
    if report.tls != Some(true) {
        return Ok(());
    }
    let loaded: &LoadedCertificates = report.certificates.as_ref().ok_or_else(|| {
        "its manager does not report its certificates yet (an older version?)".to_owned()
    })?;
    let has = |cas: &[String]| cas.iter().any(|ca| ca == wanted);
    match phase {
        Phase::Trusting => {
            if !has(&loaded.client_cas) {
                return Err(
                    "PostgreSQL has not loaded the new CA as a client certificates' issuer yet"
                        .to_owned(),
                );
            }
            if !brought && !has(&loaded.server_cas) {
                return Err(
                    "PostgreSQL has not loaded the new CA as its primary's issuer yet".to_owned(),
                );
            }
        }
        Phase::Retiring | Phase::Steady => {
            if leaves.served.is_some() && loaded.served != leaves.served {
                return Err("PostgreSQL does not serve the new server certificate yet".to_owned());
            }
            if loaded.client != leaves.client {
                return Err("it has not loaded the new replication certificate yet".to_owned());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(loaded: LoadedCertificates) -> StatusReport {
        StatusReport {
            tls: Some(true),
            certificates: Some(loaded),
            ..StatusReport::default()
        }
    }

    #[test]
    fn trusting_needs_the_new_ca_in_both_of_postgresqls_trust_files() {
        let leaves = Leaves::default();
        let both = report(LoadedCertificates {
            client_cas: vec!["old".into(), "new".into()],
            server_cas: vec!["old".into(), "new".into()],
            ..LoadedCertificates::default()
        });
        assert_eq!(shows(Phase::Trusting, &both, "new", false, &leaves), Ok(()));
        let half = report(LoadedCertificates {
            client_cas: vec!["old".into(), "new".into()],
            server_cas: vec!["old".into()],
            ..LoadedCertificates::default()
        });
        assert!(shows(Phase::Trusting, &half, "new", false, &leaves).is_err());
        // A server certificate the user brings is verified with the user's CA.
        assert_eq!(shows(Phase::Trusting, &half, "new", true, &leaves), Ok(()));
        let plain = StatusReport {
            tls: Some(false),
            ..StatusReport::default()
        };
        assert_eq!(
            shows(Phase::Trusting, &plain, "new", false, &leaves),
            Ok(())
        );
        let silent = StatusReport {
            tls: Some(true),
            ..StatusReport::default()
        };
        assert!(shows(Phase::Trusting, &silent, "new", false, &leaves).is_err());
    }

    #[test]
    fn retiring_needs_the_secrets_certificates_loaded() {
        let leaves = Leaves {
            served: Some("server-2".into()),
            client: Some("client-2".into()),
        };
        let current = report(LoadedCertificates {
            served: Some("server-2".into()),
            client: Some("client-2".into()),
            ..LoadedCertificates::default()
        });
        assert_eq!(
            shows(Phase::Retiring, &current, "new", false, &leaves),
            Ok(())
        );
        let stale = report(LoadedCertificates {
            served: Some("server-1".into()),
            client: Some("client-2".into()),
            ..LoadedCertificates::default()
        });
        assert!(
            shows(Phase::Retiring, &stale, "new", false, &leaves)
                .is_err_and(|why| why.contains("server certificate"))
        );
    }
}

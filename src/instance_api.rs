//! The contract between the operator and the instance manager: the request and
//! response bodies of the instance API (`castellan instance`'s HTTP endpoints), in one
//! module both sides use, so that neither indexes JSON by string that the other built
//! by hand.
//!
//! It also holds the two pieces of arithmetic both sides must agree on: WAL positions
//! ([`Lsn`]) and the primary lease ([`LeaseGrant`]). The lease is what keeps two
//! primaries from accepting writes at the same time; `docs/failover.md` gives the
//! argument.

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use castellan_crds::database_cluster::Compression;
use serde::{Deserialize, Serialize};

/// A WAL position (`pg_lsn`), comparable. PostgreSQL writes it as two hexadecimal
/// halves, `16/B374D848`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Lsn(pub u64);

impl Lsn {
    pub fn parse(text: &str) -> Option<Self> {
        let (high, low) = text.trim().split_once('/')?;
        let high = u64::from_str_radix(high, 16).ok()?;
        let low = u64::from_str_radix(low, 16).ok()?;
        (high <= u64::from(u32::MAX) && low <= u64::from(u32::MAX))
            .then_some(Self((high << 32) | low))
    }
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

/// Permission to run as primary until `valid_until` (the operator's wall clock, in
/// milliseconds since the Unix epoch) and for at most `duration_ms` after it arrives
/// (the instance's own monotonic clock). The instance keeps whichever ends first, so a
/// grant that arrives late (a delayed packet, a paused process) grants nothing past
/// its wall-clock end, and a clock that jumps cannot stretch it past its duration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseGrant {
    pub valid_until_ms: u64,
    pub duration_ms: u64,
}

impl LeaseGrant {
    /// A grant of `duration` from `now`.
    pub fn starting(now: SystemTime, duration: Duration) -> Self {
        Self {
            valid_until_ms: millis_since_epoch(now + duration),
            duration_ms: u64::try_from(duration.as_millis()).unwrap_or(u64::MAX),
        }
    }

    /// When the grant ends by the operator's clock.
    pub fn valid_until(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.valid_until_ms)
    }

    /// How long the grant still runs for an instance that receives it at `now` (its
    /// wall clock): nothing once its wall-clock end has passed.
    pub fn remaining_at(&self, now: SystemTime) -> Duration {
        let by_wall_clock = self
            .valid_until()
            .duration_since(now)
            .unwrap_or(Duration::ZERO);
        by_wall_clock.min(Duration::from_millis(self.duration_ms))
    }
}

pub fn millis_since_epoch(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// `primary` or `replica`: how the instance manager runs its server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RunningRole {
    Primary,
    Replica,
}

impl RunningRole {
    pub fn as_str(self) -> &'static str {
        match self {
            RunningRole::Primary => "primary",
            RunningRole::Replica => "replica",
        }
    }
}

/// `GET /status`: the instance as its manager sees it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StatusReport {
    pub instance: String,
    /// The role the manager runs the server in (absent before bootstrap decided it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<RunningRole>,
    /// The server accepts connections in that role.
    pub ready: bool,
    /// The server is stopped on purpose: fenced by the user, or a primary whose lease
    /// ran out.
    #[serde(default)]
    pub fenced: bool,
    /// Milliseconds left of the primary lease, when it holds one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_remaining_ms: Option<u64>,
    /// Why the data directory could not be made or started, when it could not (for
    /// example an empty volume where data should be).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
    /// Parameters the operator asked for that PostgreSQL refused: the instance keeps
    /// running with `parameters` (the last good ones).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused_parameters: Option<RefusedParameters>,
    /// The parameters the configuration was last written with.
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
    /// What the server itself reports, when it answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server: Option<ServerStatus>,
    /// Why the server could not be asked, when it could not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// WAL archiving as the manager runs it.
    #[serde(default)]
    pub archive: ArchiveReport,
    /// What a restore into this instance's empty volume is doing, or why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restoring: Option<String>,
    /// A scratch instance's verdict on the backup it restored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verification: Option<VerificationReport>,
    /// Whether PostgreSQL serves TLS (with the cluster's certificates).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<bool>,
    /// Who may connect how, as `pg_hba.conf` is written now (absent from a manager
    /// that predates the setting).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access: Option<Access>,
    /// The PostgreSQL release its binaries carry, such as `15.18` (whether or not the
    /// server runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release: Option<String>,
    /// The certificates PostgreSQL runs with (absent without TLS, or before the
    /// manager read them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub certificates: Option<LoadedCertificates>,
    /// The statistics a primary gathers after its first start on a major upgrade's
    /// data directory (`vacuumdb --all --analyze-in-stages`): `running`, `done`, or
    /// why it failed (tried again at the next start). Absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub analyze: Option<String>,
}

/// [`StatusReport::analyze`] while it runs.
pub const ANALYZE_RUNNING: &str = "running";
/// [`StatusReport::analyze`] once it finished.
pub const ANALYZE_DONE: &str = "done";

/// The certificates an instance's PostgreSQL runs with, as the SHA-256 fingerprints of
/// their DER (`pki::fingerprint`): what a CA rotation waits on before each step. "Runs
/// with" is as of the server's last start or reload, not what the mounts hold.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LoadedCertificates {
    /// The CAs a client certificate may come from (`ssl_ca_file`).
    #[serde(default)]
    pub client_cas: Vec<String>,
    /// The CAs the primary's certificate may come from (a replica's `sslrootcert`).
    #[serde(default)]
    pub server_cas: Vec<String>,
    /// The server certificate PostgreSQL serves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served: Option<String>,
    /// The client certificate a replica streams with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client: Option<String>,
}

/// Who may connect to PostgreSQL over the network and how, beside TLS: what
/// `pg_hba.conf` is written from. It follows the spec on a running server (sent with
/// `POST /reload`, applied by a reload).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Access {
    /// Accept password logins over plain TCP too (`spec.tls.allowPlaintext`).
    #[serde(default)]
    pub allow_plaintext: bool,
    /// The superuser may log in over the network (`spec.enableSuperuserAccess`).
    #[serde(default)]
    pub superuser: bool,
    /// The user's own lines (`spec.pgHba`), after Castellan's and before its default.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hba: Vec<String>,
}

/// The server's state as the operator needs it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServerStatus {
    pub in_recovery: bool,
    pub timeline: Option<i64>,
    /// Write LSN on a primary, replay LSN on a replica.
    pub lsn: Option<String>,
    /// Last WAL position a replica received (flushed to its disk).
    pub receive_lsn: Option<String>,
    /// Seconds since the primary's last heartbeat, as replayed here.
    pub lag_seconds: Option<f64>,
    /// Whether a replica's WAL receiver is streaming.
    pub streaming: Option<bool>,
    pub standbys: Vec<Standby>,
    /// A primary's replication slots.
    #[serde(default)]
    pub slots: Vec<Slot>,
    pub server_version: String,
    /// `synchronous_standby_names` in force.
    pub synchronous_standby_names: String,
    /// Parameters whose new value waits for a restart (`pg_settings.pending_restart`).
    pub pending_restart: Vec<String>,
}

/// One standby as the primary sees it in `pg_stat_replication`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Standby {
    pub name: String,
    pub state: String,
    pub sync_state: String,
    pub replay_lsn: Option<String>,
    pub lag_bytes: Option<i64>,
}

/// A physical replication slot on the primary and the WAL it holds back.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Slot {
    pub name: String,
    pub active: bool,
    /// Bytes of WAL kept for it (`pg_current_wal_lsn() - restart_lsn`).
    pub retained_bytes: Option<i64>,
    /// `reserved`, `extended`, `unreserved` or `lost` (`pg_replication_slots.wal_status`).
    pub wal_status: Option<String>,
}

/// `POST /lease`: renews the primary lease.
pub type LeaseRequest = LeaseGrant;

/// `POST /lease`'s answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseResponse {
    /// Milliseconds the lease now runs for, by the instance's clock.
    pub remaining_ms: u64,
}

/// `POST /promote`: become primary, holding `lease`, with a slot for each of `slots`
/// (the instances that will follow it: slots are not replicated, so a promoted
/// replica has none), and with `synchronous_standby_names` in force from its first
/// commit (a replica runs without one; promoted without it, its first commits would
/// be acknowledged by no standby until the operator's next reload).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PromoteRequest {
    pub lease: LeaseGrant,
    #[serde(default)]
    pub slots: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub synchronous_standby_names: Option<String>,
}

/// `POST /promote`'s answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PromoteResponse {
    /// False when it already was primary.
    pub changed: bool,
    pub timeline: Option<i64>,
}

/// `POST /fence`: stop the server and keep it stopped (true), or let it run (false).
/// Fencing survives a restart of the pod: it is recorded on the volume.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FenceRequest {
    pub fenced: bool,
}

/// `POST /fence`'s answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FenceResponse {
    pub fenced: bool,
    /// The last checkpoint of the stopped server (`pg_controldata`): a primary stopped
    /// cleanly has sent its WAL up to here to its streaming standbys.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_lsn: Option<String>,
}

/// `POST /reload`: rewrite the configuration and reload.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReloadRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub synchronous_standby_names: Option<String>,
    /// On a primary: the instances that should have a slot; other Castellan slots
    /// that nothing uses are dropped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slots: Option<Vec<String>>,
    /// Where completed WAL segments go (every instance archives: see
    /// `docs/backups.md`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub archive: Option<ArchiveConfig>,
    /// Who may connect how (`pg_hba.conf`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access: Option<Access>,
}

/// The object store WAL is archived to, with the credentials to reach it. It travels
/// only inside the operator's mutually authenticated TLS connection and is held in the
/// manager's memory, never written to the volume.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ArchiveTarget {
    /// `http(s)://host:port` of the S3 API.
    pub endpoint: String,
    pub bucket: String,
    /// Prefix of this cluster's objects in the bucket (no leading or trailing `/`).
    pub prefix: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
    pub access_key_id: String,
    pub secret_access_key: String,
    /// PEM certificates to trust for an `https://` endpoint beside the system's
    /// (`spec.backup.endpointCA`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_bundle: Option<String>,
}

impl fmt::Debug for ArchiveTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ArchiveTarget")
            .field("endpoint", &self.endpoint)
            .field("bucket", &self.bucket)
            .field("prefix", &self.prefix)
            .field("region", &self.region)
            .field("ca_bundle", &self.ca_bundle.is_some())
            .finish_non_exhaustive()
    }
}

/// Archiving on (to `target`) or off (`target` absent: completed segments are let go,
/// as without `spec.backup`). `fingerprint` names the setting, so that the operator can
/// tell from a status report whether an instance has the one it wants without the
/// report carrying credentials.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ArchiveConfig {
    pub fingerprint: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<ArchiveTarget>,
}

impl ArchiveConfig {
    /// The setting for `target`, with its fingerprint: a SHA-256 of all of it,
    /// credentials included (a rotated key is a new setting), cut to 16 hex digits.
    pub fn new(target: Option<ArchiveTarget>) -> Self {
        let fingerprint = match &target {
            None => "off".to_owned(),
            Some(target) => {
                let bytes = serde_json::to_vec(target).unwrap_or_default();
                let digest = ring::digest::digest(&ring::digest::SHA256, &bytes);
                digest.as_ref()[..8]
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect()
            }
        };
        Self {
            fingerprint,
            target,
        }
    }
}

/// What an instance's archiving has done since the manager was given its setting.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ArchiveReport {
    /// The fingerprint of the setting in force; absent until the operator sent one
    /// (until then PostgreSQL keeps every completed segment).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<String>,
    /// The newest WAL file this instance archived, or found already archived.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_archived: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_archived_ms: Option<u64>,
    /// The last failure, with what was being archived.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failure: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failed_ms: Option<u64>,
    /// Completed WAL files waiting to be archived (`pg_wal/archive_status/*.ready`).
    #[serde(default)]
    pub waiting: u32,
}

impl ArchiveReport {
    /// Archiving is failing: the last attempt failed.
    pub fn failing(&self) -> bool {
        self.last_failed_ms.is_some() && self.last_failed_ms > self.last_archived_ms
    }
}

/// The key of [`RefusedParameters::reasons`] for a set refused as a whole.
pub const TOGETHER: &str = "(together)";

/// A set of server parameters an instance would not write, and why.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RefusedParameters {
    /// The whole set asked for.
    pub parameters: BTreeMap<String, String>,
    /// PostgreSQL's reason for each refused parameter (`work_mem` → `invalid value
    /// for parameter …`); [`TOGETHER`] when each is good alone but the set is not.
    pub reasons: BTreeMap<String, String>,
}

/// `POST /backup`: take base backup `id` of this instance's data to `target`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackupRequest {
    /// Names the backup in the object store (`<prefix>/<system id>/base/<id>/`);
    /// letters, digits, `-` and `_` only.
    pub id: String,
    pub target: ArchiveTarget,
    #[serde(default)]
    pub compression: Compression,
    /// On a replica: the primary's checkpoint record (`POST /checkpoint`) to replay
    /// before starting, so that the backup begins at it rather than at an older
    /// restartpoint, whose WAL may predate archiving.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after_checkpoint: Option<String>,
}

/// `POST /checkpoint`'s and `POST /switch-wal`'s answer: where the checkpoint record
/// the primary wrote is, or where the closed segment ended.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LsnResponse {
    pub lsn: String,
}

/// `POST /restore`: fill this instance's empty volume from base backup `backup_id` of
/// the cluster with `system_id` in `source`, and replay that cluster's archived WAL to
/// the target (to the end of the archive without one); then it is a primary.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RestoreRequest {
    pub source: ArchiveTarget,
    pub system_id: String,
    pub backup_id: String,
    /// `recovery_target_time`, RFC 3339.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_time: Option<String>,
    /// `recovery_target_lsn`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_lsn: Option<String>,
    /// A scratch instance verifying the backup: after the recovery, check the data,
    /// report (`StatusReport::verification`) and stop; never become a primary.
    #[serde(default)]
    pub verify: bool,
}

/// What a scratch instance found when it verified a restored backup.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VerificationReport {
    pub ok: bool,
    /// What was checked and found, or what failed.
    pub message: String,
    /// From the restore request to the end of the checks.
    pub duration_ms: u64,
}

/// Where a base backup is in its life on the instance taking it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum BackupPhase {
    /// Copying the data directory to the object store.
    #[default]
    Running,
    /// Copied; the WAL segment that makes the copy consistent is not archived yet (on
    /// a replica it completes only when the primary switches to the next one).
    WaitingForWal,
    /// Stored, with the WAL it needs, and its manifest written: restorable.
    Completed,
    Failed,
}

/// A base backup's progress and result, as the instance taking it reports it; a
/// completed one is also stored beside the data as `backup.json`, its manifest.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackupReport {
    pub id: String,
    pub phase: BackupPhase,
    /// The instance it was taken on, and whether that was a standby.
    #[serde(default)]
    pub instance: String,
    #[serde(default)]
    pub from_standby: bool,
    /// How the data's tar is stored (manifests written before the choice existed say
    /// nothing: zstd).
    #[serde(default)]
    pub compression: Compression,
    /// The key prefix of the backup's objects (`<prefix>/<system id>/base/<id>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeline: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub begin_lsn: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_lsn: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub begin_wal: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_wal: Option<String>,
    /// Bytes of the data directory to copy, copied so far, and stored (compressed).
    #[serde(default)]
    pub bytes_total: u64,
    #[serde(default)]
    pub bytes_read: u64,
    #[serde(default)]
    pub bytes_stored: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped_ms: Option<u64>,
    /// When the copy ended (`pg_backup_stop`): the earliest moment it restores to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consistent_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl BackupReport {
    /// Percent of the data directory copied; 100 only once completed.
    pub fn progress_percent(&self) -> i32 {
        if self.phase == BackupPhase::Completed {
            return 100;
        }
        if self.bytes_total == 0 {
            return 0;
        }
        let percent = self.bytes_read.saturating_mul(100) / self.bytes_total;
        i32::try_from(percent.min(99)).unwrap_or(99)
    }
}

/// `POST /reload`'s answer.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReloadResponse {
    pub pending_restart: Vec<String>,
}

/// Name of the replication slot an instance streams from: PostgreSQL allows lowercase
/// letters, digits and `_` only.
pub fn slot_name(instance_name: &str) -> String {
    let cleaned: String = instance_name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect();
    format!("castellan_{cleaned}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lsns_parse_compare_and_print() {
        let a = Lsn::parse("16/B374D848").expect("an lsn");
        let b = Lsn::parse("17/0").expect("an lsn");
        assert!(a < b);
        assert_eq!(a.to_string(), "16/B374D848");
        assert_eq!(Lsn::parse("0/3000060"), Some(Lsn(0x300_0060)));
        assert_eq!(Lsn::parse("nonsense"), None);
        assert_eq!(Lsn::parse("1FFFFFFFF/0"), None);
    }

    #[test]
    fn a_lease_runs_for_the_shorter_of_its_two_ends() {
        let now = UNIX_EPOCH + Duration::from_secs(1_000_000);
        let grant = LeaseGrant::starting(now, Duration::from_secs(4));
        assert_eq!(grant.remaining_at(now), Duration::from_secs(4));
        // Arriving late: only what is left by the wall clock.
        assert_eq!(
            grant.remaining_at(now + Duration::from_secs(3)),
            Duration::from_secs(1)
        );
        // Arriving after its end: nothing.
        assert_eq!(
            grant.remaining_at(now + Duration::from_secs(5)),
            Duration::ZERO
        );
        // A clock behind the operator's cannot stretch it past its duration.
        assert_eq!(
            grant.remaining_at(now - Duration::from_secs(60)),
            Duration::from_secs(4)
        );
    }

    #[test]
    fn status_reports_round_trip() {
        let report = StatusReport {
            instance: "db-1".into(),
            role: Some(RunningRole::Primary),
            ready: true,
            lease_remaining_ms: Some(3000),
            server: Some(ServerStatus {
                lsn: Some("0/3000060".into()),
                ..ServerStatus::default()
            }),
            ..StatusReport::default()
        };
        let json = serde_json::to_value(&report).expect("serialises");
        assert_eq!(json["role"], "primary");
        assert_eq!(json["leaseRemainingMs"], 3000);
        let back: StatusReport = serde_json::from_value(json).expect("deserialises");
        assert_eq!(back, report);
    }

    #[test]
    fn slot_names_are_identifiers() {
        assert_eq!(slot_name("Orders-2"), "castellan_orders_2");
    }
}

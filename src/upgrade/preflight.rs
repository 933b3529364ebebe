//! The pre-flight judgements of `upgrade run`, pure: how the data files are carried
//! (reflinks on btrfs, else a copy), whether a copy fits, whether the old cluster was
//! shut down cleanly, which checksum setting the new cluster gets, and whether each
//! set of binaries is the major it should be. The shell asks the system; these say
//! yes or no, and why.

use super::report::Method;
use crate::instance::bootstrap::{Checksums, control_field};
use crate::instance::version::{major_of, release_of};

/// `statfs(2)`'s `f_type` of a btrfs filesystem (`BTRFS_SUPER_MAGIC`).
pub const BTRFS_MAGIC: i64 = 0x9123_683E;

/// `--clone` where the volume is btrfs (reflinks: seconds whatever the size, and the
/// old files stay as they were), `--copy` anywhere else. `--link` is never chosen: it
/// makes the old cluster unusable once the new one has started, and a rollback
/// must stay possible.
pub fn method_for(filesystem_magic: i64) -> Method {
    if filesystem_magic == BTRFS_MAGIC {
        Method::Clone
    } else {
        Method::Copy
    }
}

/// Why a copy of `data_bytes` does not fit in `free_bytes`, if it does not: the free
/// space must exceed the data plus 10 % (the new cluster's own files, WAL written
/// while it first starts).
pub fn space_refusal(data_bytes: u64, free_bytes: u64) -> Option<String> {
    let needed = data_bytes.saturating_add(data_bytes / 10);
    (free_bytes <= needed).then(|| {
        format!(
            "not enough free space to copy the data: pgdata holds {} and a copy needs \
             more than {} free (the data plus 10 %), but the volume has {} free; grow \
             the volume or use a btrfs pool (where the upgrade clones and needs no space \
             up front)",
            mib(data_bytes),
            mib(needed),
            mib(free_bytes)
        )
    })
}

fn mib(bytes: u64) -> String {
    format!("{} MiB", bytes.div_ceil(1 << 20))
}

/// Where a slot's database OID sits in `pg_replslot/<slot>/state`
/// (`ReplicationSlotOnDisk`: magic, checksum, version and length, four bytes each, then
/// `ReplicationSlotPersistentData`: the name, 64 bytes, then the database), the same
/// from 15 to 18. A physical slot names no database (0).
const SLOT_DATABASE_OFFSET: usize = 16 + 64;

/// Whether a slot's state file is a logical slot's (it names a database); `None` when
/// the file is too short to say.
pub fn is_logical_slot(state: &[u8]) -> Option<bool> {
    let bytes = state.get(SLOT_DATABASE_OFFSET..SLOT_DATABASE_OFFSET + 4)?;
    Some(u32::from_le_bytes(bytes.try_into().ok()?) != 0)
}

/// Why the upgrade stops for the logical replication slots `logical` (and slots whose
/// kind could not be read, `unreadable`), if it does: pg_upgrade carries logical slots
/// only from a cluster of 17 or later and drops older ones without a word, which would
/// silently break their subscribers.
pub fn logical_slots_refusal(
    from: &str,
    logical: &[String],
    unreadable: &[String],
) -> Option<String> {
    let from_major: u32 = from.parse().ok()?;
    if from_major >= 17 || (logical.is_empty() && unreadable.is_empty()) {
        return None;
    }
    let mut reasons = Vec::new();
    if !logical.is_empty() {
        reasons.push(format!(
            "pgdata has logical replication slots ({}), which pg_upgrade does not carry from \
             PostgreSQL {from} (only from 17 on): their subscribers would lose their place \
             without a word; drop them (pg_drop_replication_slot) and make them again after \
             the upgrade",
            logical.join(", ")
        ));
    }
    if !unreadable.is_empty() {
        reasons.push(format!(
            "the kind of replication slots {} could not be read from pg_replslot, so it is \
             not known whether pg_upgrade would drop them",
            unreadable.join(", ")
        ));
    }
    Some(reasons.join("; "))
}

/// What `upgrade run` needs from the old cluster's control file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Control {
    /// "Database cluster state".
    pub state: String,
    /// "Data page checksum version": 0 when checksums are off.
    pub checksum_version: u32,
}

/// Reads [`Control`] from `pg_controldata`'s report; the error names what is missing.
pub fn read_control(report: &str) -> Result<Control, String> {
    let field = |label: &str| {
        control_field(report, label)
            .ok_or_else(|| format!("pg_controldata's report has no \"{label}\" line"))
    };
    let state = field("Database cluster state:")?;
    let checksums = field("Data page checksum version:")?;
    let checksum_version = checksums.parse().map_err(|_| {
        format!("pg_controldata's data page checksum version is not a number: {checksums}")
    })?;
    Ok(Control {
        state,
        checksum_version,
    })
}

/// Why the old cluster cannot be upgraded as it was stopped, if it cannot: only a
/// cluster shut down cleanly as a primary can (pg_upgrade's own rule, said before
/// anything is made).
pub fn shutdown_refusal(control: &Control) -> Option<String> {
    match control.state.as_str() {
        "shut down" => None,
        "shut down in recovery" => Some(
            "pgdata was shut down as a standby (\"shut down in recovery\"): upgrade the \
             primary's data directory"
                .to_owned(),
        ),
        state => Some(format!(
            "pgdata was not shut down cleanly (its control file says \"{state}\"): start \
             the old server and stop it with a fast shutdown first"
        )),
    }
}

/// The new cluster's checksum setting, the old one's: pg_upgrade refuses a mismatch,
/// and PostgreSQL 18's initdb turns them on unless told not to.
pub fn checksums_for(control: &Control, new_major: &str) -> Checksums {
    match (control.checksum_version, new_major.parse::<u32>()) {
        (0, Ok(major)) if major >= 18 => Checksums::Off,
        (0, _) => Checksums::Default,
        _ => Checksums::On,
    }
}

/// Why binaries that answered `postgres --version` with `output` cannot serve as
/// `role` (old or new) for major `expected`, if they cannot.
pub fn binaries_refusal(role: &str, output: &str, expected: &str) -> Option<String> {
    match release_of(output) {
        Some(release) if major_of(&release) == expected => None,
        Some(release) => Some(format!(
            "the {role} binaries are PostgreSQL {release}, not {expected}"
        )),
        None => Some(format!(
            "the {role} binaries' postgres --version says {:?}, not a PostgreSQL release",
            output.trim()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn btrfs_clones_and_everything_else_copies() {
        assert_eq!(method_for(0x9123_683E), Method::Clone);
        assert_eq!(method_for(0xEF53), Method::Copy, "ext4");
        assert_eq!(method_for(0x5846_5342), Method::Copy, "xfs");
        assert_eq!(method_for(0x0102_1994), Method::Copy, "tmpfs");
    }

    #[test]
    fn a_copy_needs_the_data_plus_ten_percent_free() {
        let gib = 1u64 << 30;
        assert_eq!(space_refusal(gib, 2 * gib), None);
        assert_eq!(space_refusal(gib, gib + gib / 10 + 1), None);
        let refused = space_refusal(gib, gib + gib / 10).unwrap_or_default();
        assert!(
            refused.contains("1024 MiB") && refused.contains("1127 MiB"),
            "{refused}"
        );
        assert!(space_refusal(gib, 0).is_some());
        assert!(space_refusal(u64::MAX, u64::MAX).is_some(), "no overflow");
        assert_eq!(space_refusal(0, 1), None);
    }

    const REPORT_15: &str = "pg_control version number:            1300\n\
        Catalog version number:               202209061\n\
        Database system identifier:           7437020180412345678\n\
        Database cluster state:               shut down\n\
        Latest checkpoint location:           0/1A2B3C4\n\
        Data page checksum version:           1\n";

    #[test]
    fn the_control_file_says_the_state_and_the_checksums() {
        assert_eq!(
            read_control(REPORT_15),
            Ok(Control {
                state: "shut down".into(),
                checksum_version: 1
            })
        );
        let missing = read_control("Database cluster state: shut down\n");
        assert!(
            missing
                .as_ref()
                .is_err_and(|e| e.contains("Data page checksum version")),
            "{missing:?}"
        );
        let garbage = REPORT_15.replace("version:           1", "version:           x");
        assert!(read_control(&garbage).is_err());
    }

    #[test]
    fn only_a_clean_primary_shutdown_is_upgraded() {
        let control = |state: &str| Control {
            state: state.into(),
            checksum_version: 1,
        };
        assert_eq!(shutdown_refusal(&control("shut down")), None);
        let standby = shutdown_refusal(&control("shut down in recovery")).unwrap_or_default();
        assert!(standby.contains("standby"), "{standby}");
        let crashed = shutdown_refusal(&control("in production")).unwrap_or_default();
        assert!(crashed.contains("\"in production\""), "{crashed}");
    }

    #[test]
    fn the_new_cluster_keeps_the_old_checksum_setting() {
        let with = |version| Control {
            state: "shut down".into(),
            checksum_version: version,
        };
        assert_eq!(checksums_for(&with(1), "18"), Checksums::On);
        assert_eq!(checksums_for(&with(0), "18"), Checksums::Off);
        assert_eq!(checksums_for(&with(0), "17"), Checksums::Default);
        assert_eq!(checksums_for(&with(1), "16"), Checksums::On);
    }

    #[test]
    fn binaries_must_be_the_major_of_their_side() {
        assert_eq!(
            binaries_refusal("new", "postgres (PostgreSQL) 18.4\n", "18"),
            None
        );
        let wrong =
            binaries_refusal("old", "postgres (PostgreSQL) 16.2\n", "15").unwrap_or_default();
        assert_eq!(wrong, "the old binaries are PostgreSQL 16.2, not 15");
        assert!(binaries_refusal("new", "bash: postgres: not found", "18").is_some());
    }

    fn slot_state(database: u32) -> Vec<u8> {
        let mut state = vec![0u8; SLOT_DATABASE_OFFSET];
        state[..4].copy_from_slice(&0x0105_1CA1_u32.to_le_bytes());
        state.extend_from_slice(&database.to_le_bytes());
        state.extend_from_slice(&[0; 64]);
        state
    }

    #[test]
    fn logical_slots_stop_an_upgrade_from_before_17() {
        assert_eq!(is_logical_slot(&slot_state(0)), Some(false));
        assert_eq!(is_logical_slot(&slot_state(16_384)), Some(true));
        assert_eq!(is_logical_slot(&[0; 10]), None);
        let sub = vec!["shop_sub".to_owned()];
        let refused = logical_slots_refusal("15", &sub, &[]).unwrap_or_default();
        assert!(
            refused.contains("shop_sub") && refused.contains("only from 17"),
            "{refused}"
        );
        assert_eq!(
            logical_slots_refusal("17", &sub, &[]),
            None,
            "carried from 17"
        );
        assert_eq!(
            logical_slots_refusal("15", &[], &[]),
            None,
            "physical ones only"
        );
        let unknown = logical_slots_refusal("16", &[], &["odd".to_owned()]).unwrap_or_default();
        assert!(unknown.contains("odd"), "{unknown}");
    }
}

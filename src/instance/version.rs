//! The PostgreSQL release the instance's binaries carry, against the major version the
//! cluster asks for (`spec.version`). A pod must never run another major than the one
//! asked for: an image of the wrong major would initialise, copy or start data of that
//! major silently (a cluster created with `version: "17"` ran PostgreSQL 15). So the
//! manager asks its `postgres` once at start and, on a mismatch, touches no data and
//! starts nothing, and says why; the operator reports what the instances really run in
//! `status.version`.

use super::bootstrap::{Binaries, BootstrapError};

/// The release `postgres --version` names, such as `15.18` or `18.1` (`None` when the
/// output names none).
pub fn release_of(output: &str) -> Option<String> {
    // "postgres (PostgreSQL) 15.18 (Debian 15.18-0+deb12u1)"
    let after = output.split("(PostgreSQL)").nth(1)?;
    let release = after.split_whitespace().next()?;
    release
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_digit())
        .then(|| release.to_owned())
}

/// The major version of a release: its first number (PostgreSQL 10 and later).
pub fn major_of(release: &str) -> &str {
    release
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap_or(release)
}

/// Why these binaries must not run for a cluster that asks for `asked`, if they must
/// not.
pub fn refusal(asked: Option<&str>, release: &str) -> Option<String> {
    let asked = asked?;
    let carried = major_of(release);
    (carried != asked).then(|| {
        format!(
            "this instance's image carries PostgreSQL {release}, but the cluster asks for version {asked}: \
             nothing is initialised, copied or started with another major version; \
             give the operator an image with PostgreSQL {asked}"
        )
    })
}

/// How data of major `held` and binaries of `release` differ, if they do: such data is
/// never started (PostgreSQL would refuse it anyway). A replica's is replaced by a
/// fresh copy of the primary (after a major upgrade, the replicas' volumes still hold
/// the old major); a primary's is never touched: the operator upgrades it
/// (`castellan upgrade run`) or rolls back to an image of its major.
pub fn data_mismatch(held: &str, release: &str) -> Option<String> {
    let carried = major_of(release);
    (carried != held).then(|| {
        format!(
            "the data directory holds PostgreSQL {held} data, but this instance's image carries \
             PostgreSQL {release}"
        )
    })
}

/// The major of the data in `data_dir` (its `PG_VERSION`), when it holds a cluster.
pub async fn data_major(data_dir: &std::path::Path) -> Option<String> {
    tokio::fs::read_to_string(data_dir.join("PG_VERSION"))
        .await
        .ok()
        .map(|held| held.trim().to_owned())
}

/// The release of the binaries, asked once at start (`postgres --version`).
pub async fn release(binaries: &Binaries) -> Result<String, BootstrapError> {
    let output = binaries.run("postgres", &["--version"], &[]).await?;
    Ok(release_of(&output).unwrap_or_else(|| output.trim().to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_release_is_read_from_postgres_version() {
        assert_eq!(
            release_of("postgres (PostgreSQL) 15.18 (Debian 15.18-0+deb12u1)\n").as_deref(),
            Some("15.18")
        );
        assert_eq!(
            release_of("postgres (PostgreSQL) 18.1\n").as_deref(),
            Some("18.1")
        );
        assert_eq!(release_of("postgres (PostgreSQL) devel"), None);
        assert_eq!(release_of("something else"), None);
        assert_eq!(major_of("15.18"), "15");
        assert_eq!(major_of("18beta1"), "18");
    }

    #[test]
    fn data_of_another_major_than_the_binaries_is_a_mismatch() {
        assert_eq!(data_mismatch("18", "18.4"), None);
        let mismatch = data_mismatch("15", "18.4").unwrap_or_default();
        assert!(
            mismatch.contains("PostgreSQL 15 data") && mismatch.contains("PostgreSQL 18.4"),
            "{mismatch}"
        );
    }

    #[test]
    fn only_the_major_asked_for_may_run() {
        assert_eq!(refusal(Some("15"), "15.18"), None);
        assert_eq!(
            refusal(None, "15.18"),
            None,
            "nothing asked: nothing to refuse"
        );
        let refused = refusal(Some("17"), "15.18").unwrap_or_default();
        assert!(
            refused.contains("carries PostgreSQL 15.18") && refused.contains("version 17"),
            "{refused}"
        );
        assert!(refusal(Some("18"), "18.1").is_none());
        assert!(refusal(Some("1"), "15.18").is_some(), "15 is not 1");
    }
}

//! How long backups are kept: shared by `DatabaseCluster.spec.backup` and
//! `BackupSchedule.spec`, so both say it the same way.

use kube::KubeSchema;
use serde::{Deserialize, Serialize};

/// Backups are removed once they fall outside both limits that are given; with neither
/// given, nothing is removed. The newest successful backup is never removed, because it
/// is the only way back.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Retention {
    /// Keep at least this many of the newest successful backups.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 1").message("retention.keepLast must be at least 1"))]
    pub keep_last: Option<i32>,

    /// Remove backups older than this: a whole number of hours, days or weeks (`36h`,
    /// `30d`, `8w`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 16))]
    #[x_kube(validation = Rule::new("self.matches('^[1-9][0-9]*[hdw]$')").message("retention.maxAge must be a whole number of hours, days or weeks, such as 36h, 30d or 8w"))]
    pub max_age: Option<String>,
}

impl Retention {
    /// `maxAge` as a duration: `None` when it is not given, an error when it is not a
    /// whole number of hours, days or weeks (admission refuses those, so an error means
    /// the object bypassed validation, or the number overflows).
    pub fn max_age(&self) -> Option<Result<std::time::Duration, String>> {
        let text = self.max_age.as_deref()?;
        Some(parse_age(text).ok_or_else(|| {
            format!(
                "retention.maxAge {text:?} is not a whole number of hours, days or weeks (36h, 30d, 8w)"
            )
        }))
    }

    /// Whether any limit is given: without one, nothing is removed.
    pub fn limits_anything(&self) -> bool {
        self.keep_last.is_some() || self.max_age.is_some()
    }
}

fn parse_age(text: &str) -> Option<std::time::Duration> {
    const HOUR: u64 = 3600;
    let unit = match text.chars().last()? {
        'h' => HOUR,
        'd' => 24 * HOUR,
        'w' => 7 * 24 * HOUR,
        _ => return None,
    };
    let number = &text[..text.len() - 1];
    if number.is_empty() || number.starts_with('0') || !number.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let count: u64 = number.parse().ok()?;
    Some(std::time::Duration::from_secs(count.checked_mul(unit)?))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::Retention;

    fn max_age(text: &str) -> Option<Result<Duration, String>> {
        Retention {
            keep_last: None,
            max_age: Some(text.to_owned()),
        }
        .max_age()
    }

    #[test]
    fn max_age_reads_hours_days_and_weeks() {
        assert_eq!(max_age("36h"), Some(Ok(Duration::from_secs(36 * 3600))));
        assert_eq!(max_age("30d"), Some(Ok(Duration::from_secs(30 * 86400))));
        assert_eq!(max_age("8w"), Some(Ok(Duration::from_secs(8 * 7 * 86400))));
        assert_eq!(Retention::default().max_age(), None);
    }

    #[test]
    fn max_age_refuses_what_admission_refuses_and_overflows() {
        for bad in [
            "",
            "h",
            "0d",
            "05d",
            "1.5d",
            "3m",
            "-1d",
            "99999999999999999999w",
        ] {
            assert!(
                matches!(max_age(bad), Some(Err(_))),
                "{bad:?} should be refused"
            );
        }
    }
}

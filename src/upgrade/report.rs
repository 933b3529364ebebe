//! What `castellan upgrade` tells the operator, and what it leaves on the volume.
//!
//! Every subcommand ends by printing one [`Report`] as the LAST line of stdout (the
//! logs go to stderr): the operator's upgrade pod reads the pod's log tail and takes
//! the last line that parses ([`Report::from_log`]). Both sides use these types, so the
//! contract lives in one place. `upgrade.json` ([`Record`]) beside the data directory
//! says what the last upgrade did, for people and for a later rollback.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// How a subcommand ended. Only `failed` exits non-zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Outcome {
    /// `upgrade export`: the old installation is in the shared directory.
    Exported,
    /// `upgrade run`: `pgdata` holds the new major, `pgdata-previous` the old one.
    Upgraded,
    /// `upgrade rollback`: `pgdata` holds the old major again.
    RolledBack,
    /// `upgrade forget-previous`: the old data directory is gone.
    Forgotten,
    /// Nothing was changed that a re-run or the old server cannot use: see `message`.
    Failed,
}

/// How pg_upgrade carried the data files over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    /// `--clone`: reflinks (btrfs), in seconds whatever the size; the old files are
    /// untouched and share their blocks until either side writes.
    Clone,
    /// `--copy`: every file copied, needing as much free space again.
    Copy,
}

impl Method {
    pub fn flag(self) -> &'static str {
        match self {
            Method::Clone => "--clone",
            Method::Copy => "--copy",
        }
    }
}

/// The last line of stdout: `{"outcome":"upgraded","method":"clone","seconds":1.4,
/// "message":"…"}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub outcome: Outcome,
    /// `null` where no data files were carried (export, rollback, forget, and failures
    /// before the method was chosen).
    pub method: Option<Method>,
    /// Wall time of the subcommand, to a tenth of a second.
    pub seconds: f64,
    /// What was done, or what was being done to what and why it failed.
    pub message: String,
}

impl Report {
    pub fn new(
        outcome: Outcome,
        method: Option<Method>,
        took: Duration,
        message: impl Into<String>,
    ) -> Self {
        Self {
            outcome,
            method,
            seconds: tenths(took),
            message: message.into(),
        }
    }

    /// The line to print: one JSON object, no newline inside (serde_json escapes the
    /// message's).
    pub fn line(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|error| {
            // Not reachable with these field types; still a line the operator parses.
            format!(
                r#"{{"outcome":"failed","method":null,"seconds":0,"message":"the report could not be written: {error}"}}"#
            )
        })
    }

    /// The report in a pod's log: its last line that is one (the operator reads the
    /// upgrade pod's log tail).
    pub fn from_log(log: &str) -> Option<Self> {
        log.lines()
            .rev()
            .find_map(|line| serde_json::from_str(line.trim()).ok())
    }

    pub fn succeeded(&self) -> bool {
        self.outcome != Outcome::Failed
    }
}

/// `upgrade.json` beside the data directories.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Record {
    pub from: String,
    pub to: String,
    pub method: Method,
    /// How long `upgrade run` took until the new data directory was complete.
    pub seconds: f64,
    /// When the new data directory became `pgdata` (RFC 3339); absent in the marker
    /// written just before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<String>,
    /// When `upgrade rollback` put the old data directory back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rolled_back_at: Option<String>,
}

fn tenths(took: Duration) -> f64 {
    (took.as_secs_f64() * 10.0).round() / 10.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_line_is_one_json_object_the_operator_reads_back() {
        let report = Report::new(
            Outcome::Upgraded,
            Some(Method::Clone),
            Duration::from_millis(1_449),
            "upgraded pgdata from PostgreSQL 15 to 18\nwith --clone",
        );
        let line = report.line();
        assert!(!line.contains('\n'), "{line}");
        let json: serde_json::Value = serde_json::from_str(&line).expect("JSON");
        assert_eq!(json["outcome"], "upgraded");
        assert_eq!(json["method"], "clone");
        assert_eq!(json["seconds"], 1.4);
        let log = format!("{{\"level\":\"INFO\",\"fields\":{{}}}}\nsome output\n{line}\n\n");
        assert_eq!(Report::from_log(&log), Some(report));
    }

    #[test]
    fn every_outcome_has_its_contract_name_and_a_failure_has_no_method() {
        let names = [
            (Outcome::Exported, "exported"),
            (Outcome::Upgraded, "upgraded"),
            (Outcome::RolledBack, "rolled-back"),
            (Outcome::Forgotten, "forgotten"),
            (Outcome::Failed, "failed"),
        ];
        for (outcome, name) in names {
            let line = Report::new(outcome, None, Duration::ZERO, "m").line();
            assert!(
                line.starts_with(&format!(r#"{{"outcome":"{name}","method":null,"#)),
                "{line}"
            );
            assert_eq!(
                Report::new(outcome, None, Duration::ZERO, "m").succeeded(),
                outcome != Outcome::Failed
            );
        }
        assert_eq!(Report::from_log("no report here\n"), None);
    }

    #[test]
    fn the_record_names_its_fields_in_camel_case() {
        let record = Record {
            from: "15".into(),
            to: "18".into(),
            method: Method::Copy,
            seconds: 3.2,
            finished_at: Some("2026-12-03T10:00:00Z".into()),
            rolled_back_at: None,
        };
        let json = serde_json::to_value(&record).expect("JSON");
        assert_eq!(json["finishedAt"], "2026-12-03T10:00:00Z");
        assert_eq!(json["method"], "copy");
        assert!(json.get("rolledBackAt").is_none());
    }
}

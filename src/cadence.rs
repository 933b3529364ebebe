//! Cron schedules read in a time zone: when a `BackupSchedule` makes a Backup, and when
//! the node agent scrubs a pool. Five fields only (a sixth, seconds, as CloudNativePG's
//! cron has, would silently mean something else than the user read); croner with jiff's
//! time zones.

use croner::Cron;
use croner::errors::CronError;
use croner::parser::{CronParser, Seconds, Year};
use jiff::Timestamp;
use jiff::tz::TimeZone;

/// A cron expression that parsed, read in a time zone that exists.
pub struct Cadence {
    cron: Cron,
    zone: TimeZone,
}

impl Cadence {
    /// Parses a schedule and its time zone (UTC when none), and makes sure it fires at
    /// all after `now` (`0 0 31 2 *` parses but never fires). The error says what is
    /// wrong for a person to fix.
    pub fn parse(schedule: &str, time_zone: Option<&str>, now: Timestamp) -> Result<Self, String> {
        // Five fields only: a sixth (seconds, as CloudNativePG's cron has) would
        // silently mean something else than the user read.
        let parser = CronParser::builder()
            .seconds(Seconds::Disallowed)
            .year(Year::Disallowed)
            .build();
        let cron = parser.parse(schedule).map_err(|error| {
            // croner's field errors do not say which field ("Number out of bounds"):
            // the ranges let a person find it.
            let ranges = match error {
                CronError::ComponentError(_) | CronError::IllegalCharacters(_) => {
                    " (minute 0-59, hour 0-23, day of month 1-31, month 1-12 or JAN-DEC, \
                     day of week 0-7 or SUN-SAT)"
                }
                _ => "",
            };
            format!(
                "schedule {:?} is not a five-field cron expression or a macro such as @daily: {error}{ranges}",
                schedule
            )
        })?;
        let zone = match time_zone {
            None => TimeZone::UTC,
            Some(name) => TimeZone::get(name).map_err(|error| {
                format!(
                    "timeZone {name:?} is not an IANA time zone (such as Europe/Berlin): {error}"
                )
            })?,
        };
        let cadence = Self { cron, zone };
        cadence
            .next_after(now)
            .map_err(|error| format!("schedule {:?} never fires: {error}", schedule))?;
        Ok(cadence)
    }

    /// `time` in the schedule's time zone, for people (`2026-03-01 03:00 CET`).
    pub fn local(&self, time: Timestamp) -> String {
        time.to_zoned(self.zone.clone())
            .strftime("%Y-%m-%d %H:%M %Z")
            .to_string()
    }

    /// The first slot strictly after `time`.
    pub fn next_after(&self, time: Timestamp) -> Result<Timestamp, CronError> {
        self.cron
            .find_next_occurrence(&time.to_zoned(self.zone.clone()), false)
            .map(|slot| slot.timestamp())
    }

    /// The latest slot at or before `time`.
    pub fn latest_at(&self, time: Timestamp) -> Result<Timestamp, CronError> {
        self.cron
            .find_previous_occurrence(&time.to_zoned(self.zone.clone()), true)
            .map(|slot| slot.timestamp())
    }

    /// The latest slot strictly before `time`.
    pub fn latest_before(&self, time: Timestamp) -> Result<Timestamp, CronError> {
        self.cron
            .find_previous_occurrence(&time.to_zoned(self.zone.clone()), false)
            .map(|slot| slot.timestamp())
    }
}

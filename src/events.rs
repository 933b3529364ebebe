//! Kubernetes Events, shared by the operator and the agent: their notes ([`note`]) and
//! the [`Recorder`] that publishes them.
//!
//! The Recorder folds an Event repeated within [`SERIES_TTL`] (same type, reason,
//! action, object and related object) into a series on the first one, as
//! `events.k8s.io/v1` intends and as kube's own recorder does. Unlike kube's, what it
//! remembers for that is bounded: at most [`MAX_SERIES`] small entries, the oldest
//! forgotten first (an Event then starts a new series, nothing is lost), and the
//! table shrinks again after a burst. kube's keeps a whole Event per key for six
//! minutes in a map that never shrinks: 1.5 MiB of the operator's heap after 100
//! clusters were created, measured with heaptrack (docs/benchmarks.md).

use std::collections::HashMap;
use std::sync::Mutex;

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event as K8sEvent, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::Client;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType, Reporter};
use serde_json::json;

/// The longest note the API server takes (an Event's `note`, 1 kB).
pub const MAX_NOTE: usize = 1024;

/// `message` as an Event's note: cut to at most [`MAX_NOTE`] bytes at a character
/// boundary, marked with `…` when cut (the whole message stays in the status or log
/// that carries it).
pub fn note(message: &str) -> String {
    within(message, MAX_NOTE)
}

fn within(message: &str, limit: usize) -> String {
    if message.len() <= limit {
        return message.to_owned();
    }
    let ellipsis = "…";
    let mut end = limit - ellipsis.len();
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{ellipsis}", &message[..end])
}

/// How long a repeated Event joins the series of the first one.
pub const SERIES_TTL: SignedDuration = SignedDuration::from_mins(6);
/// The most series remembered at once.
pub const MAX_SERIES: usize = 256;

/// Publishes Events for one reporting component (controller and instance).
pub struct Recorder {
    client: Client,
    reporter: Reporter,
    series: Mutex<Series>,
}

impl Recorder {
    pub fn new(client: Client, reporter: Reporter) -> Self {
        Self {
            client,
            reporter,
            series: Mutex::new(Series::default()),
        }
    }

    /// Creates `event` about `regarding`, or adds it to the series of the same Event
    /// published within [`SERIES_TTL`]. Events about cluster-scoped objects go to
    /// `default`.
    pub async fn publish(
        &self,
        event: &Event,
        regarding: &ObjectReference,
    ) -> Result<(), kube::Error> {
        let key = Key::of(event, regarding);
        let now = Timestamp::now();
        let namespace = namespace_of(regarding);
        let events: Api<K8sEvent> = Api::namespaced(self.client.clone(), namespace);
        let repeated = self.series().repeat(&key, now);
        if let Some((name, count)) = repeated {
            let patch = json!({"series": EventSeries {
                count,
                last_observed_time: MicroTime(now),
            }});
            match events
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => return Ok(()),
                // The series' Event is gone (deleted, or expired by the API server):
                // this one starts a new series rather than failing until ours expires.
                Err(kube::Error::Api(status)) if status.code == 404 => self.series().forget(&key),
                Err(error) => return Err(error),
            }
        }
        let created = events
            .create(
                &PostParams::default(),
                &self.event(event, regarding, namespace, now),
            )
            .await?;
        let name = created.metadata.name.unwrap_or_default();
        self.series().started(key, name, now);
        Ok(())
    }

    fn series(&self) -> std::sync::MutexGuard<'_, Series> {
        match self.series.lock() {
            Ok(series) => series,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    fn event(
        &self,
        event: &Event,
        regarding: &ObjectReference,
        namespace: &str,
        now: Timestamp,
    ) -> K8sEvent {
        let instance = self
            .reporter
            .instance
            .clone()
            .unwrap_or_else(|| self.reporter.controller.clone());
        K8sEvent {
            metadata: ObjectMeta {
                namespace: Some(namespace.to_owned()),
                name: Some(format!(
                    "{}.{:x}",
                    regarding
                        .name
                        .as_deref()
                        .unwrap_or(&self.reporter.controller),
                    now.as_nanosecond()
                )),
                ..ObjectMeta::default()
            },
            action: Some(event.action.clone()),
            reason: Some(event.reason.clone()),
            note: event.note.clone(),
            event_time: Some(MicroTime(now)),
            regarding: Some(regarding.clone()),
            related: event.secondary.clone(),
            reporting_controller: Some(self.reporter.controller.clone()),
            reporting_instance: Some(instance),
            type_: Some(
                match event.type_ {
                    EventType::Normal => "Normal",
                    EventType::Warning => "Warning",
                }
                .to_owned(),
            ),
            ..K8sEvent::default()
        }
    }
}

/// Where an Event about `regarding` is filed: its namespace, or `default` for a
/// cluster-scoped object (a PersistentVolume, a StoragePool, a BlockDevice), where
/// `kubectl describe` looks for it.
pub fn namespace_of(regarding: &ObjectReference) -> &str {
    regarding.namespace.as_deref().unwrap_or("default")
}

/// What makes two Events one series.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Key {
    warning: bool,
    reason: String,
    action: String,
    regarding: (
        Option<String>,
        Option<String>,
        Option<String>,
        Option<String>,
    ),
    related: Option<(Option<String>, Option<String>, Option<String>)>,
}

impl Key {
    fn of(event: &Event, regarding: &ObjectReference) -> Self {
        Self {
            warning: matches!(event.type_, EventType::Warning),
            reason: event.reason.clone(),
            action: event.action.clone(),
            regarding: (
                regarding.kind.clone(),
                regarding.namespace.clone(),
                regarding.name.clone(),
                regarding.uid.clone(),
            ),
            related: event.secondary.as_ref().map(|related| {
                (
                    related.kind.clone(),
                    related.namespace.clone(),
                    related.name.clone(),
                )
            }),
        }
    }
}

/// A series under way: its Event's name, how many it counts, when it was last seen.
#[derive(Debug)]
struct Entry {
    name: String,
    count: i32,
    last: Timestamp,
}

/// The series remembered, at most [`MAX_SERIES`], none older than [`SERIES_TTL`].
#[derive(Debug, Default)]
struct Series {
    entries: HashMap<Key, Entry>,
}

impl Series {
    /// `key` seen again at `now`: the Event to add it to and its new count, if its
    /// series is still open.
    fn repeat(&mut self, key: &Key, now: Timestamp) -> Option<(String, i32)> {
        self.forget_expired(now);
        let entry = self.entries.get_mut(key)?;
        entry.count += 1;
        entry.last = now;
        Some((entry.name.clone(), entry.count))
    }

    /// `key`'s series ended early (its Event is gone).
    fn forget(&mut self, key: &Key) {
        self.entries.remove(key);
    }

    /// A new Event named `name` was created for `key`.
    fn started(&mut self, key: Key, name: String, now: Timestamp) {
        self.forget_expired(now);
        if self.entries.len() >= MAX_SERIES
            && let Some(oldest) = self
                .entries
                .iter()
                .min_by_key(|(_, entry)| entry.last)
                .map(|(key, _)| key.clone())
        {
            self.entries.remove(&oldest);
        }
        self.entries.insert(
            key,
            Entry {
                name,
                count: 1,
                last: now,
            },
        );
    }

    fn forget_expired(&mut self, now: Timestamp) {
        self.entries
            .retain(|_, entry| entry.last + SERIES_TTL > now);
        // A burst's table is given back once it is mostly empty.
        if self.entries.capacity() > 4 * self.entries.len().max(16) {
            self.entries.shrink_to(2 * self.entries.len());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(reason: &str, name: &str) -> Key {
        let event = Event {
            type_: EventType::Normal,
            reason: reason.into(),
            note: None,
            action: "Act".into(),
            secondary: None,
        };
        let regarding = ObjectReference {
            kind: Some("DatabaseCluster".into()),
            namespace: Some("shop".into()),
            name: Some(name.into()),
            ..ObjectReference::default()
        };
        Key::of(&event, &regarding)
    }

    fn at(seconds: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + seconds).expect("a valid time")
    }

    #[test]
    fn a_repeated_event_joins_its_series_until_the_series_expires() {
        let mut series = Series::default();
        assert_eq!(series.repeat(&key("Created", "a"), at(0)), None);
        series.started(key("Created", "a"), "a.1".into(), at(0));
        assert_eq!(
            series.repeat(&key("Created", "a"), at(10)),
            Some(("a.1".into(), 2))
        );
        assert_eq!(
            series.repeat(&key("Created", "a"), at(20)),
            Some(("a.1".into(), 3))
        );
        // Another reason or object is another series.
        assert_eq!(series.repeat(&key("Deleted", "a"), at(20)), None);
        assert_eq!(series.repeat(&key("Created", "b"), at(20)), None);
        // Quiet for the TTL since the last one: a new Event.
        let later = 20 + SERIES_TTL.as_secs();
        assert_eq!(series.repeat(&key("Created", "a"), at(later)), None);
        assert!(series.entries.is_empty());
    }

    #[test]
    fn a_series_whose_event_is_gone_starts_again() {
        let mut series = Series::default();
        series.started(key("Created", "a"), "a.1".into(), at(0));
        assert!(series.repeat(&key("Created", "a"), at(1)).is_some());
        series.forget(&key("Created", "a"));
        assert_eq!(series.repeat(&key("Created", "a"), at(2)), None);
    }

    #[test]
    fn at_most_max_series_are_remembered_the_oldest_forgotten_first() {
        let mut series = Series::default();
        for i in 0..MAX_SERIES + 10 {
            series.started(
                key("Created", &format!("c{i}")),
                format!("c{i}.1"),
                at(i as i64),
            );
        }
        assert_eq!(series.entries.len(), MAX_SERIES);
        assert_eq!(series.repeat(&key("Created", "c0"), at(300)), None);
        assert_eq!(series.repeat(&key("Created", "c9"), at(300)), None);
        assert!(
            series
                .repeat(&key("Created", &format!("c{}", MAX_SERIES + 9)), at(300))
                .is_some()
        );
    }

    #[test]
    fn the_table_shrinks_once_a_burst_has_expired() {
        let mut series = Series::default();
        for i in 0..MAX_SERIES {
            series.started(key("Created", &format!("c{i}")), format!("c{i}.1"), at(0));
        }
        let burst = series.entries.capacity();
        series.started(
            key("Created", "late"),
            "late.1".into(),
            at(SERIES_TTL.as_secs() + 1),
        );
        assert_eq!(series.entries.len(), 1);
        assert!(
            series.entries.capacity() < burst / 4,
            "{} of {burst}",
            series.entries.capacity()
        );
    }

    #[test]
    fn a_long_message_is_cut_to_what_an_event_takes() {
        assert_eq!(note("short"), "short");
        let long = "é".repeat(700);
        let cut = note(&long);
        assert!(cut.len() <= MAX_NOTE && cut.ends_with('…'), "{}", cut.len());
        assert!(long.starts_with(cut.trim_end_matches('…')));
    }
}

//! Which refusals the agent has already told the user about, so that an object gets
//! one Event per reason rather than one per pass, in bounded memory: an agent runs
//! for months on a node whose claims and pools come and go.

use std::collections::{BTreeSet, VecDeque};
use std::sync::Mutex;

/// How many (object, message) pairs are remembered; the oldest is forgotten first (and
/// would be reported once more if it came back).
const CAPACITY: usize = 1024;

/// (object uid, message) pairs already reported, at most `capacity` of them.
#[derive(Debug)]
pub struct Reported {
    capacity: usize,
    seen: Mutex<Seen>,
}

#[derive(Debug, Default)]
struct Seen {
    set: BTreeSet<(String, String)>,
    order: VecDeque<(String, String)>,
}

impl Default for Reported {
    fn default() -> Self {
        Self::with_capacity(CAPACITY)
    }
}

impl Reported {
    fn with_capacity(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            seen: Mutex::new(Seen::default()),
        }
    }

    /// Whether `message` is new for object `uid`, remembering it. A poisoned lock
    /// answers yes: one Event too many beats a refusal nobody hears of.
    pub fn first(&self, uid: &str, message: &str) -> bool {
        let Ok(mut seen) = self.seen.lock() else {
            return true;
        };
        let key = (uid.to_string(), message.to_string());
        if seen.set.contains(&key) {
            return false;
        }
        if seen.order.len() >= self.capacity
            && let Some(oldest) = seen.order.pop_front()
        {
            seen.set.remove(&oldest);
        }
        seen.set.insert(key.clone());
        seen.order.push_back(key);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_reason_once_per_object_and_the_oldest_forgotten_past_the_bound() {
        let reported = Reported::with_capacity(2);
        assert!(reported.first("a", "is mounted"));
        assert!(!reported.first("a", "is mounted"));
        assert!(reported.first("b", "is mounted"));
        assert!(reported.first("a", "has ext4"));
        // ("a", "is mounted") was the oldest of three: forgotten, so told again.
        assert!(reported.first("a", "is mounted"));
        assert!(!reported.first("a", "has ext4"));
        let seen = reported.seen.lock().expect("not poisoned");
        assert_eq!(seen.set.len(), 2);
        assert_eq!(seen.order.len(), 2);
    }
}

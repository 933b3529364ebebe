//! The note of a Kubernetes Event, shared by the operator and the agent: the API
//! server refuses a note over 1 kB, and an Event refused is a report lost, so every
//! note goes through [`note`].

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_message_is_cut_to_what_an_event_takes() {
        assert_eq!(note("short"), "short");
        let long = "é".repeat(700);
        let cut = note(&long);
        assert!(cut.len() <= MAX_NOTE && cut.ends_with('…'), "{}", cut.len());
        assert!(long.starts_with(cut.trim_end_matches('…')));
    }
}

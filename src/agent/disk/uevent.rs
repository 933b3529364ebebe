//! Uevents: the kernel's hotplug notifications for block devices, turned into
//! debounced "rescan now" triggers.
//!
//! It listens on a `NETLINK_KOBJECT_UEVENT` socket, multicast group 1 — the kernel's
//! own group, which needs neither udevd nor the host's network namespace (group 2 is
//! udevd's re-broadcast). It owns only the socket and the timing; it does not read
//! devices: a burst of events (a disk and its partitions, a loop attach's several
//! `change`s) becomes one trigger, and the rescan finds out what changed.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::Duration;

use nix::sys::socket::{
    AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, bind, recv, socket,
};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// The kernel's uevent multicast group.
const KERNEL_GROUP: u32 = 1;

/// A parsed kernel uevent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Uevent {
    pub action: String,
    pub subsystem: Option<String>,
    pub devname: Option<String>,
    pub devtype: Option<String>,
}

/// Parses a kernel uevent datagram: `action@devpath\0KEY=VALUE\0…`. Messages in
/// udevd's binary format (starting `libudev\0`) and anything else without the
/// `@` header are not kernel uevents and give `None`.
pub fn parse(datagram: &[u8]) -> Option<Uevent> {
    let mut fields = datagram
        .split(|byte| *byte == 0)
        .map(String::from_utf8_lossy);
    let header = fields.next()?;
    let (header_action, _devpath) = header.split_once('@')?;
    let mut event = Uevent {
        action: header_action.to_string(),
        subsystem: None,
        devname: None,
        devtype: None,
    };
    for field in fields {
        let Some((key, value)) = field.split_once('=') else {
            continue;
        };
        match key {
            "ACTION" => event.action = value.to_string(),
            "SUBSYSTEM" => event.subsystem = Some(value.to_string()),
            "DEVNAME" => event.devname = Some(value.to_string()),
            "DEVTYPE" => event.devtype = Some(value.to_string()),
            _ => {}
        }
    }
    Some(event)
}

/// Whether an event can change what discovery finds: any add, remove or change of a
/// block device (loop attach and detach arrive as `change`, not `add`).
pub fn is_relevant(event: &Uevent) -> bool {
    event.subsystem.as_deref() == Some("block")
        && matches!(event.action.as_str(), "add" | "remove" | "change")
}

/// How long to wait for a burst of events to end.
#[derive(Clone, Copy, Debug)]
pub struct Debounce {
    /// Fire once no event arrived for this long…
    pub quiet: Duration,
    /// …or this long after the first event of the burst, whichever is first, so a
    /// steady stream of events cannot postpone the rescan forever.
    pub max_delay: Duration,
}

impl Default for Debounce {
    fn default() -> Self {
        Self {
            quiet: Duration::from_millis(200),
            max_delay: Duration::from_secs(1),
        }
    }
}

impl Debounce {
    /// When a burst that started at `first` and last saw an event at `last` fires.
    pub fn deadline(&self, first: Instant, last: Instant) -> Instant {
        (last + self.quiet).min(first + self.max_delay)
    }
}

/// Why the listener stopped.
#[derive(Debug, thiserror::Error)]
pub enum UeventError {
    #[error("opening the kernel uevent socket (NETLINK_KOBJECT_UEVENT): {0}")]
    Open(nix::Error),
    #[error("joining the kernel uevent group {KERNEL_GROUP}: {0}")]
    Bind(nix::Error),
    #[error("starting the uevent thread: {0}")]
    Thread(io::Error),
    #[error("receiving kernel uevents: {0}")]
    Receive(io::Error),
}

/// An open, bound uevent socket. Opened before the first scan so that no event
/// between that scan and the listener's start is lost.
///
/// The socket is read by a blocking thread rather than through tokio's `AsyncFd`:
/// registering a raw descriptor with tokio is `unsafe` (tokio#8587), and the
/// workspace forbids unsafe code for a thread's worth of savings.
pub struct Listener {
    socket: OwnedFd,
}

impl Listener {
    pub fn open() -> Result<Self, UeventError> {
        let socket = socket(
            AddressFamily::Netlink,
            SockType::Datagram,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::NetlinkKObjectUEvent,
        )
        .map_err(UeventError::Open)?;
        // Port 0: the kernel assigns one, so several agents on one host (three dev
        // nodes) can each listen.
        bind(socket.as_raw_fd(), &NetlinkAddr::new(0, KERNEL_GROUP)).map_err(UeventError::Bind)?;
        Ok(Self { socket })
    }

    /// Receives events forever, sending one `()` on `triggers` per debounced burst of
    /// relevant ones. Returns when `triggers` is closed, or on a socket error.
    pub async fn run(
        self,
        debounce: Debounce,
        triggers: mpsc::Sender<()>,
    ) -> Result<(), UeventError> {
        // Capacity 1 is enough: one pending sighting already means "a burst is on".
        let (sightings, mut received) = mpsc::channel::<Result<(), UeventError>>(1);
        std::thread::Builder::new()
            .name("uevent".into())
            .spawn(move || receive(&self.socket, &sightings))
            .map_err(UeventError::Thread)?;

        let mut burst: Option<(Instant, Instant)> = None;
        loop {
            let deadline = burst.map(|(first, last)| debounce.deadline(first, last));
            tokio::select! {
                sighting = received.recv() => match sighting {
                    Some(Ok(())) => {
                        let now = Instant::now();
                        burst = Some(burst.map_or((now, now), |(first, _)| (first, now)));
                    }
                    Some(Err(error)) => return Err(error),
                    None => return Err(UeventError::Receive(io::Error::other("the receiving thread ended"))),
                },
                _ = sleep_until(deadline) => {
                    burst = None;
                    if triggers.send(()).await.is_err() {
                        return Ok(());
                    }
                }
            }
        }
    }
}

/// The receiving thread: blocks on the socket and reports each relevant event (or
/// the error that ends it). Stops when the async side has gone away.
fn receive(socket: &OwnedFd, sightings: &mpsc::Sender<Result<(), UeventError>>) {
    // Large enough for any uevent (the kernel caps one at 2 KiB of environment).
    let mut buffer = vec![0u8; 8192];
    loop {
        let sighting = match recv(socket.as_raw_fd(), &mut buffer, MsgFlags::empty()) {
            Ok(length) => match parse(&buffer[..length]).filter(is_relevant) {
                Some(event) => {
                    tracing::debug!(action = %event.action, device = event.devname.as_deref(), "uevent");
                    Ok(())
                }
                None => continue,
            },
            Err(nix::errno::Errno::EINTR) => continue,
            // The kernel dropped events because we were slow: what they said is
            // unknown, so treat it as a change and rescan.
            Err(nix::errno::Errno::ENOBUFS) => {
                tracing::warn!("uevent socket overflowed; rescanning");
                Ok(())
            }
            Err(error) => Err(UeventError::Receive(io::Error::from(error))),
        };
        let fatal = sighting.is_err();
        match sightings.try_send(sighting) {
            // Full: a sighting is already pending, which says the same.
            Ok(()) | Err(mpsc::error::TrySendError::Full(_)) => {}
            Err(mpsc::error::TrySendError::Closed(_)) => return,
        }
        if fatal {
            return;
        }
    }
}

/// Sleeps until `deadline`, or forever without one.
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in tests a failed unwrap is a failed test
mod tests {
    use super::*;

    #[test]
    fn parses_a_kernel_uevent() {
        let datagram = b"change@/devices/virtual/block/loop3\0ACTION=change\0DEVPATH=/devices/virtual/block/loop3\0SUBSYSTEM=block\0DISK_MEDIA_CHANGE=1\0MAJOR=7\0DEVNAME=loop3\0DEVTYPE=disk\0SEQNUM=4711\0";
        let event = parse(datagram).unwrap();
        assert_eq!(
            event,
            Uevent {
                action: "change".into(),
                subsystem: Some("block".into()),
                devname: Some("loop3".into()),
                devtype: Some("disk".into()),
            }
        );
        assert!(is_relevant(&event));
    }

    #[test]
    fn header_action_stands_without_an_action_field() {
        let event = parse(b"remove@/devices/x\0SUBSYSTEM=block\0junk\0").unwrap();
        assert_eq!(event.action, "remove");
        assert!(is_relevant(&event));
    }

    #[test]
    fn udevd_messages_and_garbage_are_not_kernel_uevents() {
        assert_eq!(parse(b"libudev\0\xfe\xed\xca\xfe"), None);
        assert_eq!(parse(b""), None);
    }

    #[test]
    fn only_block_add_remove_change_is_relevant() {
        let event = |action: &str, subsystem: Option<&str>| Uevent {
            action: action.into(),
            subsystem: subsystem.map(Into::into),
            devname: None,
            devtype: None,
        };
        assert!(is_relevant(&event("add", Some("block"))));
        assert!(!is_relevant(&event("bind", Some("block"))));
        assert!(!is_relevant(&event("add", Some("net"))));
        assert!(!is_relevant(&event("add", None)));
    }

    #[test]
    fn debounce_fires_after_quiet_but_never_later_than_max_delay() {
        let debounce = Debounce {
            quiet: Duration::from_millis(200),
            max_delay: Duration::from_secs(1),
        };
        let first = Instant::now();
        assert_eq!(
            debounce.deadline(first, first),
            first + Duration::from_millis(200)
        );
        let last = first + Duration::from_millis(500);
        assert_eq!(
            debounce.deadline(first, last),
            last + Duration::from_millis(200)
        );
        let late = first + Duration::from_millis(950);
        assert_eq!(
            debounce.deadline(first, late),
            first + Duration::from_secs(1)
        );
    }

    #[tokio::test]
    async fn the_kernel_socket_opens_without_udevd() {
        // Needs only the netlink family, which every Linux kernel has; this checks
        // that the sandbox, container or host permits it before the agent relies on it.
        Listener::open().unwrap();
    }
}

//! Pod addresses: every pod on a node gets its own loopback address in the node's
//! 127.<octet>.0.0/16 (by default octet = 100 + the node's index), so pods on all nodes
//! can listen on the same ports.
//!
//! Linux routes all of 127.0.0.0/8 to `lo`, so binding such an address needs no setup.
//! Addresses stay with a pod for its whole life and are recorded in the pod's state
//! directory, so a restarted node gives a pod the address it had.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::sync::Mutex;

use anyhow::bail;

pub struct AddressPool {
    second_octet: u8,
    in_use: Mutex<BTreeSet<u16>>,
}

impl AddressPool {
    pub fn new(second_octet: u8) -> Self {
        Self {
            second_octet,
            in_use: Mutex::new(BTreeSet::new()),
        }
    }

    /// The lowest free address (x.y.0.0 and x.y.0.1 are never handed out).
    pub fn allocate(&self) -> anyhow::Result<Ipv4Addr> {
        let mut in_use = self.lock();
        let Some(host) = (2..u16::MAX).find(|host| !in_use.contains(host)) else {
            bail!(
                "no free pod address left in 127.{}.0.0/16",
                self.second_octet
            );
        };
        in_use.insert(host);
        Ok(self.address(host))
    }

    /// Takes a specific address back (after a node restart); false if it is not ours.
    pub fn claim(&self, address: Ipv4Addr) -> bool {
        match self.host_of(address) {
            Some(host) => {
                self.lock().insert(host);
                true
            }
            None => false,
        }
    }

    pub fn release(&self, address: Ipv4Addr) {
        if let Some(host) = self.host_of(address) {
            self.lock().remove(&host);
        }
    }

    fn address(&self, host: u16) -> Ipv4Addr {
        let [high, low] = host.to_be_bytes();
        Ipv4Addr::new(127, self.second_octet, high, low)
    }

    fn host_of(&self, address: Ipv4Addr) -> Option<u16> {
        let [a, b, high, low] = address.octets();
        (a == 127 && b == self.second_octet).then(|| u16::from_be_bytes([high, low]))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeSet<u16>> {
        // A poisoned lock only means another thread panicked mid-insert of a number;
        // the set is still consistent.
        self.in_use
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocates_lowest_free_and_reuses_released() -> anyhow::Result<()> {
        let pool = AddressPool::new(102);
        assert_eq!(pool.allocate()?, Ipv4Addr::new(127, 102, 0, 2));
        assert_eq!(pool.allocate()?, Ipv4Addr::new(127, 102, 0, 3));
        pool.release(Ipv4Addr::new(127, 102, 0, 2));
        assert_eq!(pool.allocate()?, Ipv4Addr::new(127, 102, 0, 2));
        assert!(pool.claim(Ipv4Addr::new(127, 102, 0, 4)));
        assert_eq!(pool.allocate()?, Ipv4Addr::new(127, 102, 0, 5));
        assert!(!pool.claim(Ipv4Addr::new(127, 101, 0, 9)));
        Ok(())
    }
}

//! Giving the system back the heap pages the process freed.
//!
//! glibc returns freed memory to the system only from the top of its heap. Below the
//! top, a page freed by a burst stays resident for as long as one live allocation
//! keeps the heap above it: after 100 clusters were created the operator's one arena
//! held 12.2 MiB from the system of which 9.1 MiB was in use, the rest in free holes
//! between live allocations (docs/benchmarks.md, Scale). `malloc_trim` gives every
//! whole free page inside those holes back (`MADV_DONTNEED`) and leaves live memory
//! as it is; the long-lived processes (operator, agent, instance manager) call it
//! every [`TRIM_EVERY`] ([`keep_trimmed`]). A page given back and used again costs a
//! page fault; at this cadence that is nothing next to the memory kept.
//!
//! This is the one module where `unsafe` is allowed, for that one foreign call: it
//! takes no pointers and glibc serialises it with every other allocator call, so no
//! caller can misuse it. Elsewhere than glibc it does nothing (musl and other
//! allocators return free memory themselves or have no such call).

use std::time::Duration;

/// How often the heap is trimmed.
pub const TRIM_EVERY: Duration = Duration::from_secs(10);

/// Asks glibc to give every whole free page of its heaps back to the system; whether
/// it gave any back.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
pub fn trim() -> bool {
    // SAFETY: `malloc_trim` takes no pointers and only rearranges glibc's own free
    // lists, under the arenas' locks; any thread may call it at any time.
    unsafe { libc::malloc_trim(0) == 1 }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn trim() -> bool {
    false
}

/// Trims the heap every [`TRIM_EVERY`], for as long as the runtime runs.
pub async fn keep_trimmed() {
    let mut every = tokio::time::interval(TRIM_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        trim();
    }
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    /// Resident bytes of this process (`/proc/self/statm`'s second field, in pages).
    fn resident() -> u64 {
        let statm = std::fs::read_to_string("/proc/self/statm").expect("reading statm");
        let pages: u64 = statm
            .split_whitespace()
            .nth(1)
            .and_then(|field| field.parse().ok())
            .expect("statm has a resident field");
        pages * 4096
    }

    #[test]
    fn gives_back_the_free_pages_below_live_memory() {
        const BLOCK: usize = 16 * 1024;
        const BLOCKS: usize = 6 * 1024;
        // Blocks under glibc's mmap threshold come from a heap; a small live
        // allocation after each keeps the heap's top above every freed block, as the
        // operator's long-lived objects do after a burst.
        let mut freed = Vec::with_capacity(BLOCKS);
        let mut kept = Vec::with_capacity(BLOCKS);
        for i in 0..BLOCKS {
            freed.push(vec![i as u8 | 1; BLOCK]);
            kept.push(Box::new(i));
        }
        drop(freed);
        let before = resident();
        assert!(super::trim(), "glibc gave nothing back");
        let after = resident();
        // 96 MiB were freed; other tests running beside this one allocate far less
        // than the half that must come back.
        let given_back = before.saturating_sub(after);
        assert!(
            given_back >= (BLOCK * BLOCKS / 2) as u64,
            "trimming gave back {given_back} bytes of {} freed",
            BLOCK * BLOCKS
        );
        assert_eq!(kept.len(), BLOCKS);
    }
}

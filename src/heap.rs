//! The allocator of every Castellan process: jemalloc, with one arena, no thread caches,
//! and freed pages given back to the system after a second.
//!
//! glibc's malloc gives freed memory back only from the top of its heap: below the top, a
//! page freed by a burst stays resident while one live allocation keeps the heap above
//! it, and a hole smaller than a page never goes back at all. At idle with 100 clusters
//! the operator's glibc heap was 8.4–8.8 MiB resident with about 6 MiB in use, even with
//! `malloc_trim` every 10 s (docs/benchmarks.md, Scale). jemalloc keeps each size class
//! in slabs of its own and gives back every page that stayed free for a while; the same
//! operator, restarted onto the same 100 clusters, held 1.8 MiB less anonymous memory.
//!
//! Its options are built in: `.cargo/config.toml` sets `JEMALLOC_SYS_WITH_MALLOC_CONF`,
//! which tikv-jemalloc-sys compiles into jemalloc (a unit test reads back what jemalloc
//! runs with). `_RJEM_MALLOC_CONF` in a process' environment overrides them
//! (docs/operations.md):
//! - `narenas:1`: one arena, where jemalloc would make four per core. Memory freed in one
//!   arena serves no other, so a burst (an operator restarted onto 100 clusters, every
//!   actor's first requests at once) would leave each arena holding its peak; these
//!   processes allocate too little for the arena's lock to matter. (Under glibc this was
//!   `MALLOC_ARENA_MAX=1`, which the processes set by executing themselves again.)
//! - `tcache:false`: no per-thread caches of freed objects, which hold memory per thread
//!   and size class.
//! - `dirty_decay_ms:1000,muzzy_decay_ms:0`: a page free for a second is given back
//!   (`MADV_DONTNEED`) at once rather than through the lazy `MADV_FREE` stage, so the
//!   resident set shows what the process holds. Giving back sooner (`0`) saved nothing
//!   more and cost the idle operator 16 % more CPU.

#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

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

    /// The environment variable that overrides jemalloc's options.
    const OPTIONS: &str = "_RJEM_MALLOC_CONF";

    #[test]
    fn jemalloc_runs_with_the_options_built_in() {
        if crate::tests::is_run_again() {
            // Run again by this test (below): exiting prints jemalloc's statistics.
            return;
        }
        // This test binary run again, this test alone, with `stats_print`: at exit
        // jemalloc prints the options it ran with. A build without the configuration
        // (cargo run from outside the workspace) shows jemalloc's defaults, four arenas
        // per core, thread caches and ten seconds of decay.
        let output = crate::tests::run_again(
            "heap::tests::jemalloc_runs_with_the_options_built_in",
            &[(OPTIONS, "stats_print:true")],
        );
        let stats = String::from_utf8_lossy(&output.stderr);
        for option in [
            "opt.narenas: 1\n",
            "opt.tcache: false\n",
            "opt.dirty_decay_ms: 1000 ",
            "opt.muzzy_decay_ms: 0 ",
        ] {
            assert!(
                stats.contains(option),
                "jemalloc runs without {option:?}:\n{stats}"
            );
        }
    }

    #[test]
    fn freed_pages_go_back_to_the_system_within_seconds() {
        const BLOCK: usize = 16 * 1024;
        const BLOCKS: usize = 6 * 1024;
        // A small live allocation after each block, as the operator's long-lived objects
        // sit between the buffers of a burst.
        let mut freed = Vec::with_capacity(BLOCKS);
        let mut kept = Vec::with_capacity(BLOCKS);
        for i in 0..BLOCKS {
            freed.push(vec![i as u8 | 1; BLOCK]);
            kept.push(Box::new(i));
        }
        let before = resident();
        drop(freed);
        // Without a background thread jemalloc decays as it is used: keep allocating a
        // little, as any running process does.
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut given_back = 0;
        while Instant::now() < deadline {
            for i in 0..1000 {
                std::hint::black_box(vec![i as u8; 64]);
            }
            given_back = before.saturating_sub(resident());
            // 96 MiB were freed; other tests running beside this one allocate far less
            // than the half that must come back.
            if given_back >= (BLOCK * BLOCKS / 2) as u64 {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        assert!(
            given_back >= (BLOCK * BLOCKS / 2) as u64,
            "{given_back} bytes of {} freed went back to the system in 10 s",
            BLOCK * BLOCKS
        );
        assert_eq!(kept.len(), BLOCKS);
    }
}

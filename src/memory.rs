//! Memory readings and the prefix indexes' memory budget.
//!
//! The budget is the smaller of container memory × `memory_threshold_ratio` (0 → 0.70) and
//! container memory − `reserved_memory_gib` (0 → 1.5 GiB). Container memory is read from
//! cgroup v2 (`memory.max`), then cgroup v1 (`memory.limit_in_bytes`), then the host's
//! `MemTotal` when unlimited; `memory_limit_bytes` overrides it.

/// Turns transparent huge pages off for this process (Linux; elsewhere nothing).
///
/// mimalloc reserves its arenas in large aligned regions; where the kernel backs them with
/// 2 MiB huge pages (THP `always`, or `madvise` with mimalloc's own `MADV_HUGEPAGE`, which
/// the `no_thp` build feature removes), a huge page is resident as a whole as soon as one
/// byte of it is touched, so every allocated byte counts: a 64 KiB body buffer of Pingora's
/// of which a stream uses one page cost 64 KiB. Measured with 3,000 open streams
/// (`bench/memory.sh`, bench/results/reliability.md): 114 KiB per stream with huge pages,
/// 54 KiB without. The cost is more TLB misses on a heap of a few hundred MiB at most.
/// Called first thing in `main`; returns whether the kernel took it (an old kernel or a
/// seccomp profile may refuse: nothing else depends on it).
pub fn no_huge_pages() -> bool {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) takes integers only and changes
        // no memory of ours (it sets a flag of the process's memory map).
        #[allow(unsafe_code)]
        let r = unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
        r == 0
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// Memory settings of the index (resolved defaults).
#[derive(Debug, Clone, Copy)]
pub struct MemoryPolicy {
    pub ratio: f64,
    pub reserved_bytes: u64,
    /// Container memory override.
    pub limit_override: Option<u64>,
}

impl MemoryPolicy {
    pub fn new(ratio: f64, reserved_gib: f64, limit_override: Option<u64>) -> Self {
        MemoryPolicy {
            ratio: if ratio > 0.0 { ratio } else { 0.70 },
            reserved_bytes: ((if reserved_gib > 0.0 {
                reserved_gib
            } else {
                1.5
            }) * GIB) as u64,
            limit_override,
        }
    }

    /// The most memory the process may use before the indexes are trimmed.
    pub fn budget(&self, container: u64) -> u64 {
        let by_ratio = (container as f64 * self.ratio) as u64;
        let by_reserve = container.saturating_sub(self.reserved_bytes);
        by_ratio.min(by_reserve)
    }
}

/// Container memory: cgroup v2, then v1, then the host's memory.
pub fn container_memory() -> Option<u64> {
    if let Ok(s) = std::fs::read_to_string("/sys/fs/cgroup/memory.max") {
        let s = s.trim();
        if s != "max" {
            if let Ok(v) = s.parse::<u64>() {
                return Some(v);
            }
        }
    }
    if let Ok(s) = std::fs::read_to_string("/sys/fs/cgroup/memory/memory.limit_in_bytes") {
        if let Ok(v) = s.trim().parse::<u64>() {
            // v1 reports "unlimited" as a huge page-aligned number.
            if v < (1u64 << 60) {
                return Some(v);
            }
        }
    }
    host_memory()
}

fn host_memory() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Resident memory of this process.
pub fn process_rss() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = s.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_is_the_smaller_of_ratio_and_reserve() {
        let p = MemoryPolicy::new(0.0, 0.0, None);
        // 8 GiB: 0.7 × 8 = 5.6 GiB, 8 − 1.5 = 6.5 GiB → 5.6 GiB.
        assert_eq!(p.budget(8 * GIB as u64), (8.0 * GIB * 0.7) as u64);
        // 2 GiB: 1.4 GiB vs 0.5 GiB → 0.5 GiB.
        assert_eq!(p.budget(2 * GIB as u64), (0.5 * GIB) as u64);
        let p = MemoryPolicy::new(0.5, 1.0, None);
        assert_eq!(p.budget(4 * GIB as u64), 2 * GIB as u64);
    }

    #[test]
    fn reads_this_machines_memory() {
        assert!(container_memory().unwrap() > 0);
        assert!(process_rss().unwrap() > 0);
    }
}

//! A replica's share of its tenants' minute: what it charged to each tenant's fleet-wide
//! buckets over the last minute, kept to be written back to a Redis that lost its data.

/// A replica's charges to one tenant's fleet-wide buckets (requests, input, output) over the
/// last minute, in 10 s slots: its share of the minute, written back to a Redis that lost
/// its data (`Cluster::restore_usage`).
#[derive(Debug, Default)]
pub(super) struct Usage {
    pub(super) limits: [u64; 3],
    slots: [(u64, [i64; 3]); USAGE_SLOTS],
}

const USAGE_SLOT_MS: u64 = 10_000;
const USAGE_SLOTS: usize = 6;

impl Usage {
    pub(super) fn new(limits: [u64; 3]) -> Usage {
        Usage {
            limits,
            ..Usage::default()
        }
    }

    pub(super) fn add(&mut self, now_ms: u64, d: [i64; 3]) {
        let slot = now_ms / USAGE_SLOT_MS;
        let s = &mut self.slots[(slot % USAGE_SLOTS as u64) as usize];
        if s.0 != slot {
            *s = (slot, [0; 3]);
        }
        for (a, b) in s.1.iter_mut().zip(d) {
            *a += b;
        }
    }

    /// The charges of the last minute (the current slot and the five before it).
    pub(super) fn minute(&self, now_ms: u64) -> [i64; 3] {
        let now = now_ms / USAGE_SLOT_MS;
        let mut sum = [0i64; 3];
        for (slot, d) in &self.slots {
            if *slot <= now && now - *slot < USAGE_SLOTS as u64 {
                for (a, b) in sum.iter_mut().zip(d) {
                    *a += b;
                }
            }
        }
        sum
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replicas_share_of_the_minute_forgets_what_is_older() {
        let mut u = Usage::default();
        let t0 = 1_000_000_000;
        u.add(t0, [1, 100, 10]);
        u.add(t0 + 30_000, [1, 50, 5]);
        u.add(t0 + 30_001, [0, -20, 0]); // settled: used less than reserved
        assert_eq!(u.minute(t0 + 30_002), [2, 130, 15]);
        // A minute on, the first charge is out of the window.
        assert_eq!(u.minute(t0 + 61_000), [1, 30, 5]);
        assert_eq!(u.minute(t0 + 100_000), [0; 3]);
    }
}

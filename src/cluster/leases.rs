//! Throttling slots as fleet-wide leases: taken by an atomic script only under the limit,
//! renewed by the heartbeat, given back when dropped (a release wakes the other replicas'
//! queues).

use super::client::{Cluster, Op};
use super::wire::{Event, Kind};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// The answer of [`Cluster::acquire`].
pub enum Acquired {
    /// The fleet-wide slot, held until dropped.
    Slot(Lease),
    /// The fleet already uses every slot of the instance.
    Full,
    /// Redis did not answer: the local limits alone decide.
    Unknown,
}

/// A fleet-wide throttling slot; dropping it gives it back.
pub struct Lease {
    pub(super) cluster: Arc<Cluster>,
    pub(super) id: u64,
    pub(super) service: String,
    /// A `prefill` slot, given back at the first token.
    pub prefill: bool,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Lease({})", self.id)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let Some((key, member)) = self.cluster.leases.lock().remove(&self.id) else {
            return;
        };
        let event = (!self.service.is_empty()).then(|| {
            Event {
                kind: Kind::Released,
                origin: self.cluster.replica.clone(),
                service: std::mem::take(&mut self.service),
                instance: String::new(),
                blocks: Vec::new(),
            }
            .encode()
        });
        self.cluster.send(Op::Release { key, member, event });
    }
}

impl Cluster {
    /// Takes a fleet-wide slot of `phase` (`total`, `prefill`, `decode`) on an instance
    /// whose limit is `limit`.
    pub async fn acquire(
        self: &Arc<Self>,
        service: &str,
        instance: &str,
        phase: &'static str,
        limit: u64,
    ) -> Acquired {
        if !self.usable() {
            self.m.fallbacks.with_label_values(&["lease"]).inc();
            return Acquired::Unknown;
        }
        let key = self.key(&format!("lease:{service}:{instance}:{phase}"));
        let id = self.next_lease.fetch_add(1, Relaxed);
        let member = format!("{}#{id}", self.replica);
        let t = std::time::Instant::now();
        let (k, mb, ms) = (key.clone(), member.clone(), self.lease_ms);
        let script = self.acquire.clone();
        let r = self
            .call("lease", |mut c| async move {
                script
                    .key(&k)
                    .arg(limit)
                    .arg(&mb)
                    .arg(ms)
                    .invoke_async::<i64>(&mut c)
                    .await
            })
            .await;
        self.m.rtt.observe(t.elapsed().as_secs_f64());
        match r {
            Some(1) => {
                self.leases.lock().insert(id, (key, member));
                Acquired::Slot(Lease {
                    cluster: self.clone(),
                    id,
                    service: service.to_string(),
                    prefill: phase == "prefill",
                })
            }
            Some(_) => Acquired::Full,
            None => {
                // It may have been taken without the answer arriving: it expires unrenewed.
                self.m.fallbacks.with_label_values(&["lease"]).inc();
                Acquired::Unknown
            }
        }
    }
}

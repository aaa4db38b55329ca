//! Tenants' limits for the fleet: the admission script (per-minute buckets, concurrency
//! leases, the session read along), the settlement, and this replica's share of the minute
//! written back to a Redis that lost its data.

use super::client::{Cluster, Op};
use super::leases::Lease;
use super::minute::Usage;
use log::info;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

/// A tenant's limits as the fleet-wide script takes them (0: no such limit).
#[derive(Debug, Clone, Copy, Default)]
pub struct TenantLimits {
    pub per_minute: [u64; 3],
    pub concurrency: u64,
}

/// The answer of [`Cluster::admit_tenant`].
pub enum TenantAdmission {
    /// Admitted fleet-wide: its concurrency lease (when the tenant has that limit), and the
    /// session binding read along (when one was asked for).
    Admitted {
        hold: TenantHold,
        session: Option<String>,
    },
    /// Refused: which limit (1 requests, 2 input, 3 output, 4 concurrency), and when to
    /// retry.
    Refused { limit: u8, retry_after: Duration },
    /// Redis did not answer: the local limits alone decide (per replica).
    Unknown,
}

/// A request's hold on its tenant's fleet-wide limits: its concurrency lease (given back
/// when dropped or [`TenantHold::release`]d) and the settlement of its tokens.
pub struct TenantHold {
    /// What the fleet's buckets held after this request (requests, input, output; `None`:
    /// no such limit), for its `x-ratelimit-remaining-*` headers.
    pub remaining: [Option<u64>; 3],
    cluster: Arc<Cluster>,
    key: String,
    limits: TenantLimits,
    lease: Option<Lease>,
}

impl std::fmt::Debug for TenantHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TenantHold({})", self.key)
    }
}

impl TenantHold {
    /// Gives the concurrency lease back (the answer ended).
    pub fn release(&mut self) {
        self.lease = None;
    }

    /// Corrects the fleet's buckets by `give_back` (requests, input, output; reserved minus
    /// used), off the request's path, and gives the lease back.
    pub fn settle(mut self, give_back: [i64; 3]) {
        self.lease = None;
        self.cluster
            .charged(&self.key, self.limits.per_minute, give_back.map(|g| -g));
        let l = self.limits.per_minute;
        if give_back
            .iter()
            .zip(l)
            .all(|(d, limit)| *d == 0 || limit == 0)
        {
            return;
        }
        let key = std::mem::take(&mut self.key);
        self.cluster.send(Op::Settle {
            key,
            limits: l,
            give_back,
        });
    }
}

impl Cluster {
    /// Takes a request of tenant `name` off its fleet-wide limits (`input`, `output` tokens
    /// reserved), reading `session` (a [`Cluster::session_ref`]) in the same round trip.
    pub async fn admit_tenant(
        self: &Arc<Self>,
        name: &str,
        limits: TenantLimits,
        input: u64,
        output: u64,
        session: Option<&str>,
    ) -> TenantAdmission {
        if !self.usable() {
            self.m.fallbacks.with_label_values(&["tenant"]).inc();
            return TenantAdmission::Unknown;
        }
        let key = self.key(&format!("tenant:{name}"));
        let lease_key = format!("{key}:inflight");
        let id = self.next_lease.fetch_add(1, Relaxed);
        let member = format!("{}#{id}", self.replica);
        let script = self.tenant_script.clone();
        let (k, lk, mb, ms) = (
            key.clone(),
            lease_key.clone(),
            member.clone(),
            self.lease_ms,
        );
        let sk = session.map(str::to_string);
        let t = std::time::Instant::now();
        let r = self
            .call("tenant", |mut c| async move {
                let mut inv = script.key(&k);
                inv.key(&lk);
                if let Some(sk) = &sk {
                    inv.key(sk);
                }
                inv.arg(&limits.per_minute[..])
                    .arg(limits.concurrency)
                    .arg(input)
                    .arg(output)
                    .arg(&mb)
                    .arg(ms);
                inv.invoke_async::<(i64, i64, i64, Option<String>, i64, i64, i64)>(&mut c)
                    .await
            })
            .await;
        self.m.rtt.observe(t.elapsed().as_secs_f64());
        match r {
            Some((1, _, _, session, r, i, o)) => {
                let charge = [1, input, output].map(|v| i64::try_from(v).unwrap_or(i64::MAX));
                self.charged(&key, limits.per_minute, charge);
                let lease = (limits.concurrency > 0).then(|| {
                    self.leases.lock().insert(id, (lease_key, member));
                    Lease {
                        cluster: self.clone(),
                        id,
                        service: String::new(),
                        prefill: false,
                    }
                });
                let left = |v: i64| u64::try_from(v).ok();
                TenantAdmission::Admitted {
                    hold: TenantHold {
                        remaining: [left(r), left(i), left(o)],
                        cluster: self.clone(),
                        key,
                        limits,
                        lease,
                    },
                    session,
                }
            }
            Some((_, limit, ms, ..)) => TenantAdmission::Refused {
                limit: limit.clamp(1, 4) as u8,
                retry_after: Duration::from_millis(ms.max(1) as u64),
            },
            None => {
                // A lease may have been taken without the answer arriving: it expires
                // unrenewed.
                self.m.fallbacks.with_label_values(&["tenant"]).inc();
                TenantAdmission::Unknown
            }
        }
    }

    /// Notes a charge to a tenant's fleet-wide buckets (`key`; requests, input, output
    /// tokens; negative: given back) in this replica's share of the minute.
    fn charged(&self, key: &str, limits: [u64; 3], d: [i64; 3]) {
        if d == [0; 3] {
            return;
        }
        let now = crate::clock::now_ms();
        let mut u = self.usage.lock();
        match u.get_mut(key) {
            Some(e) => {
                e.limits = limits;
                e.add(now, d);
            }
            None => {
                let mut e = Usage::new(limits);
                e.add(now, d);
                u.insert(key.to_string(), e);
            }
        }
    }

    /// Redis lost its data (its epoch changed): every tenant's buckets would start full, a
    /// fresh minute for all. Writes back this replica's share of the last minute's charges
    /// (each replica does, so the buckets hold the fleet's), off the request's path.
    pub(super) fn restore_usage(&self) {
        let now = crate::clock::now_ms();
        let writes: Vec<(String, [u64; 3], [i64; 3])> = {
            let mut u = self.usage.lock();
            u.retain(|_, e| e.minute(now) != [0; 3]);
            u.iter()
                .map(|(k, e)| (k.clone(), e.limits, e.minute(now)))
                .collect()
        };
        for (key, limits, used) in &writes {
            self.send(Op::Settle {
                key: key.clone(),
                limits: *limits,
                give_back: used.map(|u| -u.max(0)),
            });
        }
        info!(
            "cluster: Redis at {} lost its data (restarted empty?): wrote back this replica's share of the last minute of {} tenant(s)",
            self.url,
            writes.len()
        );
    }
}

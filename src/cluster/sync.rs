//! The replicas' periodic exchange of figures: in-flight load per instance and the
//! throttling queues' figures per tenant (fleet-wide fairness), in one pipelined round trip.

use super::client::Cluster;
use std::collections::HashMap;

/// Separates the service and the flow in the field of a flow's figures.
const FIELD_SEP: char = '\u{1f}';

/// One flow of one service's throttling queue, as this replica publishes it: tokens served
/// (decayed), requests waiting, their best class (0 first).
#[derive(Debug, Clone)]
pub struct FlowFigures {
    pub service: String,
    pub flow: String,
    pub served: f64,
    pub backlog: u64,
    pub class: u8,
}

/// What [`Cluster::sync`] reads: the other replicas' in-flight figures by instance id, and
/// their queues' figures by (service, flow): tokens served, requests waiting, best class
/// of those (`u8::MAX`: none waiting).
#[derive(Debug, Default)]
pub struct Synced {
    pub load: HashMap<String, [u64; 4]>,
    pub fair: HashMap<(String, String), (f64, u64, u8)>,
}

impl Cluster {
    /// Publishes this replica's figures and reads the other replicas' in one pipelined
    /// round trip: its in-flight figures (`[requests, tokens, waiting, prefill tokens]` by
    /// instance id, the non-zero ones) and its throttling queues' figures by service and
    /// flow ([`FlowFigures`]). Returns the other replicas' sums; `None` when Redis is not
    /// usable (nothing is known then).
    pub async fn sync(&self, load: &[(String, [u64; 4])], fair: &[FlowFigures]) -> Option<Synced> {
        if !self.usable() {
            return None;
        }
        let replicas = self.key("replicas");
        let keep = (self.load_every() * 5).as_millis() as u64;
        let (load_hashes, fair_hashes) = (self.key("load:"), self.key("fair:"));
        let load_args: Vec<String> = load
            .iter()
            .flat_map(|(i, v)| [i.clone(), format!("{},{},{},{}", v[0], v[1], v[2], v[3])])
            .collect();
        let fair_args: Vec<String> = fair
            .iter()
            .flat_map(|f| {
                [
                    format!("{}{FIELD_SEP}{}", f.service, f.flow),
                    format!("{},{},{}", f.served.round() as u64, f.backlog, f.class),
                ]
            })
            .collect();
        let id = self.replica.clone();
        let script = self.sync_script.clone();
        let (load_flat, fair_flat) = self
            .call("load", |mut c| async move {
                let mut p = redis::pipe();
                for (hashes, args) in [(&load_hashes, &load_args), (&fair_hashes, &fair_args)] {
                    p.cmd("EVALSHA")
                        .arg(script.get_hash())
                        .arg(1)
                        .arg(&replicas)
                        .arg(hashes)
                        .arg(&id)
                        .arg(keep)
                        .arg(args);
                }
                match p.query_async::<(Vec<String>, Vec<String>)>(&mut c).await {
                    Err(e)
                        if e.kind()
                            == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
                    {
                        // A Redis that restarted: load the script, then again.
                        script.load_async(&mut c).await?;
                        p.query_async(&mut c).await
                    }
                    r => r,
                }
            })
            .await?;
        let mut out = Synced::default();
        for p in load_flat.chunks_exact(2) {
            let mut v = [0u64; 4];
            for (slot, x) in v.iter_mut().zip(p[1].split(',')) {
                *slot = x.parse().unwrap_or(0);
            }
            let e = out.load.entry(p[0].clone()).or_default();
            for (a, b) in e.iter_mut().zip(v) {
                *a += b;
            }
        }
        for p in fair_flat.chunks_exact(2) {
            let Some((service, flow)) = p[0].split_once(FIELD_SEP) else {
                continue;
            };
            let mut it = p[1].split(',').map(|x| x.parse::<u64>().unwrap_or(0));
            let (served, backlog, class) = (
                it.next().unwrap_or(0),
                it.next().unwrap_or(0),
                it.next().unwrap_or(u64::from(u8::MAX)),
            );
            let e = out
                .fair
                .entry((service.to_string(), flow.to_string()))
                .or_insert((0.0, 0, u8::MAX));
            e.0 += served as f64;
            e.1 += backlog;
            if backlog > 0 {
                e.2 = e.2.min(class.min(u64::from(u8::MAX)) as u8);
            }
        }
        Some(out)
    }

    /// Requests whose place in a throttling queue was decided on this replica's figures only
    /// (Redis away): counted in `tokengate_cluster_local_fallbacks_total{what="fairness"}`.
    pub fn fairness_fallbacks(&self, n: u64) {
        self.m.fallbacks.with_label_values(&["fairness"]).inc_by(n);
    }
}

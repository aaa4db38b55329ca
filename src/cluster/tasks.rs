//! The cluster's background tasks: connection, heartbeat (membership, lease renewal, the
//! store's epoch, the probe of a degraded replica), the writer of shared state and the
//! subscriber to the other replicas' events.

use super::client::{Cluster, Op};
use super::scripts::TENANT_SETTLE;
use super::wire::Event;
use log::warn;
use redis::aio::ConnectionManager;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// The cluster's background work: connection, heartbeat (membership, lease renewal, the
/// probe of a degraded replica), the writer of shared state and the subscriber to the
/// other replicas' events.
/// `apply` gets the events of the other replicas (see `crate::background::cluster`).
pub async fn run(
    c: Arc<Cluster>,
    apply: impl Fn(Event) + Send + Sync + 'static,
    stop: pingora::server::ShutdownWatch,
) {
    let cfg = redis::aio::ConnectionManagerConfig::new()
        .set_connection_timeout(Some(c.timeout.max(Duration::from_millis(200))))
        .set_response_timeout(Some(c.timeout.max(Duration::from_millis(200))))
        .set_number_of_retries(1)
        .set_min_delay(Duration::from_millis(50))
        .set_max_delay(Duration::from_secs(1));
    match ConnectionManager::new_lazy_with_config(c.client.clone(), cfg) {
        Ok(m) => {
            let _ = c.conn.set(m);
        }
        Err(e) => {
            warn!(
                "cluster: cannot set up the Redis client of {}: {e}; this replica runs on its own",
                c.url
            );
            return;
        }
    }
    let rx = c.inbox.lock().take();
    let writer = rx.map(|rx| tokio::spawn(write_loop(c.clone(), rx)));
    let sub = tokio::spawn(subscribe_loop(apply, c.clone(), stop.clone()));
    heartbeat_loop(&c, stop).await;
    sub.abort();
    if let Some(w) = writer {
        w.abort();
    }
}

async fn heartbeat_loop(c: &Arc<Cluster>, mut stop: pingora::server::ShutdownWatch) {
    let hb = c.heartbeat;
    let forget = hb.as_millis() as u64 * 10;
    let mut backoff = Duration::from_millis(100);
    loop {
        let snapshot: Vec<(u64, String, String)> = c
            .leases
            .lock()
            .iter()
            .map(|(id, (k, m))| (*id, k.clone(), m.clone()))
            .collect();
        let leases: Vec<(String, String)> = snapshot
            .iter()
            .map(|(_, k, m)| (k.clone(), m.clone()))
            .collect();
        let script = c.heartbeat_script.clone();
        let (replicas, id, lease_ms) = (c.key("replicas"), c.replica.clone(), c.lease_ms);
        let (epoch_key, proposal) = (c.key("epoch"), uuid::Uuid::new_v4().simple().to_string());
        let conn = c.conn.get().cloned();
        let r = match conn {
            Some(mut conn) => {
                let call = async move {
                    let mut inv = script.key(&replicas);
                    inv.key(&epoch_key);
                    inv.arg(&id).arg(lease_ms).arg(forget).arg(&proposal);
                    for (k, m) in &leases {
                        inv.key(k).arg(m);
                    }
                    inv.invoke_async::<(i64, String)>(&mut conn).await
                };
                // The heartbeat may wait longer than a request would (a busy Redis).
                tokio::time::timeout(c.timeout.max(Duration::from_millis(250)) * 2, call).await
            }
            None => return,
        };
        let next = match r {
            Ok(Ok((fresh, epoch))) => {
                c.answered("heartbeat");
                c.recovered();
                let lost = {
                    let mut known = c.epoch.lock();
                    let was = known.replace(epoch.clone());
                    was.is_some_and(|w| w != epoch)
                };
                if lost {
                    c.restore_usage();
                }
                if fresh == 1 {
                    // Re-registered: the script added back every lease of the snapshot; one
                    // given back since (its removal may have reached Redis first) goes again.
                    let held = c.leases.lock();
                    let gone: Vec<_> = snapshot
                        .into_iter()
                        .filter(|(id, _, _)| !held.contains_key(id))
                        .collect();
                    drop(held);
                    for (_, key, member) in gone {
                        c.send(Op::Release {
                            key,
                            member,
                            event: None,
                        });
                    }
                }
                backoff = Duration::from_millis(100);
                hb
            }
            Ok(Err(e)) => {
                log::debug!("cluster: heartbeat: {e}");
                c.failed("heartbeat", "error");
                backoff = (backoff * 2).min(hb.max(Duration::from_millis(100)));
                backoff
            }
            Err(_) => {
                c.failed("heartbeat", "timeout");
                backoff = (backoff * 2).min(hb.max(Duration::from_millis(100)));
                backoff
            }
        };
        if !crate::clock::sleep_or_stop(next, &mut stop).await {
            return;
        }
    }
}

async fn write_loop(c: Arc<Cluster>, mut rx: mpsc::Receiver<Op>) {
    let events = c.key("events");
    let mut batch = Vec::with_capacity(256);
    while let Some(op) = rx.recv().await {
        batch.push(op);
        while batch.len() < 256 {
            match rx.try_recv() {
                Ok(op) => batch.push(op),
                Err(_) => break,
            }
        }
        if !c.usable() {
            c.m.dropped.inc_by(batch.len() as u64);
            batch.clear();
            continue;
        }
        let mut p = redis::pipe();
        for op in batch.drain(..) {
            match op {
                Op::Publish(b) => {
                    p.cmd("PUBLISH").arg(&events).arg(b).ignore();
                }
                Op::SetSession { key, value, ttl_ms } => {
                    p.cmd("SET")
                        .arg(key)
                        .arg(value)
                        .arg("PX")
                        .arg(ttl_ms)
                        .ignore();
                }
                Op::Release { key, member, event } => {
                    p.cmd("ZREM").arg(key).arg(member).ignore();
                    if let Some(event) = event {
                        p.cmd("PUBLISH").arg(&events).arg(event).ignore();
                    }
                }
                Op::Settle {
                    key,
                    limits,
                    give_back,
                } => {
                    p.cmd("EVAL")
                        .arg(TENANT_SETTLE)
                        .arg(1)
                        .arg(key)
                        .arg(&limits[..])
                        .arg(&give_back[..])
                        .ignore();
                }
            }
        }
        c.call("write", |mut conn| async move {
            p.query_async::<()>(&mut conn).await
        })
        .await;
    }
}

async fn subscribe_loop(
    apply: impl Fn(Event) + Send + Sync + 'static,
    c: Arc<Cluster>,
    mut stop: pingora::server::ShutdownWatch,
) {
    use futures_util::StreamExt;
    let channel = c.key("events");
    let mut backoff = Duration::from_millis(100);
    loop {
        let connect = async {
            let mut ps = c.client.get_async_pubsub().await?;
            ps.subscribe(&channel).await?;
            Ok::<_, redis::RedisError>(ps)
        };
        match tokio::time::timeout(Duration::from_secs(2), connect).await {
            Ok(Ok(ps)) => {
                backoff = Duration::from_millis(100);
                let mut msgs = ps.into_on_message();
                loop {
                    tokio::select! {
                        m = msgs.next() => match m {
                            Some(m) => {
                                if let Some(e) = Event::decode(m.get_payload_bytes()) {
                                    if e.origin != c.replica {
                                        apply(e);
                                    }
                                }
                            }
                            None => break,
                        },
                        r = stop.changed() => if r.is_err() || *stop.borrow() { return },
                    }
                }
                log::debug!("cluster: the event subscription closed; reconnecting");
            }
            Ok(Err(e)) => log::debug!("cluster: subscribe: {e}"),
            Err(_) => log::debug!("cluster: subscribe: timed out"),
        }
        if !crate::clock::sleep_or_stop(backoff, &mut stop).await {
            return;
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

//! What every connection of one engine-sim shares.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use http::HeaderValue;
use parking_lot::RwLock;

use crate::abort::Aborts;
use crate::engine::Engine;
use crate::pd::Registry;
use crate::{Faults, SimConfig};

pub(crate) struct Shared {
    pub cfg: Arc<SimConfig>,
    pub engine: Arc<Engine>,
    pub faults: RwLock<Faults>,
    /// PD prefill: KV published for decode engines.
    pub pd: Arc<Registry>,
    /// In-flight inference requests, for `POST /abort_request`.
    pub(super) aborts: Arc<Aborts>,
    pub(super) fault_draws: AtomicU64,
    pub(super) ids: AtomicU64,
    pub(super) id_header: HeaderValue,
    pub(super) started: u64,
}

pub(super) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl Shared {
    pub(crate) fn new(cfg: Arc<SimConfig>, engine: Arc<Engine>) -> Arc<Self> {
        let id_header = HeaderValue::from_str(&cfg.id).unwrap_or(HeaderValue::from_static("sim"));
        Arc::new(Shared {
            faults: RwLock::new(cfg.faults.clone()),
            pd: Arc::new(Registry::new(&cfg)),
            aborts: Arc::default(),
            cfg,
            engine,
            fault_draws: AtomicU64::new(0),
            ids: AtomicU64::new(0),
            id_header,
            started: unix_now(),
        })
    }
}

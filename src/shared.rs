//! State shared by every request and background loop: the runtime (swapped on reload), the
//! metrics, and the decision-service client.

use crate::config::{Config, ConfigErrors};
use crate::decision::DecisionClient;
use crate::metrics::Metrics;
use crate::runtime::Runtime;
use arc_swap::ArcSwap;
use std::sync::Arc;

pub struct Shared {
    pub runtime: ArcSwap<Runtime>,
    pub metrics: Metrics,
    /// Client of the routes' decision services (pooled).
    pub decision: DecisionClient,
}

impl Shared {
    /// The shared state of a validated config.
    pub fn new(cfg: &Config) -> Result<Arc<Shared>, ConfigErrors> {
        let metrics = Metrics::new();
        let rt = Runtime::build(cfg, None, &metrics)?;
        Ok(Arc::new(Shared {
            runtime: ArcSwap::from_pointee(rt),
            metrics,
            decision: DecisionClient::new(),
        }))
    }
}

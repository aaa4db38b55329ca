//! What a request's `model` resolves to (a service, a route or a split-proxy entry), and the
//! names of the session tables it binds sessions in.

use super::route::Route;
use super::service::Service;
use std::sync::Arc;
use tokengate_plugins::InstanceKey;

/// What a request's `model` resolves to.
#[derive(Debug, Clone)]
pub enum Dest {
    Service(Arc<Service>),
    Route(Arc<Route>),
    /// An external entry of the split proxy ([`crate::split`]).
    Split(Arc<crate::split::Entry>),
}

/// The name of a service's session table in the replicas' shared store (`cluster:`; services
/// and routes may share names).
pub fn service_sessions(name: &str) -> String {
    format!("svc/{name}")
}

/// The name of a route's session table in the shared store.
pub fn route_sessions(name: &str) -> String {
    format!("route/{name}")
}

impl Dest {
    /// The session a request to this destination is bound by: the name of its table in the
    /// shared store and its key (`None`: no session table here, or no session key).
    pub fn session_target(
        &self,
        headers: &http::HeaderMap,
        info: &crate::api::RequestInfo,
        api: crate::api::Api,
    ) -> Option<(String, tokengate_plugins::SessionKey)> {
        let (sched, name) = match self {
            Dest::Service(s) => (&s.sched, service_sessions(&s.name)),
            Dest::Route(r) => (r.scheduler()?, route_sessions(&r.name)),
            Dest::Split(_) => return None,
        };
        sched.sessions.as_ref()?;
        Some((name, sched.session_key(headers, info, api)?))
    }

    pub fn name(&self) -> &str {
        match self {
            Dest::Service(s) => &s.name,
            Dest::Route(r) => &r.name,
            Dest::Split(e) => &e.name,
        }
    }

    /// Whether an available instance not in `exclude` is left anywhere in the destination
    /// (an external entry has none: its failover goes to other entries).
    pub fn has_untried(&self, exclude: &[InstanceKey]) -> bool {
        match self {
            Dest::Service(s) => s.has_untried(exclude),
            Dest::Route(r) => r.targets.iter().any(|s| s.has_untried(exclude)),
            Dest::Split(_) => false,
        }
    }
}

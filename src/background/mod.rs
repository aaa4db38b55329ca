//! The gateway's background loops, each stopped by shutdown: active health checks
//! ([`health_checks`]) and routing-state upkeep ([`maintenance`]). Config reloads run in
//! [`crate::reload`].

pub mod health_checks;
pub mod maintenance;

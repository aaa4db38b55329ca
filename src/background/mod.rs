//! The gateway's background loops, each stopped by shutdown: active health checks
//! ([`health_checks`]), routing-state upkeep ([`maintenance`]) and the engines' load signals
//! ([`engine_metrics`]). Config reloads run in [`crate::reload`].

pub mod cluster;
pub mod engine_metrics;
pub mod health_checks;
pub mod maintenance;

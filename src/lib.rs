//! tokengate: an LLM inference gateway on Cloudflare Pingora.
//!
//! `src/` holds the gateway (Pingora glue, config, APIs, state); `plugins/` the pure routing
//! logic; `sim/` engine-sim, the fake inference engine used by tests and benchmarks.

pub mod admin;
pub mod api;
pub mod bigbody;
pub mod config;
pub mod decision;
pub mod demo;
pub mod error;
pub mod health;
pub mod load;
pub mod maintenance;
pub mod metrics;
pub mod proxy;
pub mod reload;
pub mod schedule;
pub mod server;
pub mod state;
pub mod transport;
pub mod usage;

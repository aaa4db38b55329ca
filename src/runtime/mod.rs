//! The gateway's runtime state built from a [`Config`](crate::config::Config): services with
//! their instances (each with its live load and health), each service's prefix index and
//! scheduler, and routes over several services. Held behind an `ArcSwap`
//! ([`crate::shared::Shared`]) so a config reload swaps it atomically; a rebuilt runtime keeps
//! the state of what still exists.
//!
//! Bottom-up: `instance` (one engine), `service` (a pool of instances), `route` (a
//! model over services), `dest` (what a `model` resolves to), `state` (the [`Runtime`]
//! and its build), `views` (its typed, serializable views for `/admin/instances`,
//! `/admin/status` and `/v1/models`).

mod dest;
mod instance;
mod route;
mod service;
mod state;
pub mod views;

pub use dest::{route_sessions, service_sessions, Dest};
pub use instance::Instance;
pub use route::{Route, RouteMode};
pub use service::{Pd, Service};
pub use state::{Member, Runtime};

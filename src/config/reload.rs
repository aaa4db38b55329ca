//! `reload:`: hot reload of the config file.

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Hot reload (see [`crate::reload`]). SIGHUP always reloads; these settings govern the
/// file watcher.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ReloadSettings {
    /// Reload when the file changes (checked four times a second). `false`: SIGHUP only.
    #[serde(default = "d_true")]
    pub watch: bool,
    /// A file changed in place is applied only once its size and modification time have
    /// not moved for this long, so a file still being written (truncated, then filled) is
    /// never read half-way. A file replaced by a rename or a symlink swap (editors'
    /// atomic saves, a Kubernetes ConfigMap) is complete when it appears and applies at the
    /// next check.
    #[serde(default = "d_debounce", with = "humantime_serde")]
    pub debounce: Duration,
    /// How often the names of instance addresses are looked up again: an instance whose
    /// name moved, or an `expand` instance whose name has other addresses, reloads the
    /// config. Read at start.
    #[serde(default = "d_resolve_every", with = "humantime_serde")]
    pub resolve_every: Duration,
}

fn d_resolve_every() -> Duration {
    crate::resolve::RERESOLVE_EVERY
}

fn d_true() -> bool {
    true
}

fn d_debounce() -> Duration {
    Duration::from_secs(2)
}

impl Default for ReloadSettings {
    fn default() -> Self {
        ReloadSettings {
            watch: true,
            debounce: d_debounce(),
            resolve_every: d_resolve_every(),
        }
    }
}

impl ReloadSettings {
    pub(super) fn validate(&self, errs: &mut Vec<String>) {
        if self.resolve_every < Duration::from_millis(100)
            || self.resolve_every > Duration::from_secs(3600)
        {
            errs.push(format!(
                "reload.resolve_every: {} is outside 100ms..1h",
                humantime::format_duration(self.resolve_every)
            ));
        }
        if self.debounce > Duration::from_secs(600) {
            errs.push(format!(
                "reload.debounce: {} is longer than the 10m allowed (a change would wait that long to apply)",
                humantime::format_duration(self.debounce)
            ));
        }
    }
}

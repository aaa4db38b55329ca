//! Credentials in the config.

use serde::Deserialize;

/// A credential from the config: never printed (its `Debug` is `***`), never in errors,
/// logs, metrics or `/admin`.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("\"***\"")
    }
}

impl Secret {
    /// Usable as a Bearer token (the error never shows the key).
    pub fn check(&self) -> Result<(), String> {
        if self.0.is_empty() || self.0.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err("must be non-empty, without whitespace or control characters".into());
        }
        Ok(())
    }

    /// `Bearer <key>` as a header value marked sensitive (HTTP/2 never indexes it, `Debug`
    /// hides it).
    pub fn bearer(&self) -> Option<http::HeaderValue> {
        let mut v = http::HeaderValue::from_str(&format!("Bearer {}", self.0)).ok()?;
        v.set_sensitive(true);
        Some(v)
    }
}

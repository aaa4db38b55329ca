//! Credentials in the config.

use serde::{Deserialize, Serialize, Serializer};

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

/// What a printed config shows for every credential (`tokengate check --print`); a valid key,
/// so the printed config is itself a valid config.
pub(super) const MASK: &str = "***";

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(MASK)
    }
}

/// `serialize_with` of a credential kept as a plain string: [`MASK`] when set.
pub(super) fn masked<S: Serializer>(v: &Option<String>, s: S) -> Result<S::Ok, S::Error> {
    v.as_ref().map(|_| MASK).serialize(s)
}

/// `serialize_with` of a list of credentials: one [`MASK`] each.
pub(super) fn masked_all<S: Serializer>(v: &[String], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(v.iter().map(|_| MASK))
}

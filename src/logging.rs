//! The log: plain text lines (the default) or one JSON object per line (`log_format: json`
//! in the config, or `TOKENGATE_LOG_FORMAT=json`), for every line including the access log.
//! A JSON line has `ts`, `level`, `target` and `msg`; an access line also has its
//! `key=value` figures as fields of their own (`status`, `ttft_ms`, `model`, …).

use serde::Deserialize;
use std::io::Write;

/// How log lines are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// The environment variable that overrides the config's `log_format`.
pub const ENV: &str = "TOKENGATE_LOG_FORMAT";

impl LogFormat {
    /// `TOKENGATE_LOG_FORMAT` when set (`json` or `text`), else `configured`.
    pub fn from_env_or(configured: LogFormat) -> LogFormat {
        match std::env::var(ENV).ok().as_deref().map(str::trim) {
            Some(v) if v.eq_ignore_ascii_case("json") => LogFormat::Json,
            Some(v) if v.eq_ignore_ascii_case("text") => LogFormat::Text,
            _ => configured,
        }
    }
}

/// Installs the logger (level from `RUST_LOG`, default `info`).
pub fn init(format: LogFormat) {
    let mut b = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"));
    match format {
        LogFormat::Text => {
            b.format_timestamp_micros();
        }
        LogFormat::Json => {
            b.format(|buf, r| {
                let msg = r.args().to_string();
                let mut o = serde_json::Map::new();
                o.insert("ts".into(), buf.timestamp_micros().to_string().into());
                o.insert("level".into(), r.level().as_str().into());
                o.insert("target".into(), r.target().into());
                if r.target() == "access" {
                    access_fields(&msg, &mut o);
                }
                o.insert("msg".into(), msg.into());
                let line = serde_json::to_string(&o).unwrap_or_default();
                writeln!(buf, "{line}")
            });
        }
    }
    let _ = b.try_init();
}

/// The access line's figures: `METHOD PATH MODE key=value …` (a value may be a quoted
/// string with spaces).
fn access_fields(msg: &str, o: &mut serde_json::Map<String, serde_json::Value>) {
    let mut rest = msg.trim();
    for name in ["method", "path", "mode"] {
        let (w, r) = rest.split_once(' ').unwrap_or((rest, ""));
        o.insert(name.into(), w.into());
        rest = r.trim_start();
    }
    while let Some((k, r)) = rest.split_once('=') {
        let (v, r) = if let Some(q) = r.strip_prefix('"') {
            // A Rust-quoted string: up to the first unescaped quote.
            let mut end = None;
            let mut esc = false;
            for (i, c) in q.char_indices() {
                match c {
                    '\\' if !esc => esc = true,
                    '"' if !esc => {
                        end = Some(i);
                        break;
                    }
                    _ => esc = false,
                }
            }
            let end = end.unwrap_or(q.len());
            let v: serde_json::Value = q[..end].replace("\\\"", "\"").into();
            (v, q.get(end + 1..).unwrap_or(""))
        } else {
            let (w, r) = r.split_once(' ').unwrap_or((r, ""));
            // Ids stay strings, even one made only of decimal digits.
            let id = matches!(k.trim(), "id" | "trace_id" | "span_id");
            let v = match w.parse::<f64>() {
                Ok(n) if w != "-" && !id => serde_json::json!(n),
                _ => w.into(),
            };
            (v, r)
        };
        o.insert(k.trim().to_string(), v);
        rest = r.trim_start();
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn access_line_fields() {
        let mut o = serde_json::Map::new();
        super::access_fields(
            "POST /v1/chat/completions stream model=m status=200 ttft_ms=1.5 reason=- id=x trace_id=0af7651916cd43dd8448eb211c80319c span_id=1234567890123456 error=\"a \\\"b\\\" c\"",
            &mut o,
        );
        assert_eq!(o["method"], "POST");
        assert_eq!(o["status"], 200.0);
        assert_eq!(o["ttft_ms"], 1.5);
        assert_eq!(o["reason"], "-");
        assert_eq!(o["error"], "a \"b\" c");
        assert_eq!(o["trace_id"], "0af7651916cd43dd8448eb211c80319c");
        assert_eq!(o["span_id"], "1234567890123456");
    }
}

//! The status page's admin-token session: `/?token=…` opens it in an `HttpOnly`,
//! `SameSite=Strict` cookie holding an HMAC of the token with an expiry (never the token),
//! and the login page shown without one.

/// Name of the cookie that carries the admin token for the page.
pub const COOKIE: &str = "tokengate_admin";

/// The page shown instead of the status page when the admin token is missing or wrong.
pub fn login_html() -> String {
    let body = "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>tokengate · admin token needed</title>\
<link rel=\"stylesheet\" href=\"assets/status.css\"></head><body class=\"login\"><main>\
<h1>tokengate</h1><p>This admin listener needs its <code>admin_token</code>.</p>\
<p>Open <code>/?token=&lt;admin_token&gt;</code> once: the page then keeps the token in a cookie \
(HttpOnly, SameSite=Strict) and removes it from the address bar.</p></main></body></html>";
    body.to_string()
}

/// Decodes `%XX` escapes and `+` (a query parameter or a cookie value).
fn percent_decode(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(v) => {
                        out.push(v);
                        i += 3;
                    }
                    None => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    out
}

/// The decoded value of `name` in a query string.
pub fn query_param(query: Option<&str>, name: &str) -> Option<Vec<u8>> {
    query?
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| percent_decode(v))
}

/// The admin token carried by the page's cookie, decoded.
pub fn cookie_token(headers: &http::HeaderMap) -> Option<Vec<u8>> {
    headers
        .get_all(http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == COOKIE)
        .map(|(_, v)| percent_decode(v))
}

/// How long the page's session cookie lasts.
pub const SESSION_SECS: u64 = 12 * 3600;

/// The session proof for `token` expiring at `expires` (Unix seconds): an HMAC-SHA256
/// keyed by the admin token, so the cookie never holds the token, a forged or altered one
/// is refused, and changing the token ends every session.
fn session_mac(token: &[u8], expires: u64) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, token);
    let tag = ring::hmac::sign(
        &key,
        format!("tokengate-admin-session:{expires}").as_bytes(),
    );
    tag.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// `Set-Cookie` value of a page session opened at `now` (Unix seconds): `<expiry>.<mac>`,
/// `HttpOnly`, `SameSite=Strict`, `Max-Age` [`SESSION_SECS`].
pub fn set_cookie(token: &[u8], now: u64) -> String {
    let expires = now + SESSION_SECS;
    format!(
        "{COOKIE}={expires}.{}; Path=/; HttpOnly; SameSite=Strict; Max-Age={SESSION_SECS}",
        session_mac(token, expires)
    )
}

/// Whether a cookie value is a live session for `token` at `now` (Unix seconds).
pub fn session_ok(cookie: &[u8], token: &[u8], now: u64) -> bool {
    let Some((exp, mac)) = std::str::from_utf8(cookie)
        .ok()
        .and_then(|c| c.split_once('.'))
    else {
        return false;
    };
    let Ok(expires) = exp.parse::<u64>() else {
        return false;
    };
    expires > now
        && expires <= now + SESSION_SECS
        && crate::request::admit::ct_eq(mac.as_bytes(), session_mac(token, expires).as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_sessions_expire_and_belong_to_their_token() {
        let now = 1_000_000;
        let c = set_cookie(b"tok", now);
        let v = c.split(';').next().unwrap().split_once('=').unwrap().1;
        assert!(session_ok(v.as_bytes(), b"tok", now));
        assert!(session_ok(v.as_bytes(), b"tok", now + SESSION_SECS - 1));
        assert!(
            !session_ok(v.as_bytes(), b"tok", now + SESSION_SECS),
            "expired"
        );
        assert!(!session_ok(v.as_bytes(), b"other", now), "another token");
        assert!(!session_ok(b"tok", b"tok", now), "the raw token");
        assert!(!session_ok(b"", b"tok", now));
    }

    #[test]
    fn query_and_cookie_tokens_are_decoded() {
        assert_eq!(
            query_param(Some("a=1&token=s%20e+c%3Br"), "token").as_deref(),
            Some(&b"s e c;r"[..])
        );
        assert_eq!(query_param(Some("tokenx=1"), "token"), None);
        assert_eq!(query_param(None, "token"), None);
        let mut h = http::HeaderMap::new();
        h.insert(
            http::header::COOKIE,
            http::HeaderValue::from_static("x=1; tokengate_admin=p%40ss%3Bw%20rd"),
        );
        assert_eq!(cookie_token(&h).as_deref(), Some(&b"p@ss;w rd"[..]));
        assert_eq!(percent_decode("%zz%4"), b"%zz%4");
    }
}

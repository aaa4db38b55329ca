//! `tokengate probe [URL]`: one HTTP GET, exit 0 on a 2xx answer. The container image's
//! `HEALTHCHECK` (the slim image has no curl): `tokengate probe` checks the admin listener's
//! `/health` on 127.0.0.1:9090; engine-sim containers probe their own `/health`.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

/// The default target: the admin listener of the container config.
pub const DEFAULT_URL: &str = "http://127.0.0.1:9090/health";

/// GETs `url` (`http://host:port/path`) within `timeout`; `Ok(status)` when it answered.
pub fn get_status(url: &str, timeout: Duration) -> Result<u16, String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("{url}: only http:// URLs are probed"))?;
    let (hostport, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let hostport = if hostport.contains(':') {
        hostport.to_string()
    } else {
        format!("{hostport}:80")
    };
    let addr = hostport
        .to_socket_addrs()
        .map_err(|e| format!("{hostport}: {e}"))?
        .next()
        .ok_or_else(|| format!("{hostport}: no address"))?;
    let mut s = TcpStream::connect_timeout(&addr, timeout).map_err(|e| format!("{addr}: {e}"))?;
    s.set_read_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    s.set_write_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    // One write: `write!` on an unbuffered stream sends each formatted piece as its own
    // segment, and a peer that reads once may see only `GET `.
    let req =
        format!("GET {path} HTTP/1.0\r\nHost: {hostport}\r\nUser-Agent: tokengate-probe\r\n\r\n");
    s.write_all(req.as_bytes())
        .map_err(|e| format!("{addr}: {e}"))?;
    let mut head = [0u8; 64];
    let mut n = 0;
    while n < 12 {
        match s.read(&mut head[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) => return Err(format!("{addr}: {e}")),
        }
    }
    let line = String::from_utf8_lossy(&head[..n]);
    line.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("{addr}: not an HTTP answer: {line:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_status_of_a_real_answer() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut c, _) = l.accept().unwrap();
            // Up to the end of the head, however the client's segments arrive.
            let mut buf = Vec::new();
            let mut chunk = [0u8; 512];
            while !buf.ends_with(b"\r\n\r\n") {
                let n = c.read(&mut chunk).unwrap();
                assert!(n > 0, "closed before the end of the head: {buf:?}");
                buf.extend_from_slice(&chunk[..n]);
            }
            assert!(buf.starts_with(b"GET /health HTTP/1.0\r\n"));
            c.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nok\n")
                .unwrap();
        });
        let st = get_status(&format!("http://{addr}/health"), Duration::from_secs(5));
        t.join().unwrap();
        assert_eq!(st, Ok(200));
        assert!(get_status("https://x/", Duration::from_secs(1)).is_err());
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let dead = closed.local_addr().unwrap();
        drop(closed);
        assert!(get_status(&format!("http://{dead}/"), Duration::from_secs(1)).is_err());
    }
}

//! The events replicas send each other on the cluster channel, in a compact binary form:
//! a prompt's chained block hashes are 8 bytes each (a 3 k-token prompt: ~1.5 KB).
//!
//! Layout: kind (u8), then origin replica, service and instance as u16-length-prefixed
//! UTF-8, then `keep` (u32 LE), the block count (u32 LE) and the blocks (u64 LE each).

/// What happened on the replica that sent it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// A dispatch: the instance now holds the prompt's blocks (insert them in the index).
    Placed,
    /// The engine reported holding fewer: keep the first `keep` blocks there, forget the rest.
    Trimmed { keep: u32 },
    /// A throttling slot of the service was given back (wake its queue).
    Released,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub kind: Kind,
    pub origin: String,
    pub service: String,
    pub instance: String,
    pub blocks: Vec<u64>,
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    let b = &s.as_bytes()[..s.len().min(u16::MAX as usize)];
    out.extend_from_slice(&(b.len() as u16).to_le_bytes());
    out.extend_from_slice(b);
}

impl Event {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            16 + self.origin.len()
                + self.service.len()
                + self.instance.len()
                + self.blocks.len() * 8,
        );
        let (kind, keep) = match self.kind {
            Kind::Placed => (1u8, 0u32),
            Kind::Trimmed { keep } => (2, keep),
            Kind::Released => (3, 0),
        };
        out.push(kind);
        put_str(&mut out, &self.origin);
        put_str(&mut out, &self.service);
        put_str(&mut out, &self.instance);
        out.extend_from_slice(&keep.to_le_bytes());
        out.extend_from_slice(&(self.blocks.len() as u32).to_le_bytes());
        for b in &self.blocks {
            out.extend_from_slice(&b.to_le_bytes());
        }
        out
    }

    /// `None` for anything malformed (another program on the channel, a newer layout).
    pub fn decode(mut b: &[u8]) -> Option<Event> {
        fn take<'a>(b: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
            if b.len() < n {
                return None;
            }
            let (h, t) = b.split_at(n);
            *b = t;
            Some(h)
        }
        fn string(b: &mut &[u8]) -> Option<String> {
            let n = u16::from_le_bytes(take(b, 2)?.try_into().ok()?) as usize;
            String::from_utf8(take(b, n)?.to_vec()).ok()
        }
        let kind = *take(&mut b, 1)?.first()?;
        let origin = string(&mut b)?;
        let service = string(&mut b)?;
        let instance = string(&mut b)?;
        let keep = u32::from_le_bytes(take(&mut b, 4)?.try_into().ok()?);
        let n = u32::from_le_bytes(take(&mut b, 4)?.try_into().ok()?) as usize;
        if b.len() != n.checked_mul(8)? {
            return None;
        }
        let blocks = b
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
            .collect();
        let kind = match kind {
            1 => Kind::Placed,
            2 => Kind::Trimmed { keep },
            3 => Kind::Released,
            _ => return None,
        };
        Some(Event {
            kind,
            origin,
            service,
            instance,
            blocks,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_rejects_garbage() {
        for kind in [Kind::Placed, Kind::Trimmed { keep: 7 }, Kind::Released] {
            let e = Event {
                kind,
                origin: "r1".into(),
                service: "m".into(),
                instance: "e1".into(),
                blocks: vec![1, u64::MAX, 42],
            };
            let b = e.encode();
            assert_eq!(Event::decode(&b), Some(e));
            // Truncated anywhere: refused, never a panic.
            for cut in 0..b.len() {
                assert_eq!(Event::decode(&b[..cut]), None, "cut at {cut}");
            }
        }
        assert_eq!(Event::decode(b"hello"), None);
    }
}

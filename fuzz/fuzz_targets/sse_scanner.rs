//! The SSE scanner on arbitrary streams cut at arbitrary points, in both modes.
//! Pass-through: the client gets the input unchanged. Strip mode: the output does not depend
//! on where the stream was cut, is a subsequence of the input (only whole events removed),
//! equals the input when there is no `usage` in it, and finds the same usage as pass-through.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokengate::usage::SseScanner;

fn run(input: &[u8], cuts: &[u8], strip: bool) -> (Vec<u8>, SseScanner) {
    let mut s = SseScanner::new(strip);
    let mut out = Vec::new();
    let mut rest = input;
    let mut i = 0;
    while !rest.is_empty() {
        let n = 1 + cuts.get(i).copied().unwrap_or(255) as usize;
        i += 1;
        let (a, b) = rest.split_at(n.min(rest.len()));
        match s.feed(a) {
            Some(x) => out.extend_from_slice(&x),
            None => out.extend_from_slice(a),
        }
        rest = b;
    }
    if let Some(x) = s.finish() {
        out.extend_from_slice(&x);
    }
    (out, s)
}

fn is_subsequence(small: &[u8], big: &[u8]) -> bool {
    let mut it = big.iter();
    small.iter().all(|c| it.any(|b| b == c))
}

fuzz_target!(|data: &[u8]| {
    // First byte: how many cut sizes follow; then the cut sizes; then the stream.
    let Some((&k, rest)) = data.split_first() else {
        return;
    };
    let k = (k as usize % 16).min(rest.len());
    let (cuts, input) = rest.split_at(k);
    let (pass, ps) = run(input, cuts, false);
    assert_eq!(pass, input);
    let (whole, ws) = run(input, &[], false);
    assert_eq!(whole, input);
    assert_eq!(ps.usage, ws.usage);
    assert_eq!(ps.done, ws.done);
    let (a, sa) = run(input, cuts, true);
    let (b, _) = run(input, &[], true);
    assert_eq!(a, b, "strip output depends on the cuts");
    assert!(is_subsequence(&a, input));
    if memchr::memmem::find(input, b"usage").is_none() {
        assert_eq!(a, input);
    }
    assert_eq!(sa.usage, ws.usage);
    assert_eq!(sa.done, ws.done);
});

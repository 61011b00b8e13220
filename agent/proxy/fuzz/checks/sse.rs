//! The SSE framer's invariants, checked on one input. Shared by the `sse_framer`
//! fuzz target and the corpus regression test (`tests/fuzz_corpus.rs`), so both run
//! exactly the same code.
//!
//! For any bytes and any split of them into chunks:
//! - framing never panics, and the blocks plus the unterminated tail are exactly the
//!   input (nothing lost, duplicated or reordered);
//! - every split yields the blocks and the tail of the unsplit input (including
//!   splits inside a CRLF and inside a multibyte character);
//! - every block ends with its blank line and frames alone as itself; the tail frames
//!   alone as a tail;
//! - with a small event cap, a refused push loses no bytes either, and a successful
//!   one leaves at most the cap pending;
//! - `parse` never panics and agrees with a separate reading of the WHATWG rules.

use bytes::Bytes;
use outrigger_proxy::sse::{self, Event, Framer};

/// Runs every invariant on `input`; panics (a fuzz crash) when one fails.
pub fn check(input: &[u8]) {
    let (blocks, tail) = frame(input, &[input.len()]);
    let joined: Vec<u8> = blocks
        .iter()
        .flat_map(|b| b.iter().copied())
        .chain(tail.iter().flat_map(|t| t.iter().copied()))
        .collect();
    assert_eq!(joined, input, "blocks + tail must be the input");

    for block in &blocks {
        assert!(
            matches!(block.last(), Some(b'\n' | b'\r')),
            "a block ends with its blank line's terminator: {block:?}"
        );
        let (alone, alone_tail) = frame(block, &[block.len()]);
        assert_eq!(
            alone,
            std::slice::from_ref(block),
            "a block frames alone as itself"
        );
        assert_eq!(alone_tail, None);
        assert_eq!(
            sse::parse(block),
            reference_parse(block),
            "parse of {block:?}"
        );
    }
    if let Some(t) = &tail {
        let (alone, alone_tail) = frame(t, &[t.len()]);
        assert!(alone.is_empty(), "the tail holds no complete block: {t:?}");
        assert_eq!(alone_tail.as_ref(), Some(t));
        // Parsing an unterminated tail must not panic either.
        let _ = sse::parse(t);
    }

    for cuts in splits(input) {
        let (b, t) = frame(input, &cuts);
        assert_eq!(b, blocks, "split {cuts:?} changed the blocks");
        assert_eq!(t, tail, "split {cuts:?} changed the tail");
    }

    capped(input, 64);
}

/// Frames `input` cut into chunks of the given lengths (the last chunk takes the
/// rest), with the default event cap.
fn frame(input: &[u8], lengths: &[usize]) -> (Vec<Bytes>, Option<Bytes>) {
    let mut framer = Framer::new(usize::MAX);
    let mut out = Vec::new();
    let mut rest = input;
    for &n in lengths {
        let (chunk, after) = rest.split_at(n.min(rest.len()));
        if let Err(e) = framer.push(chunk, &mut out) {
            panic!("an uncapped framer refused input: {e}");
        }
        rest = after;
    }
    if !rest.is_empty()
        && let Err(e) = framer.push(rest, &mut out)
    {
        panic!("an uncapped framer refused input: {e}");
    }
    let tail = framer.finish(&mut out);
    (out, tail)
}

/// With a cap, pushes may be refused; the bytes must still all be accounted for.
fn capped(input: &[u8], cap: usize) {
    let mut framer = Framer::new(cap);
    let mut out = Vec::new();
    for chunk in input.chunks(7) {
        match framer.push(chunk, &mut out) {
            Ok(()) => assert!(
                framer.pending() <= cap,
                "{} bytes pending after an accepted push with a cap of {cap}",
                framer.pending()
            ),
            Err(e) => assert_eq!(e.limit, cap),
        }
    }
    let tail = framer.finish(&mut out);
    let joined: Vec<u8> = out
        .iter()
        .flat_map(|b| b.iter().copied())
        .chain(tail.iter().flat_map(|t| t.iter().copied()))
        .collect();
    assert_eq!(joined, input, "a capped framer lost or duplicated bytes");
}

/// The splits tried: single bytes; two-way splits where a split matters (around
/// each CR and LF, inside multibyte characters) plus a few evenly spaced; and
/// pseudo-random multi-way splits derived from the input itself, so a failure
/// reproduces from the input alone. Bounded, so a fuzz run stays fast.
fn splits(input: &[u8]) -> Vec<Vec<usize>> {
    let n = input.len();
    let mut out = vec![vec![1; n]];
    let line_ends = input
        .iter()
        .enumerate()
        .filter(|(_, b)| matches!(b, b'\r' | b'\n'))
        .flat_map(|(i, _)| [i, i + 1])
        .take(96);
    let in_chars = input
        .iter()
        .enumerate()
        .filter(|(_, b)| **b >= 0x80)
        .map(|(i, _)| i)
        .take(32);
    let even = (1..16).map(|k| k * n / 16);
    let mut points: Vec<usize> = line_ends
        .chain(in_chars)
        .chain(even)
        .filter(|p| (1..n).contains(p))
        .collect();
    points.sort_unstable();
    points.dedup();
    out.extend(points.into_iter().map(|p| vec![p]));
    let mut seed = input.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    });
    for round in 0..8_u64 {
        let mut lengths = Vec::new();
        let mut left = n;
        while left > 0 {
            seed = splitmix(seed);
            // Mostly tiny chunks (1-3 bytes, like the slicer toxic), some larger.
            let max = if round % 2 == 0 { 3 } else { 64 };
            let len = usize::try_from(seed % max).unwrap_or(1) + 1;
            let len = len.min(left);
            lengths.push(len);
            left -= len;
        }
        out.push(lengths);
    }
    out
}

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The fields of one event block, read straight from the WHATWG "interpret an event
/// stream" steps (BOM, line ends, comments, the first colon, one space, data joined
/// with LF, NUL in an id, digits-only retry), independently of `sse::parse`.
fn reference_parse(block: &[u8]) -> Event {
    let text = String::from_utf8_lossy(block);
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    let mut event = Event::default();
    let mut data: Option<String> = None;
    let mut line = String::new();
    let mut chars = text.chars().peekable();
    let mut lines = Vec::new();
    while let Some(c) = chars.next() {
        match c {
            '\r' => {
                if chars.peek() == Some(&'\n') {
                    chars.next();
                }
                lines.push(std::mem::take(&mut line));
            }
            '\n' => lines.push(std::mem::take(&mut line)),
            other => line.push(other),
        }
    }
    if !line.is_empty() {
        lines.push(line);
    }
    for line in lines {
        if line.is_empty() || line.starts_with(':') {
            continue;
        }
        let (field, value) = match line.find(':') {
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(' ').unwrap_or(v))
            }
            None => (line.as_str(), ""),
        };
        match field {
            "data" => {
                let d = data.get_or_insert_with(String::new);
                d.push_str(value);
                d.push('\n');
            }
            "event" => event.event = Some(value.to_string()),
            "id" if !value.contains('\0') => event.id = Some(value.to_string()),
            "retry" if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) => {
                event.retry = value.parse().ok();
            }
            _ => {}
        }
    }
    event.data = data.map(|mut d| {
        d.pop();
        d
    });
    event
}

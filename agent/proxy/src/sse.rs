//! Server-sent events, framed incrementally and byte-exactly.
//!
//! The relay must forward each event as soon as it is complete, journal it, and be
//! able to replay it later byte for byte, so the framer never re-encodes: it splits
//! the incoming bytes into raw event blocks (everything up to and including the
//! blank line that ends an event) and hands out zero-copy slices of them. Parsing
//! the fields of a block is a separate, pure step ([`parse`]).
//!
//! Line endings follow the WHATWG HTML spec: CRLF, LF or a lone CR, with CRLF one
//! terminator, even when the CR and the LF arrive in different chunks. A block is
//! only emitted once its terminator is certain, so any split of a byte stream into
//! chunks yields the same blocks.

use bytes::{Bytes, BytesMut};

/// The default cap on one event's size; a longer event is an error, not a memory
/// blow-up.
pub const DEFAULT_MAX_EVENT_BYTES: usize = 4 << 20;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("an SSE event exceeded {limit} bytes without ending; the upstream stream is malformed")]
pub struct EventTooLarge {
    pub limit: usize,
}

/// Splits a byte stream into raw SSE event blocks.
#[derive(Debug)]
pub struct Framer {
    buf: BytesMut,
    /// Index in `buf` up to which bytes have been scanned.
    scanned: usize,
    /// Bytes in the current line so far (terminator excluded).
    line_len: usize,
    /// A CR ended the previous line; a following LF belongs to the same terminator.
    pending_cr: bool,
    /// The line ended by that CR was blank: the block ends after the terminator.
    blank_after_cr: bool,
    max_event: usize,
}

impl Default for Framer {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_EVENT_BYTES)
    }
}

impl Framer {
    pub fn new(max_event: usize) -> Self {
        Self {
            buf: BytesMut::new(),
            scanned: 0,
            line_len: 0,
            pending_cr: false,
            blank_after_cr: false,
            max_event,
        }
    }

    /// Feeds `chunk`; appends every block completed by it to `out`.
    pub fn push(&mut self, chunk: &[u8], out: &mut Vec<Bytes>) -> Result<(), EventTooLarge> {
        self.buf.extend_from_slice(chunk);
        let mut i = self.scanned;
        while i < self.buf.len() {
            let b = self.buf[i];
            if self.pending_cr {
                self.pending_cr = false;
                if b == b'\n' {
                    // CRLF: the terminator ends after this LF.
                    if self.blank_after_cr {
                        self.blank_after_cr = false;
                        out.push(self.buf.split_to(i + 1).freeze());
                        i = 0;
                        continue;
                    }
                    i += 1;
                    continue;
                }
                if self.blank_after_cr {
                    // A lone CR ended the blank line; the block ends before `b`.
                    self.blank_after_cr = false;
                    out.push(self.buf.split_to(i).freeze());
                    i = 0;
                    continue;
                }
            }
            match b {
                b'\r' => {
                    self.pending_cr = true;
                    self.blank_after_cr = self.line_len == 0;
                    self.line_len = 0;
                }
                b'\n' => {
                    let blank = self.line_len == 0;
                    self.line_len = 0;
                    if blank {
                        out.push(self.buf.split_to(i + 1).freeze());
                        i = 0;
                        continue;
                    }
                }
                _ => self.line_len += 1,
            }
            i += 1;
        }
        self.scanned = i;
        if self.buf.len() > self.max_event {
            return Err(EventTooLarge {
                limit: self.max_event,
            });
        }
        Ok(())
    }

    /// Ends the stream: a block whose blank line ended with a lone CR is complete
    /// now; whatever else is left is an unterminated tail (the spec discards it; the
    /// relay forwards it as is, so the client sees exactly what the upstream sent).
    pub fn finish(&mut self, out: &mut Vec<Bytes>) -> Option<Bytes> {
        if self.pending_cr && self.blank_after_cr {
            out.push(self.buf.split().freeze());
        }
        self.pending_cr = false;
        self.blank_after_cr = false;
        self.scanned = 0;
        self.line_len = 0;
        if self.buf.is_empty() {
            None
        } else {
            Some(self.buf.split().freeze())
        }
    }

    /// Bytes received but not yet part of a complete block.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }
}

/// The fields of one event block.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Event {
    pub event: Option<String>,
    /// `data` lines joined with LF; `None` when the block carries no data (a comment
    /// or keep-alive), which the spec does not dispatch.
    pub data: Option<String>,
    pub id: Option<String>,
    pub retry: Option<u64>,
}

/// Parses the fields of a raw block (as produced by [`Framer`]).
pub fn parse(raw: &[u8]) -> Event {
    let text = String::from_utf8_lossy(raw);
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    let mut ev = Event::default();
    let mut data = String::new();
    let mut has_data = false;
    for line in lines(text) {
        if line.is_empty() || line.starts_with(':') {
            continue;
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        match field {
            "data" => {
                data.push_str(value);
                data.push('\n');
                has_data = true;
            }
            "event" => ev.event = Some(value.to_string()),
            "id" if !value.contains('\0') => ev.id = Some(value.to_string()),
            "retry" if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) => {
                ev.retry = value.parse().ok();
            }
            _ => {}
        }
    }
    if has_data {
        data.pop();
        ev.data = Some(data);
    }
    ev
}

/// The UTF-8 byte order mark a stream may open with (its decoder drops it there).
const BOM: &[u8] = "\u{feff}".as_bytes();

/// `raw` without a leading byte order mark (`raw` itself when it has none).
pub fn without_bom(raw: Bytes) -> Bytes {
    if raw.starts_with(BOM) {
        raw.slice(BOM.len()..)
    } else {
        raw
    }
}

/// `raw` without its lines of field `name`, byte for byte otherwise (`raw` itself
/// when it has none).
pub fn without_field(raw: Bytes, name: &[u8]) -> Bytes {
    let is_field = |line: &[u8]| {
        line.strip_prefix(name)
            .is_some_and(|rest| matches!(rest.first(), None | Some(b':' | b'\n' | b'\r')))
    };
    let mut kept: Option<BytesMut> = None;
    let mut start = 0;
    while start < raw.len() {
        // One line with its terminator (LF, CRLF or CR).
        let rest = &raw[start..];
        let end = start
            + memchr::memchr2(b'\n', b'\r', rest).map_or(rest.len(), |i| {
                if rest[i..].starts_with(b"\r\n") {
                    i + 2
                } else {
                    i + 1
                }
            });
        let line = &raw[start..end];
        if is_field(line) {
            kept.get_or_insert_with(|| BytesMut::from(&raw[..start]));
        } else if let Some(kept) = &mut kept {
            kept.extend_from_slice(line);
        }
        start = end;
    }
    kept.map_or(raw, BytesMut::freeze)
}

fn lines(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        match rest.find(['\r', '\n']) {
            Some(i) => {
                let line = &rest[..i];
                let skip = if rest[i..].starts_with("\r\n") { 2 } else { 1 };
                rest = &rest[i + skip..];
                Some(line)
            }
            None => {
                let line = rest;
                rest = "";
                Some(line)
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn frame_all(chunks: &[&[u8]]) -> (Vec<Bytes>, Option<Bytes>) {
        let mut f = Framer::default();
        let mut out = Vec::new();
        for c in chunks {
            f.push(c, &mut out).unwrap();
        }
        let tail = f.finish(&mut out);
        (out, tail)
    }

    #[test]
    fn splits_on_blank_lines_with_every_terminator() {
        let input = b"data: a\n\nevent: x\r\ndata: b\r\n\r\ndata: c\r\rdata: d\n\r\n: comment\n\n";
        let (blocks, tail) = frame_all(&[input]);
        let got: Vec<&[u8]> = blocks.iter().map(|b| b.as_ref()).collect();
        assert_eq!(
            got,
            vec![
                &b"data: a\n\n"[..],
                b"event: x\r\ndata: b\r\n\r\n",
                b"data: c\r\r",
                b"data: d\n\r\n",
                b": comment\n\n",
            ]
        );
        assert_eq!(tail, None);
    }

    #[test]
    fn crlf_split_across_chunks_is_one_terminator() {
        let (blocks, _) = frame_all(&[b"data: a\r\n\r", b"\ndata: b\n\n"]);
        assert_eq!(blocks[0].as_ref(), b"data: a\r\n\r\n");
        assert_eq!(blocks[1].as_ref(), b"data: b\n\n");
    }

    #[test]
    fn lone_cr_at_end_of_stream_completes_the_block() {
        let (blocks, tail) = frame_all(&[b"data: a\r\r"]);
        assert_eq!(blocks.len(), 1);
        assert_eq!(tail, None);
    }

    #[test]
    fn unterminated_tail_is_returned() {
        let (blocks, tail) = frame_all(&[b"data: a\n\ndata: par"]);
        assert_eq!(blocks.len(), 1);
        assert_eq!(tail.as_deref(), Some(&b"data: par"[..]));
    }

    #[test]
    fn oversized_event_is_an_error() {
        let mut f = Framer::new(16);
        let mut out = Vec::new();
        assert!(f.push(&[b'x'; 17], &mut out).is_err());
    }

    #[test]
    fn the_upstreams_own_ids_are_dropped_and_nothing_else() {
        let plain = Bytes::from_static(b"data: {\"id\":\"chatcmpl-1\"}\n\n");
        assert_eq!(without_field(plain.clone(), b"id"), plain);
        let named = Bytes::from_static(b"event: ping\nid: 7\ndata: {}\n\n");
        assert_eq!(
            without_field(named, b"id"),
            Bytes::from_static(b"event: ping\ndata: {}\n\n")
        );
        let first = Bytes::from_static(b"id\r\ndata: x\r\n\r\n");
        assert_eq!(
            without_field(first, b"id"),
            Bytes::from_static(b"data: x\r\n\r\n")
        );
        // A field that only starts with the letters is not an id.
        let other = Bytes::from_static(b"idle: 1\ndata: x\n\n");
        assert_eq!(without_field(other.clone(), b"id"), other);
    }

    #[test]
    fn parse_fields() {
        let cases: &[(&[u8], Event)] = &[
            (
                b"event: message_start\ndata: {\"a\":1}\n\n",
                Event {
                    event: Some("message_start".into()),
                    data: Some("{\"a\":1}".into()),
                    ..Event::default()
                },
            ),
            (
                b"data:x\ndata: y\nid: 7\nretry: 100\n\n",
                Event {
                    data: Some("x\ny".into()),
                    id: Some("7".into()),
                    retry: Some(100),
                    ..Event::default()
                },
            ),
            (b": keep-alive\n\n", Event::default()),
            (
                b"\xef\xbb\xbfdata: bom\n\n",
                Event {
                    data: Some("bom".into()),
                    ..Event::default()
                },
            ),
            (
                b"id: a\0b\nretry: 1x\ndata\n\n",
                Event {
                    data: Some(String::new()),
                    ..Event::default()
                },
            ),
        ];
        for (raw, want) in cases {
            assert_eq!(&parse(raw), want, "{:?}", String::from_utf8_lossy(raw));
        }
    }

    fn arb_stream() -> impl Strategy<Value = Vec<u8>> {
        let line = prop::sample::select(vec![
            "data: {\"x\":\"é\"}".to_string(),
            "event: delta".to_string(),
            ": ping".to_string(),
            "id: 42".to_string(),
            "data:".to_string(),
            String::new(),
        ]);
        let term = prop::sample::select(vec!["\n", "\r\n", "\r"]);
        prop::collection::vec((line, term), 0..40).prop_map(|parts| {
            let mut s = Vec::new();
            for (l, t) in parts {
                s.extend_from_slice(l.as_bytes());
                s.extend_from_slice(t.as_bytes());
            }
            s
        })
    }

    proptest! {
        /// Any split of an SSE byte stream into chunks yields the same blocks, and
        /// the blocks plus the tail are exactly the input.
        #[test]
        fn any_split_frames_the_same(input in arb_stream(), cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..12)) {
            let (whole, whole_tail) = frame_all(&[&input]);
            let mut points: Vec<usize> = cuts.iter().map(|c| c.index(input.len() + 1)).collect();
            points.sort_unstable();
            let mut chunks: Vec<&[u8]> = Vec::new();
            let mut prev = 0;
            for p in points { chunks.push(&input[prev..p]); prev = p; }
            chunks.push(&input[prev..]);
            let (split, split_tail) = frame_all(&chunks);
            prop_assert_eq!(&whole, &split);
            prop_assert_eq!(&whole_tail, &split_tail);
            let mut joined: Vec<u8> = whole.iter().flat_map(|b| b.to_vec()).collect();
            if let Some(t) = whole_tail { joined.extend_from_slice(&t); }
            prop_assert_eq!(joined, input);
            let parsed_whole: Vec<Event> = whole.iter().map(|b| parse(b)).collect();
            let parsed_split: Vec<Event> = split.iter().map(|b| parse(b)).collect();
            prop_assert_eq!(parsed_whole, parsed_split);
        }
    }
}

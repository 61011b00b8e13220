//! A model provider's answer body as the data plane reads it: with the provider's
//! key scrubbed out, and cut after N events when a `stream_cut` fault was drawn.
//!
//! Scrubbing sits here, under everything that reads an answer (the relay, the stream
//! producer that journals, the plain-body tee), so an upstream that quotes the key it
//! was sent — in an error or a success, streamed or not — never gets it to the agent
//! or into the journal. A key split across two frames is caught by holding back the
//! end of a frame that could be the start of the key; SSE frames end in a newline,
//! which no key contains, so events are never delayed. Without a key the body passes
//! through untouched.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use memchr::memmem;

use crate::body::BoxError;

/// What replaces a quoted key.
pub const REDACTED: &[u8] = b"<redacted>";

/// The upstream body of a model call.
pub struct UpstreamBody {
    inner: Option<Incoming>,
    scrub: Option<Scrub>,
    cut: Option<Cut>,
}

struct Cut {
    /// Events still to let through.
    left: u32,
    after_events: u32,
    /// The last allowed event went through: the next poll ends with an error.
    done: bool,
}

impl UpstreamBody {
    /// `key`: the credential sent to this upstream, scrubbed from what it answers.
    /// `cut_after`: events relayed before an injected cut.
    pub fn new(body: Incoming, key: Option<&str>, cut_after: Option<u32>) -> Self {
        Self {
            inner: Some(body),
            scrub: key.filter(|k| !k.is_empty()).map(Scrub::new),
            cut: cut_after.map(|n| Cut {
                left: n,
                after_events: n,
                done: false,
            }),
        }
    }

    /// The next frame's data after scrubbing, or what ended the body.
    fn next_data(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, BoxError>>> {
        loop {
            let Some(body) = self.inner.as_mut() else {
                return Poll::Ready(None);
            };
            let data = match Pin::new(body).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e.into()))),
                Poll::Ready(None) => {
                    self.inner = None;
                    let tail = self.scrub.as_mut().map(Scrub::finish).unwrap_or_default();
                    return Poll::Ready((!tail.is_empty()).then_some(Ok(tail)));
                }
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => data,
                    Err(_) => continue, // trailers: nothing to relay
                },
            };
            let data = match self.scrub.as_mut() {
                Some(s) => s.push(data),
                None => data,
            };
            if !data.is_empty() {
                return Poll::Ready(Some(Ok(data)));
            }
        }
    }
}

impl HttpBody for UpstreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if let Some(cut) = &this.cut
            && (cut.done || cut.left == 0)
        {
            // Dropping the upstream body closes its connection, as a real cut would.
            this.inner = None;
            return Poll::Ready(Some(Err(format!(
                "fault injected: the stream was cut after {} events",
                cut.after_events
            )
            .into())));
        }
        let data = match this.next_data(cx) {
            Poll::Ready(Some(Ok(data))) => data,
            Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
            Poll::Ready(None) => return Poll::Ready(None),
            Poll::Pending => return Poll::Pending,
        };
        let Some(cut) = this.cut.as_mut() else {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        };
        match boundary(&data, cut.left) {
            Ok(end) => {
                cut.left = 0;
                cut.done = true;
                Poll::Ready(Some(Ok(Frame::data(data.slice(..end)))))
            }
            Err(seen) => {
                cut.left -= seen;
                Poll::Ready(Some(Ok(Frame::data(data))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        let cut_pending = self.cut.as_ref().is_some_and(|c| c.done);
        let held = self.scrub.as_ref().is_some_and(|s| !s.held.is_empty());
        !cut_pending && !held && self.inner.as_ref().is_none_or(HttpBody::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        match (&self.inner, &self.scrub, &self.cut) {
            (Some(b), None, None) => b.size_hint(),
            _ => SizeHint::default(),
        }
    }
}

/// Where the `left`-th blank-line event boundary ends in `data`, if within it;
/// otherwise how many boundaries `data` holds.
fn boundary(data: &[u8], left: u32) -> Result<usize, u32> {
    let mut seen = 0;
    let mut i = 0;
    while i + 1 < data.len() {
        let end = if data[i] == b'\n' && data[i + 1] == b'\n' {
            Some(i + 2)
        } else if data[i..].starts_with(b"\r\n\r\n") {
            Some(i + 4)
        } else {
            None
        };
        match end {
            Some(end) => {
                seen += 1;
                if seen == left {
                    return Ok(end);
                }
                i = end;
            }
            None => i += 1,
        }
    }
    Err(seen)
}

/// Replaces a secret in a byte stream cut into arbitrary frames.
struct Scrub {
    finder: memmem::Finder<'static>,
    /// The end of the last frame that may be the start of the secret.
    held: BytesMut,
}

impl Scrub {
    fn new(secret: &str) -> Self {
        Self {
            finder: memmem::Finder::new(secret.as_bytes()).into_owned(),
            held: BytesMut::new(),
        }
    }

    fn secret(&self) -> &[u8] {
        self.finder.needle()
    }

    /// The bytes that can be released after `data`.
    fn push(&mut self, data: Bytes) -> Bytes {
        if self.held.is_empty() && self.finder.find(&data).is_none() {
            let hold = self.partial_suffix(&data);
            if hold == 0 {
                return data; // the common case: no copy
            }
            self.held.extend_from_slice(&data[data.len() - hold..]);
            return data.slice(..data.len() - hold);
        }
        let mut all = std::mem::take(&mut self.held);
        all.extend_from_slice(&data);
        let mut out = self.replace(&all);
        let hold = self.partial_suffix(&out);
        self.held = out.split_off(out.len() - hold);
        out.freeze()
    }

    /// Whatever is still held, at the end of the body.
    fn finish(&mut self) -> Bytes {
        std::mem::take(&mut self.held).freeze()
    }

    fn replace(&self, data: &[u8]) -> BytesMut {
        let mut out = BytesMut::with_capacity(data.len());
        let mut rest = data;
        while let Some(at) = self.finder.find(rest) {
            out.extend_from_slice(&rest[..at]);
            out.extend_from_slice(REDACTED);
            rest = &rest[at + self.secret().len()..];
        }
        out.extend_from_slice(rest);
        out
    }

    /// The length of the longest suffix of `data` that is a proper prefix of the secret.
    fn partial_suffix(&self, data: &[u8]) -> usize {
        let secret = self.secret();
        let longest = secret.len().saturating_sub(1).min(data.len());
        (1..=longest)
            .rev()
            .find(|&n| data[data.len() - n..] == secret[..n])
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scrub_all(secret: &str, frames: &[&[u8]]) -> Vec<u8> {
        let mut s = Scrub::new(secret);
        let mut out = Vec::new();
        for f in frames {
            out.extend_from_slice(&s.push(Bytes::copy_from_slice(f)));
        }
        out.extend_from_slice(&s.finish());
        out
    }

    #[test]
    fn a_secret_is_replaced_wherever_the_frames_split_it() {
        let text = b"data: {\"echo\":\"Bearer pk-canary-123\"}\n\n".as_slice();
        let want = b"data: {\"echo\":\"Bearer <redacted>\"}\n\n".to_vec();
        for cut in 0..=text.len() {
            let (a, b) = text.split_at(cut);
            assert_eq!(scrub_all("pk-canary-123", &[a, b]), want, "cut at {cut}");
        }
        let bytes: Vec<&[u8]> = text.chunks(1).collect();
        assert_eq!(scrub_all("pk-canary-123", &bytes), want);
        assert_eq!(scrub_all("k", &[b"kkk"]), b"<redacted><redacted><redacted>");
    }

    #[test]
    fn text_without_the_secret_is_passed_on_without_delay() {
        let mut s = Scrub::new("pk-canary-123");
        let event = Bytes::from_static(b"data: {\"x\":\"pk-canary\"}\n\n");
        assert_eq!(s.push(event.clone()), event);
        // A frame ending in what may be the secret's start waits for the next one.
        assert_eq!(s.push(Bytes::from_static(b"ab pk-ca")), "ab ".as_bytes());
        assert_eq!(s.push(Bytes::from_static(b"t\n")), "pk-cat\n".as_bytes());
        assert!(s.finish().is_empty());
    }

    #[test]
    fn boundaries_count_blank_lines() {
        assert_eq!(boundary(b"data: a\n\ndata: b\n\n", 1), Ok(9));
        assert_eq!(boundary(b"data: a\n\ndata: b\n\n", 2), Ok(18));
        assert_eq!(boundary(b"data: a\n\ndata: b\n\n", 3), Err(2));
        assert_eq!(boundary(b"data: a\r\n\r\n", 1), Ok(11));
        assert_eq!(boundary(b"data: a", 1), Err(0));
    }
}

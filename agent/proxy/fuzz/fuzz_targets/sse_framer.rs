//! Any bytes, any split: the SSE framer never panics and loses nothing; `parse`
//! agrees with the WHATWG rules. The checks live in `checks/sse.rs`, shared with the
//! corpus regression test.
#![no_main]

#[path = "../checks/sse.rs"]
mod sse;

libfuzzer_sys::fuzz_target!(|data: &[u8]| sse::check(data));

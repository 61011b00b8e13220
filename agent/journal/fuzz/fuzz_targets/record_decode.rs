//! Arbitrary bytes into every persisted journal shape: no panic, and what decodes
//! round-trips canonically. The checks live in `checks/record.rs`, shared with the
//! corpus regression test.
#![no_main]

#[path = "../checks/record.rs"]
mod record;

libfuzzer_sys::fuzz_target!(|data: &[u8]| record::check(data));

//! End-to-end tests: the real `outrigger` binary, started as a child process,
//! against in-process mock providers and tools on loopback.

mod support;

mod config_corpus;
mod continuation;
mod crash;
mod drill;
mod example_agent;
mod faults;
mod foundation;
mod gpu;
mod languages;
mod matrix;
mod policies;
mod security;
mod streams;
mod telemetry;
mod tools;

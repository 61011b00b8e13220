//! End-to-end tests: the real `outrigger` binary, started as a child process,
//! against in-process mock providers and tools on loopback.

mod support;

mod crash;
mod example_agent;
mod foundation;
mod gpu;
mod policies;
mod streams;
mod tools;

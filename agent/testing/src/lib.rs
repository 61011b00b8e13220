//! Test support for Outrigger: scripted stand-ins for everything the sidecar talks
//! to, all on loopback.
//!
//! - [`provider::MockProvider`]: an OpenAI- and Anthropic-dialect model server that
//!   answers with fixed bodies or SSE streams of N chunks, with configurable delays,
//!   tool-call deltas, 429s with `Retry-After`, 5xx, cuts after N events, slow first
//!   bytes, and an echo of the headers it received.
//!
//! - [`tool::MockTool`] and [`mcp::MockMcp`]: an HTTP tool and an MCP server whose
//!   calls are side effects counted per idempotency key, with faults before and
//!   after the effect (fail, reset, hang);
//! - [`checker`]: a Jepsen-style check of client outcomes against applied effects;
//! - [`passthrough`]: a minimal HTTP pass-through proxy, the benchmark's floor;
//! - [`otlp::Collector`]: a loopback OTLP/HTTP trace collector.
//!
//! Every mock records what it received and what it sent, so tests compare bytes
//! instead of trusting a description of them. The same code backs the
//! `outrigger-mock` binary used by the demo and the benchmarks.

pub mod checker;
pub mod faultproxy;
pub mod http;
pub mod mcp;
pub mod otlp;
pub mod passthrough;
pub mod provider;
pub mod sse;
pub mod tool;

//! The built-in policies (`plugins/retry`, `plugins/fallback`, `plugins/budget`) as
//! WebAssembly components, embedded so that a zero-config `outrigger serve` has
//! policies without any file on disk.
//!
//! The build script compiles the plugin crates for `wasm32-wasip2` (profile `plugin`)
//! on every build where their sources changed; the components are never committed.
//! Each constant is the exact component the sidecar loads, and its SHA-256 is the
//! content hash that policy versions (`retry@<hash>`) are derived from.

include!(concat!(env!("OUT_DIR"), "/builtins.rs"));

/// A built-in component: its name (the hook it implements), bytes and SHA-256 (hex).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Builtin {
    pub name: &'static str,
    pub bytes: &'static [u8],
    pub sha256: &'static str,
}

/// All built-ins, one per hook: `retry`, `fallback`, `budget`.
pub const ALL: [Builtin; 3] = [
    Builtin {
        name: "retry",
        bytes: RETRY,
        sha256: RETRY_SHA256,
    },
    Builtin {
        name: "fallback",
        bytes: FALLBACK,
        sha256: FALLBACK_SHA256,
    },
    Builtin {
        name: "budget",
        bytes: BUDGET,
        sha256: BUDGET_SHA256,
    },
];

/// The built-in named `name`, if there is one.
pub fn by_name(name: &str) -> Option<Builtin> {
    ALL.into_iter().find(|b| b.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_builtin_is_a_component() {
        // Preamble of a component binary: magic, version 0x0d, layer 1.
        const COMPONENT_PREAMBLE: [u8; 8] = [0x00, 0x61, 0x73, 0x6d, 0x0d, 0x00, 0x01, 0x00];
        for builtin in ALL {
            assert!(
                builtin.bytes.starts_with(&COMPONENT_PREAMBLE),
                "{} is not a component",
                builtin.name
            );
            assert_eq!(builtin.sha256.len(), 64);
        }
        assert_eq!(by_name("fallback").map(|b| b.bytes), Some(FALLBACK));
        assert!(by_name("nope").is_none());
    }
}

//! Writes the SDK's export macros with the WIT text inlined.
//!
//! The export macros expand to `wit_bindgen::generate!` inside the policy author's
//! crate, where a `path:` would resolve against *their* manifest directory. Inlining
//! the WIT as a string literal makes the macros work from any crate, and generating
//! them here keeps `wit/policy.wit` the single source of truth.

use std::path::PathBuf;
use std::{env, fs};

fn main() {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let wit_path = manifest_dir.join("../wit/policy.wit");
    let template_path = manifest_dir.join("src/export_macros.rs.in");
    println!("cargo::rerun-if-changed={}", wit_path.display());
    println!("cargo::rerun-if-changed={}", template_path.display());

    let result = (|| -> Result<(), String> {
        let wit = fs::read_to_string(&wit_path)
            .map_err(|e| format!("reading {}: {e}", wit_path.display()))?;
        let template = fs::read_to_string(&template_path)
            .map_err(|e| format!("reading {}: {e}", template_path.display()))?;
        // `{:?}` of a `str` is a valid Rust string literal with every character escaped.
        let generated = template.replace("@WIT@", &format!("{wit:?}"));
        let out = PathBuf::from(env::var_os("OUT_DIR").ok_or("OUT_DIR is not set")?)
            .join("export_macros.rs");
        fs::write(&out, generated).map_err(|e| format!("writing {}: {e}", out.display()))
    })();
    if let Err(message) = result {
        eprintln!("error: outrigger-policy-sdk build script: {message}");
        std::process::exit(1);
    }
}

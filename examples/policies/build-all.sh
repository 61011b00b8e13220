#!/usr/bin/env bash
# Builds the example policies into OUT_DIR:
#
#   examples/policies/build-all.sh [OUT_DIR]     # default: <repo>/target/example-policies
#
#   OUT_DIR/budget_py.wasm       Python budget policy       (examples/policies/python)
#   OUT_DIR/retry_js.wasm        JavaScript retry policy    (examples/policies/js)
#   OUT_DIR/deadline_retry.wasm  Rust deadline retry policy (examples/policies/rust)
#
# Idempotent, and quick when nothing changed: a Python or JavaScript component is
# rebuilt only when one of its inputs (source, build script, lock file, the WIT) is
# newer than it, and the Rust one is left to cargo's own change tracking and copied
# only when its bytes changed. The three build side by side; each one's output goes
# to OUT_DIR/logs/<name>.log and is shown when it fails.
#
# Needs python3, Node.js 20.19 or newer (on 22, 22.12 or newer) with npm, and the
# repository's Rust toolchain (rust-toolchain.toml names the wasm32-wasip2 target);
# the Python and JavaScript toolchains are installed from PyPI and npm on first use
# (see each folder's build.sh).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
out="${1:-$repo/target/example-policies}"
mkdir -p "$out/logs"
out="$(cd "$out" && pwd)"

# Prints the first of the input paths that is newer than $1, if any (or $1 itself
# when it does not exist).
stale() {
    local output="$1"
    shift
    [[ -f "$output" ]] || { echo "$output"; return; }
    find "$@" -newer "$output" -print -quit
}

build_python() {
    local why
    why="$(stale "$out/budget_py.wasm" "$here/python/app.py" "$here/python/build.sh" "$repo/wit")"
    if [[ -z "$why" ]]; then
        echo "budget_py.wasm is up to date"
        return
    fi
    echo "building budget_py.wasm ($why changed)"
    "$here/python/build.sh" "$out"
}

build_js() {
    local why
    why="$(stale "$out/retry_js.wasm" "$here/js/policy.js" "$here/js/build.mjs" "$here/js/build.sh" \
        "$here/js/package.json" "$here/js/package-lock.json" "$repo/wit")"
    if [[ -z "$why" ]]; then
        echo "retry_js.wasm is up to date"
        return
    fi
    echo "building retry_js.wasm ($why changed)"
    "$here/js/build.sh" "$out"
}

build_rust() {
    # A build of its own, in its own target directory beside the workspace's, with
    # the host's compiler flags and wrappers cleared: they are not meant for wasm;
    # --locked: the versions its committed Cargo.lock pins, or a failure.
    local target_dir="${CARGO_TARGET_DIR:-$repo/target}/example-policies-rust"
    (
        cd "$here/rust"
        unset RUSTFLAGS CARGO_ENCODED_RUSTFLAGS CARGO_BUILD_RUSTFLAGS RUSTC_WRAPPER \
            RUSTC_WORKSPACE_WRAPPER CARGO_BUILD_RUSTC_WRAPPER CARGO_BUILD_TARGET
        CARGO_TARGET_DIR="$target_dir" cargo build --target wasm32-wasip2 --release --locked
    )
    local built="$target_dir/wasm32-wasip2/release/deadline_retry.wasm"
    if cmp -s "$built" "$out/deadline_retry.wasm"; then
        echo "deadline_retry.wasm is up to date"
    else
        cp "$built" "$out/deadline_retry.wasm.partial"
        mv -f "$out/deadline_retry.wasm.partial" "$out/deadline_retry.wasm"
        echo "copied deadline_retry.wasm"
    fi
}

declare -A jobs=()
for name in python js rust; do
    "build_$name" >"$out/logs/$name.log" 2>&1 &
    jobs[$name]=$!
done

failed=()
for name in python js rust; do
    if wait "${jobs[$name]}"; then
        echo "$name: $(tail -n 1 "$out/logs/$name.log")"
    else
        failed+=("$name")
        echo "$name: FAILED; its build log follows" >&2
        sed 's/^/    /' "$out/logs/$name.log" >&2
    fi
done
if ((${#failed[@]})); then
    echo "example policies that did not build: ${failed[*]}" >&2
    exit 1
fi
echo "example policies in $out"

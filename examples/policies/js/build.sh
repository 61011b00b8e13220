#!/usr/bin/env bash
# Builds the JavaScript retry policy into OUT_DIR/retry_js.wasm.
#
#   ./build.sh [OUT_DIR]      # OUT_DIR defaults to <repo>/target/example-policies
#
# Installs its pinned toolchain (componentize-js 0.23.0 and what package-lock.json
# pins with it, from npm) into node_modules/ with `npm ci`; needs Node.js 20.19 or
# newer (on 22, 22.12 or newer: what rolldown and oxc-minify in that toolchain
# declare) and npm.
set -euo pipefail

node_supported() {
    node -e 'const [a, b] = process.versions.node.split(".").map(Number);
             process.exit((a === 20 && b >= 19) || a > 22 || (a === 22 && b >= 12) ? 0 : 1)' \
        2>/dev/null
}
if ! node_supported || ! command -v npm >/dev/null; then
    echo "js: needs Node.js 20.19 or newer (on 22, 22.12 or newer) and npm; found node" \
        "$(node --version 2>/dev/null || echo '(none)'), npm $(npm --version 2>/dev/null || echo '(none)')." \
        "Install them (https://nodejs.org/en/download) and run again; './x test' at the top" \
        "of the repository fetches a Node.js 20 from the npm registry when it must." >&2
    exit 1
fi

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
out="${1:-$repo/target/example-policies}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"

cd "$here"
# `npm ci` starts from an empty node_modules every time (a minute, 400 MB): skip it
# when the last install already matches the committed lock file.
installed="node_modules/.package-lock.json"
if [[ ! -f "$installed" || package-lock.json -nt "$installed" ]]; then
    echo "js: installing the toolchain pinned in package-lock.json" >&2
    npm ci --no-audit --no-fund --loglevel=error >&2
fi
node build.mjs "$out/retry_js.wasm"
echo "$out/retry_js.wasm"

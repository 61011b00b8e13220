#!/usr/bin/env bash
# Builds the Python budget policy into OUT_DIR/budget_py.wasm.
#
#   ./build.sh [OUT_DIR]      # OUT_DIR defaults to <repo>/target/example-policies
#
# Installs its pinned toolchain (componentize-py 0.25.1, from PyPI) into .venv/
# beside this script on first use; needs python3 (3.9 or newer) and nothing else.
# componentize-py bundles its own CPython, so the host Python only runs the tool.
set -euo pipefail

COMPONENTIZE_PY_VERSION="0.25.1"

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
out="${1:-$repo/target/example-policies}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"

venv="$here/.venv"
tool="$venv/bin/componentize-py"
if [[ "$("$tool" --version 2>/dev/null || true)" != "componentize-py $COMPONENTIZE_PY_VERSION" ]]; then
    echo "python: installing componentize-py $COMPONENTIZE_PY_VERSION into $venv" >&2
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check \
        "componentize-py==$COMPONENTIZE_PY_VERSION"
fi

# Build next to the result and rename it into place, so a sidecar watching OUT_DIR
# never picks up a half-written component.
partial="$out/budget_py.wasm.partial"
cd "$here"
"$tool" -d "$repo/wit" -w budget-policy componentize app -p "$here" -o "$partial" >&2
mv -f "$partial" "$out/budget_py.wasm"
echo "$out/budget_py.wasm"

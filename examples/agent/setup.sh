#!/usr/bin/env bash
# Creates .venv here with the OpenAI and Anthropic SDKs and everything they depend
# on, at the exact versions and hashes requirements.txt locks (idempotent; fast when
# done). requirements.in names the direct dependencies; requirements.txt says how to
# regenerate the lock from it. A changed lock gets a fresh environment (--clear), so
# that no package the lock no longer names stays behind; CI starts from a clean clone,
# so this costs it nothing.
set -euo pipefail
cd "$(dirname "$0")"
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import openai, anthropic" 2>/dev/null \
   || [ requirements.txt -nt .venv/.installed ]; then
  python3 -m venv --clear .venv
  .venv/bin/pip install --quiet --disable-pip-version-check --require-hashes --no-deps \
    -r requirements.txt
  touch .venv/.installed
fi
echo "$(pwd)/.venv/bin/python"

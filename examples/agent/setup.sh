#!/usr/bin/env bash
# Creates .venv here with the pinned OpenAI SDK (idempotent; fast when done).
set -euo pipefail
cd "$(dirname "$0")"
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import openai" 2>/dev/null \
   || [ requirements.txt -nt .venv/.installed ]; then
  python3 -m venv .venv
  .venv/bin/pip install --quiet --disable-pip-version-check -r requirements.txt
  touch .venv/.installed
fi
echo "$(pwd)/.venv/bin/python"

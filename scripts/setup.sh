#!/usr/bin/env bash
# All set-up on a fresh machine: venv, torch (CPU wheel) first, pinned requirements, the package, verl (tests),
# and Debian's chromium for the browser tests. Idempotent: a second run returns in about a second.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.lld-setup-stamp
want=$(cat requirements.txt requirements-verl.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/pip install -q --upgrade pip
  # torch first and alone: the CPU wheel on this machine; anything looser pulls a CUDA build.
  .venv/bin/pip install -q "$(grep -E '^torch==' requirements.txt)"
  .venv/bin/pip install -q -r requirements.txt
  .venv/bin/pip install -q --no-deps -e .
  # verl for the tests against its real classes: --no-deps (its transformers<5.11 pin would downgrade ours),
  # then the few CPU-only packages it imports (requirements-verl.txt says how they were found)
  .venv/bin/pip install -q --no-deps verl==0.9.1
  .venv/bin/pip install -q -r requirements-verl.txt
  # the C kernels of pinned numerics (fixed-order matmul, exp/log/sqrt/sin/cos), built once per machine (else at the first training)
  .venv/bin/python -m lld_monitor.backend.ckernels >/dev/null 2>&1 \
    || echo "setup: could not build the pinned-numerics kernels (needs cc); training will say what to do" >&2
  echo "$want" > "$stamp"
fi
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
    || echo "setup: could not install chromium; browser tests will be skipped" >&2
fi

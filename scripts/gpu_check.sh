#!/usr/bin/env bash
# The GPU check in one call (make gpu-check): every CUDA test (pytest -m gpu) and every GPU benchmark (bench/gpu.py),
# then one table; about 5-8 minutes on one H100.
#
# Run: bash scripts/gpu_check.sh           on the GPU machine, from the repo root (no network needed)
#      bash scripts/gpu_check.sh wheels    beforehand, on a machine with the package index (make gpu-wheels)
#
# The GPU machine needs CUDA and a plain python3 with torch, numpy, pyarrow, pandas and pytest; not this project's venv.
# `wheels` puts what that python lacks into .whl/ (ignored by git; carry it with the checkout): the few pure-Python
# packages the sub-jobs and the tests import, one pinned version each (requirements.txt), for the target's Python
# (GPU_CHECK_PYTHON_VERSION, default 3.12, manylinux x86_64), setuptools to build this project there, and the
# digits/diabetes arrays the tests' demo data come from (scikit-learn and scipy would be ~45 MB of wheels for them).
# The check installs the project (built from this checkout, so it is never stale) and those wheels into a scratch
# folder on PYTHONPATH, changing nothing in the machine's python; where that python has no scikit-learn, a stand-in
# `sklearn.datasets` in the scratch folder serves the saved arrays (load_digits, load_diabetes: the same numbers).
#
# Settings (environment): GPU_CHECK_OUT    where the JSON results go (default bench/results: gpu_check.json,
#                                          gpu_benchmarks.json, gpu_tests.xml, and latest.json merged)
#                         GPU_CHECK_PYTHON the python to test (default python3)
#                         GPU_CHECK_WHEELS the wheels folder (default .whl)
#                         GPU_CHECK_SITE   the scratch install folder (default $TMPDIR/stagewise-gpu-site, made anew)
#                         GPU_CHECK_BUDGET_S  seconds for the whole check (default 470); the tests get at most
#                         GPU_CHECK_TEST_S (default 330) of it, the benchmarks what is left. At its limit a phase is
#                         interrupted (SIGINT): pytest still reports the tests it ran, each finished benchmark is kept.
# Exit status: 0 when every test passed (or skipped) and no benchmark raised; 1 otherwise. A missed goal is shown, not
# a failure (as in make bench).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
WHEELS="$(realpath -m "${GPU_CHECK_WHEELS:-.whl}")"
export PYTHONUNBUFFERED=1 PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

# What the GPU machine's python lacks, by distribution. Runtime: what the GPU sub-jobs import (bench/gpu.py
# GPU_PACKAGES). Tests: pytest and the plugins and imports of tests/conftest.py (httpx for tests/live_airflow.py).
# Sweep: optuna and plotly (its summary) for the sweep-on-a-GPU test. tests/bench/test_gpu.py runs the sub-jobs, and
# collects the GPU tests, with nothing else importable, so a new import there fails on the CPU first.
RUNTIME=(pydantic pydantic_core annotated-types typing_extensions typing-inspection PyYAML fsspec)
TESTS=(pytest pluggy iniconfig Pygments packaging pytest-xdist execnet pytest-timeout
       httpx httpcore h11 anyio idna certifi)
SWEEP=(optuna alembic SQLAlchemy Mako MarkupSafe colorlog tqdm plotly narwhals)
BUILD=(setuptools pip)  # setuptools: the build backend of pyproject.toml; pip: runs from its wheel where python has none

download_wheels() {
  local version="${GPU_CHECK_PYTHON_VERSION:-3.12}" python=python3 specs=() name pin
  [[ -x .venv/bin/python ]] && python=.venv/bin/python
  for name in "${RUNTIME[@]}" "${TESTS[@]}" "${SWEEP[@]}" "${BUILD[@]}"; do
    # The pinned version where requirements.txt has one (names compared as PEP 503 normalises them), else the newest.
    pin=$(grep -iE "^${name//[-_]/[-_]}==" requirements.txt | head -n1 || true)
    specs+=("${pin:-$name}")
  done
  rm -rf "$WHEELS" && mkdir -p "$WHEELS"
  "$python" -m pip download --quiet --no-deps --only-binary=:all: --dest "$WHEELS" \
    --python-version "$version" --implementation cp --abi "cp${version/./}" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 "${specs[@]}"
  "$python" - "$WHEELS/demo-data.npz" <<'EOF'
import sys

import numpy as np
from sklearn.datasets import load_diabetes, load_digits

digits, diabetes = load_digits(), load_diabetes(scaled=False)
np.savez_compressed(sys.argv[1], digits_data=digits.data, digits_target=digits.target, diabetes_data=diabetes.data,
                    diabetes_target=diabetes.target, diabetes_feature_names=np.array(diabetes.feature_names))
EOF
  ls "$WHEELS"
  echo "$(ls "$WHEELS"/*.whl | wc -l) wheels and the demo arrays in $WHEELS ($(du -sh "$WHEELS" | cut -f1)) for Python $version"
}

if [[ "${1:-}" == "wheels" ]]; then
  download_wheels
  exit 0
fi

started=$(date +%s)
PY="${GPU_CHECK_PYTHON:-python3}"
OUT="$(realpath -m "${GPU_CHECK_OUT:-bench/results}")"
SITE="$(realpath -m "${GPU_CHECK_SITE:-${TMPDIR:-/tmp}/stagewise-gpu-site}")"
BUDGET_S="${GPU_CHECK_BUDGET_S:-470}"
TEST_S="${GPU_CHECK_TEST_S:-330}"
mkdir -p "$OUT"
if ! ls "$WHEELS"/*.whl > /dev/null 2>&1; then
  echo "no wheels in $WHEELS: run 'make gpu-wheels' on a machine with the package index first, and bring $WHEELS along" >&2
  exit 2
fi
"$PY" -c "import torch, numpy, pyarrow" || { echo "$PY needs torch, numpy and pyarrow" >&2; exit 2; }
tag=$("$PY" -c "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')")
if ! ls "$WHEELS"/pydantic_core-*-"$tag"-*.whl > /dev/null 2>&1; then
  echo "the wheels in $WHEELS are not for this python ($tag): run 'GPU_CHECK_PYTHON_VERSION=$("$PY" -c \
'import sys; print(*sys.version_info[:2], sep=".")') make gpu-wheels' where the package index is" >&2
  exit 2
fi
"$PY" -c "import sys, torch; print(f'python {sys.version.split()[0]}, torch {torch.__version__}, CUDA:',
                                    torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')"

# pip: the machine's, else the one in the wheels folder (a wheel runs as a zip).
if "$PY" -m pip --version > /dev/null 2>&1; then
  PIP=("$PY" -m pip)
else
  PIP=("$PY" "$(ls "$WHEELS"/pip-*.whl | head -n1)/pip")
fi

echo "== installing into $SITE (from $WHEELS, no index)"
rm -rf "$SITE" && mkdir -p "$SITE"
build="$(mktemp -d)"
trap 'rm -rf "$build"' EXIT
# The project as pyproject.toml maps it (tasks/ -> stagewise, ...), built from a copy so the checkout gets no build/
# or egg-info; setuptools comes from the wheels folder into pip's isolated build environment.
cp -r pyproject.toml README.md tasks examples "$build/"
mkdir -p "$build/plugins" && cp -r plugins/stagewise_airflow "$build/plugins/"
"${PIP[@]}" install --quiet --no-index --find-links "$WHEELS" --no-deps --upgrade --target "$SITE" "$build"
mapfile -t packages < <(ls "$WHEELS"/*.whl | grep -vE '/(pip|setuptools)-[^/]*\.whl$')
"${PIP[@]}" install --quiet --no-index --no-deps --upgrade --target "$SITE" "${packages[@]}"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import sklearn.datasets" > /dev/null 2>&1; then
  mkdir -p "$SITE/sklearn"
  : > "$SITE/sklearn/__init__.py"
  cat > "$SITE/sklearn/datasets.py" <<EOF
"""A stand-in made by scripts/gpu_check.sh: scikit-learn's bundled digits and diabetes, as saved by 'make gpu-wheels'."""
from types import SimpleNamespace

import numpy as np

_SAVED = "$WHEELS/demo-data.npz"


def load_digits():
    with np.load(_SAVED) as saved:
        return SimpleNamespace(data=saved["digits_data"], target=saved["digits_target"])


def load_diabetes(scaled=False):
    assert not scaled, "the saved diabetes are unscaled"
    with np.load(_SAVED) as saved:
        return SimpleNamespace(data=saved["diabetes_data"], target=saved["diabetes_target"],
                               feature_names=[str(name) for name in saved["diabetes_feature_names"]])
EOF
  echo "scikit-learn is not installed: its digits and diabetes come from $WHEELS/demo-data.npz"
fi
"$PY" -c "import stagewise.train, stagewise.infer; print('stagewise from', stagewise.__path__[0])"

echo "== pytest -m gpu (at most ${TEST_S} s)"
mapfile -t test_files < <(grep -rlE "pytest\.mark\.gpu\b" tests --include='test_*.py' | sort)
rm -f "$OUT/gpu_tests.xml" "$OUT/gpu_benchmarks.json"
tests_rc=0
timeout -s INT -k 30 "$TEST_S" "$PY" -m pytest -m gpu -p no:cacheprovider -q -rfEs --junitxml="$OUT/gpu_tests.xml" \
  "${test_files[@]}" || tests_rc=$?
cut_short=()
(( tests_rc == 124 || tests_rc == 137 )) && cut_short=(--tests-cut-short)

left=$(( BUDGET_S - ($(date +%s) - started) ))
(( left < 60 )) && left=60
echo "== GPU benchmarks (at most ${left} s)"
timeout -s INT -k 30 "$left" "$PY" -m bench.gpu run --out "$OUT" || echo "the benchmarks exited with $?"

echo "== the GPU check"
"$PY" -m bench.gpu report --out "$OUT" --junit "$OUT/gpu_tests.xml" --started "$started" "${cut_short[@]}"

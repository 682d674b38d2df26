#!/usr/bin/env bash
# The tests on another torch release, in a fresh virtual environment outside the
# repository: the quick suite (-m "not slow") and the fast-path test
# (tests/test_fast_path.py). The environment is removed afterwards.
#
#   bash benchmarks/compat.sh 2.15.0
#
# The release must lie in the range pyproject.toml declares (pip refuses others).
# .ci/run runs this for the newest and the oldest declared release; docs/compat.md
# has the results.
set -euo pipefail
version=${1:?usage: bash benchmarks/compat.sh TORCH_VERSION}
cd "$(dirname "$0")/.."

work=$(mktemp -d "${TMPDIR:-/tmp}/epass-torch-$version.XXXXXX")
trap 'rm -rf "$work"' EXIT
venv_python=$work/venv/bin/python

start=$SECONDS
python -m venv "$work/venv"
# torch named in the same command as the project, so that pip never moves it. A local
# pip constraint file may cap torch below the release asked for: lifted here.
export PIP_CONSTRAINT=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
"$venv_python" -m pip install -q "torch==$version" -e ".[test]"
"$venv_python" -c "import torch; print('torch', torch.__version__, 'in', '$work/venv')"
installed=$SECONDS

"$venv_python" -m pytest -q -m "not slow"
"$venv_python" -m pytest -q tests/test_fast_path.py
echo "torch $version: install $((installed - start)) s, tests $((SECONDS - installed)) s"

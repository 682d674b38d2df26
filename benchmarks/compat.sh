#!/usr/bin/env bash
# The tests on another torch release, in a virtual environment outside the
# repository: the quick suite (-m "not slow") and the fast-path test
# (tests/decomp/test_fast_path.py).
#
#   bash benchmarks/compat.sh 2.15.0
#   bash benchmarks/compat.sh 2.15.0 --install-only   # the environment, no tests
#
# Linux wheels of torch on PyPI are CUDA builds of about 5.6 GB, so the environment
# is kept for the next run, in $EPASS_COMPAT_DIR (default ~/.cache/epass-compat);
# the project itself is reinstalled from this checkout every time. Set
# EPASS_COMPAT_FRESH=1 to build the environment anew.
#
# The release must lie in the range pyproject.toml declares (pip refuses others).
# .ci/run runs this for the newest and the oldest declared release; docs/compat.md
# has the results.
set -euo pipefail
version=${1:?usage: bash benchmarks/compat.sh TORCH_VERSION [--install-only]}
install_only=0
case "${2:-}" in
    "") ;;
    --install-only) install_only=1 ;;
    *) echo "compat.sh: unknown option '$2' (only --install-only)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."

work=${EPASS_COMPAT_DIR:-$HOME/.cache/epass-compat}/torch-$version
venv_python=$work/venv/bin/python
if [ "${EPASS_COMPAT_FRESH:-0}" = 1 ] || ! "$venv_python" -c "import torch" >/dev/null 2>&1; then
    rm -rf "$work"
fi

start=$SECONDS
[ -x "$venv_python" ] || python -m venv "$work/venv"
# torch named in the same command as the project, so that pip never moves it. A local
# pip constraint file may cap torch below the release asked for: lifted here.
export PIP_CONSTRAINT=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
"$venv_python" -m pip install -q "torch==$version" -e ".[test]"
# The environment is kept between runs: a plugin that an older test run installed
# into it would be loaded by every `epass passes` (and import torch there).
"$venv_python" -m pip uninstall -q -y epass-example-plugin 2>/dev/null || true
"$venv_python" -c "import torch; print('torch', torch.__version__, 'in', '$work/venv')"
installed=$SECONDS
if [ "$install_only" = 1 ]; then
    echo "torch $version: install $((installed - start)) s"
    exit 0
fi

"$venv_python" -m pytest -q -n auto -m "not slow"
"$venv_python" -m pytest -q -n auto tests/decomp/test_fast_path.py
echo "torch $version: install $((installed - start)) s, tests $((SECONDS - installed)) s"

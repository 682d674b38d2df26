#!/usr/bin/env bash
# One declared torch release, in a virtual environment outside the repository that
# holds the README's install (torch, the matching torchvision, `pip install -e
# ".[test]"`): the internals checks, the fast-path test, the cases made exact per release,
# the real-model smoke (benchmarks/smoke.py) and `epass demo`. docs/compat.md has the results.
#
#   bash benchmarks/compat.sh 2.11.0                 # install if needed, then test
#   bash benchmarks/compat.sh 2.11.0 --install-only  # the environment, no tests
#   bash benchmarks/compat.sh 2.11.0 --quick-suite   # the quick suite as well
#
# Linux wheels of torch on PyPI are CUDA builds of about 5.6 GB (PyPI serves no
# smaller one), so the environment is kept for the next run, in $EPASS_COMPAT_DIR
# (default ~/.cache/epass-compat); the project itself is reinstalled from this
# checkout every time. Set EPASS_COMPAT_FRESH=1 to build the environment anew.
#
# The release must lie in the range pyproject.toml declares (pip refuses others).
# .ci/run runs this for every declared release but the reference.
set -euo pipefail
version=${1:?usage: bash benchmarks/compat.sh TORCH_VERSION [--install-only|--quick-suite]}
mode=${2:-tests}
case "$mode" in
    tests | --install-only | --quick-suite) ;;
    *) echo "compat.sh: unknown option '$mode' (--install-only or --quick-suite)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."

work=${EPASS_COMPAT_DIR:-$HOME/.cache/epass-compat}/torch-$version
venv_python=$work/venv/bin/python
if [ "${EPASS_COMPAT_FRESH:-0}" = 1 ] || ! "$venv_python" -c "import torch" >/dev/null 2>&1; then
    rm -rf "$work"
fi

# torchvision's release pairs with torch's: minor plus 15, same patch (torch 2.12.1
# with torchvision 0.27.1); another patch of it can be built against another torch.
minor=$(echo "$version" | cut -d. -f2)
patch=$(echo "$version" | cut -d. -f3)
torchvision="0.$((minor + 15)).${patch:-0}"

start=$SECONDS
[ -x "$venv_python" ] || python -m venv "$work/venv"
# torch named in the same command as the project, so that pip never moves it. A local
# pip constraint file may cap torch below the release asked for: lifted here. No pip
# cache: the environment is the cache, and a second copy of the wheels would double
# the disk it takes.
export PIP_CONSTRAINT=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_NO_CACHE_DIR=1
# A torchvision for the release, where the index serves one (PyPI has none for torch 2.15.0
# on 2026-12-04): without it the smoke says its CNN was skipped.
if ! "$venv_python" -m pip install -q "torch==$version" "torchvision==$torchvision" -e ".[test]"; then
    echo "compat.sh: no torchvision==$torchvision for torch $version; installing without it"
    "$venv_python" -m pip install -q "torch==$version" -e ".[test]"
fi
# The environment is kept between runs: a plugin that an older test run installed
# into it would be loaded by every `epass passes` (and import torch there).
"$venv_python" -m pip uninstall -q -y epass-example-plugin 2>/dev/null || true
"$venv_python" -c "import torch; print('torch', torch.__version__, 'in', '$work/venv')"
installed=$SECONDS
if [ "$mode" = --install-only ]; then
    echo "torch $version: install $((installed - start)) s"
    exit 0
fi

if [ "$mode" = --quick-suite ]; then
    "$venv_python" -m pytest -q -n auto -m "not slow"
fi
# The internals as epass calls them, and the fast path on the zoo (marked slow).
# The internals, the fast path, and the cases made exact per release
# (_torch.internals.EXACT_RELEASE: in check mode where this release is one of them, their
# fallback where it is not).
"$venv_python" -m pytest -q -n auto tests/decomp/test_internals.py tests/test_torch_internals.py \
    tests/decomp/test_fast_path.py tests/decomp/test_inplace.py tests/decomp/test_shapes.py \
    tests/decomp/test_splice.py
"$venv_python" benchmarks/smoke.py
demo=$(mktemp -d)
(cd "$demo" && "$work/venv/bin/epass" demo >/dev/null && echo "epass demo: passed")
rm -rf "$demo"
echo "torch $version: install $((installed - start)) s, tests $((SECONDS - installed)) s"

#!/usr/bin/env bash
# Explore new random examples of the property tests, for longer than CI does.
#
#   benchmarks/fuzz.sh [ROUNDS] [pytest node ids...]
#
# Each round runs the tests with the "fuzz" hypothesis profile (randomized, no example
# database) and a fresh 128-bit seed. On a failure it prints the seed that reproduces
# it; turn hypothesis's "Falsifying example" into an explicit @example on the test.
# Not run in CI (CI uses the derandomized "ci" profile).
set -uo pipefail
cd "$(dirname "$0")/.."

rounds="${1:-20}"
shift || true
if [ "$#" -eq 0 ]; then
    set -- \
        tests/decomp/test_splice.py::test_random_modules_and_tables_match_torch \
        tests/decomp/test_splice.py::test_random_multi_output_and_complex_ops_match_torch \
        tests/decomp/test_writes_random.py \
        tests/test_properties.py \
        tests/test_properties_guarantees.py
fi

unset CI
failed=0
for round in $(seq 1 "$rounds"); do
    seed="$(python -c 'import secrets; print(secrets.randbits(128))')"
    echo "== round $round/$rounds: --hypothesis-seed=$seed"
    if ! PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python -m pytest -q -x \
        -p no:cacheprovider --hypothesis-profile=fuzz --hypothesis-seed="$seed" "$@"; then
        echo "FAILED with --hypothesis-seed=$seed: rerun with"
        echo "  python -m pytest $* --hypothesis-profile=fuzz --hypothesis-seed=$seed"
        failed=1
    fi
done
exit "$failed"

#!/usr/bin/env bash
# Download the wheels bench/gpu/wheels.txt pins into .whl/ at the repository root (git-ignored),
# for CPython 3.12 on manylinux x86_64: the packages bench/gpu/check.sh needs on a GPU machine
# that cannot reach a package index. Run it on a machine that can, before the working tree is
# copied there; what is already in .whl/ is kept.
#
#     bench/gpu/fetch_wheels.sh && du -sh .whl
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python="${PYTHON:-python3}"
mkdir -p "$root/.whl"
grep -v '^\s*\(#\|$\)' "$root/bench/gpu/wheels.txt" | while read -r pin; do
    "$python" -m pip download --quiet --disable-pip-version-check --no-deps \
        --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$root/.whl" "$pin"
done
ls "$root/.whl"
du -sh "$root/.whl"

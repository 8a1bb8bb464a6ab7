#!/usr/bin/env bash
# Checks the deployment bundle (`make manifests-check`):
#  1. drift: manifests/ is exactly what render.sh makes from kustomize/;
#  2. validation: every rendered file (bundles and examples, i.e. the agent
#     sidecar applied to workloads) against the JSON schemas of the three
#     newest Kubernetes minors that the pinned kubernetes-validate bundles,
#     strictly (unknown fields fail); CRDs (ServiceMonitor) against
#     testbed/k8s/schemas/. Offline once pyenv.sh has installed the tools.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$root"

venv=$(bash "$here/pyenv.sh")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

echo "== manifests: drift"
bash "$here/render.sh" "$tmp/manifests"
if ! diff -ru manifests "$tmp/manifests"; then
  echo "manifests/ is out of date with kustomize/: run \`make manifests\` and commit the result" >&2
  exit 1
fi
echo "manifests/ matches kustomize/"

echo "== manifests: schemas"
mapfile -t files < <(find "$tmp/manifests" -name '*.yaml' -type f | sort)
[ "${#files[@]}" -gt 0 ] || { echo "check.sh: nothing rendered" >&2; exit 1; }
(cd "$tmp" && "$venv/bin/python" "$here/validate.py" "${files[@]#"$tmp/"}")

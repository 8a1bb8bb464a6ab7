#!/usr/bin/env bash
# Checks the deployment bundle (`make manifests-check`):
#  1. drift: the generated component kustomizations are what
#     components.py makes, and manifests/ is exactly what render.sh makes
#     from kustomize/ (with the pinned kustomize version, KUSTOMIZE_VERSION);
#  2. validation: every rendered file (installs, examples, and the test
#     cases of testbed/k8s/cases) against the JSON schemas of the three
#     newest Kubernetes minors that the pinned kubernetes-validate bundles
#     and of the kind/k3d testbeds' versions, strictly (unknown fields
#     fail); custom resources (ServiceMonitor, cert-manager's Issuer and
#     Certificate) against testbed/k8s/schemas/;
#  3. policy: the rules policy.py states (native sidecar, no default policy
#     on users' pods, no CRD in an install, PDBs that let nodes drain, a
#     headless governing Service, claim templates no label reaches,
#     recommended labels, ephemeral storage, Pod Security restricted, TLS
#     that cert-manager can issue and every client speaks...);
#  4. datasets: what testbed/datasets/on-cluster.sh deploys on kind and k3d
#     (its --render: the install with the datasets and node-cache
#     components, a dataset-consumer Job), validated and within policy;
#  5. the release bundle: release-bundle.sh pins every image by digest.
# Offline once pyenv.sh has installed the tools.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$root"

venv=$(bash "$here/pyenv.sh")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)

echo "== manifests: generated components"
python3 "$here/components.py" --check
echo "components match components.py"

echo "== manifests: drift"
want=$(cat "$here/KUSTOMIZE_VERSION")
if [ -n "${KUSTOMIZE:-}" ]; then
  have=$(${KUSTOMIZE%% *} version 2>/dev/null || true)
else
  have=$(kubectl version --client 2>/dev/null | sed -n 's/^Kustomize Version: //p')
fi
mkdir -p "$tmp/cases"
KT_RENDER_CASES="$tmp/cases" bash "$here/render.sh" "$tmp/manifests"
if ! diff -ru manifests "$tmp/manifests"; then
  echo "manifests/ is out of date with kustomize/: run \`make manifests\` and commit the result" >&2
  if [ "$have" != "$want" ]; then
    echo "(note: this kustomize is ${have:-unknown}; manifests/ is rendered with $want, and another" >&2
    echo " version may format the same objects differently: install kubectl with kustomize $want)" >&2
  fi
  exit 1
fi
echo "manifests/ matches kustomize/ (kustomize ${have:-unknown}; pinned $want)"

echo "== manifests: schemas"
mapfile -t files < <(cd "$tmp" && find manifests cases -name '*.yaml' -type f | sort)
[ "${#files[@]}" -gt 0 ] || { echo "check.sh: nothing rendered" >&2; exit 1; }
(cd "$tmp" && "$venv/bin/python" "$here/validate.py" "${files[@]}")

echo "== manifests: policy"
(cd "$tmp" && "$venv/bin/python" "$here/policy.py" --version "$version" "${files[@]}")

echo "== datasets on kind and k3d (what testbed/datasets/on-cluster.sh deploys)"
bash "$root/testbed/datasets/on-cluster.sh" --render "$tmp/datasets"
(cd "$tmp" && "$venv/bin/python" "$here/validate.py" datasets/*.yaml | tail -1)
(cd "$tmp" && "$venv/bin/python" "$here/policy.py" --version "$version" datasets/*.yaml)

echo "== release bundle"
bash "$here/release-bundle.sh" --self-test "$tmp/release"

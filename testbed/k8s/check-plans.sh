#!/usr/bin/env bash
# What the kind and k3d targets would deploy, checked without a cluster
# (`make cluster-plans`, part of `make test`): plans every library scenario
# with `kt-scenario run --dry-run` (which renders each scenario's generated
# kustomization with kubectl's kustomize and runs nothing else), then
# validates every rendered deployment against the Kubernetes schemas (the
# testbeds' version among them) and testbed/k8s/policy.py. A scenario the
# plan cannot make fails; one a cluster cannot run is skipped with its
# reason, which is printed.
#
#   bash testbed/k8s/check-plans.sh KT_SCENARIO_BINARY
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$root"
bin=${1:?usage: check-plans.sh KT_SCENARIO_BINARY}
venv=$(bash "$here/pyenv.sh")
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

for target in kind k3d; do
  work=$tmp/$target
  # The bundle's own tag, so the images are what the policy expects.
  KT_IMAGE_TAG=$version "$bin" run scenarios --target "$target" --dry-run \
    --work-dir "$work" >"$tmp/$target.plan" 2>&1 ||
    { cat "$tmp/$target.plan" >&2; echo "check-plans.sh: the $target plan failed" >&2; exit 1; }
  if grep -n '^# failed' "$tmp/$target.plan" >&2; then
    echo "check-plans.sh: a step of the $target plan fails (above; the plan is in $tmp/$target.plan)" >&2
    exit 1
  fi
  planned=$(grep -c '^# kt-scenario plan: .* nothing was run$' "$tmp/$target.plan" || true)
  echo "== $target: $planned scenario(s) planned"
  grep ': skipped: ' "$tmp/$target.plan" | sed 's/^# kt-scenario plan: /   skipped: /; s/: skipped: / -- /' || true
  mapfile -t rendered < <(find "$work" -name rendered.yaml | sort)
  [ "${#rendered[@]}" = "$planned" ] ||
    { echo "check-plans.sh: $planned plans but ${#rendered[@]} rendered deployments" >&2; exit 1; }
  (cd "$work" && "$venv/bin/python" "$here/validate.py" "${rendered[@]#"$work/"}" | tail -1)
  (cd "$work" && "$venv/bin/python" "$here/policy.py" --version "$version" "${rendered[@]#"$work/"}")
done

#!/usr/bin/env bash
# Renders the release bundle: one install-<overlay>.yaml per overlay with
# every kt image pinned by the digest the release pushed, images.yaml (the
# `images:` stanza that pins the agent sidecar in users' kustomizations)
# and SHA256SUMS.
# The release workflow (.github/workflows/release.yml) runs it after pushing
# the images and attaches its output to the GitHub release.
#
#   bash testbed/k8s/release-bundle.sh --registry ghcr.io/OWNER --digests FILE OUT_DIR
#       FILE: lines `<component> <digest>` (kt-metadata sha256:...), one per image
#   bash testbed/k8s/release-bundle.sh --self-test OUT_DIR
#       the same with made-up digests, checked (make manifests-check runs it)
#
# Fails when an image of the output is not pinned by digest, when a digest
# is missing or malformed, or when the bundle's version label is not the
# workspace version (a tag v0.2.0 needs version = "0.2.0" in Cargo.toml).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$root"

# kt-dataset: the Dataset controller, in the installs that list the datasets
# component (none of the overlays; kustomize/examples/datasets does), pinned
# in images.yaml for those.
components=(kt-metadata kt-store kt-agent kt-client kt-dataset)
bundle_repo=ghcr.io/kt-dev
die() { echo "release-bundle.sh: $*" >&2; exit 1; }

registry="" digests="" out="" self_test=0
while [ $# -gt 0 ]; do
  case $1 in
    --registry) registry=${2:?}; shift 2 ;;
    --digests) digests=${2:?}; shift 2 ;;
    --self-test) self_test=1; shift ;;
    -*) die "unknown option $1" ;;
    *) out=$1; shift ;;
  esac
done
[ -n "$out" ] || die "usage: release-bundle.sh (--registry R --digests FILE | --self-test) OUT_DIR"
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [ "$self_test" = 1 ]; then
  registry=registry.example/kt
  digests=$work/digests
  for c in "${components[@]}" kt-agent-gpu; do
    echo "$c sha256:$(printf '%s' "$c" | sha256sum | cut -d' ' -f1)"
  done >"$digests"
fi
[ -n "$registry" ] && [ -n "$digests" ] || die "--registry and --digests are required"

declare -A digest
while read -r c d; do
  [ -n "$c" ] || continue
  [[ $d =~ ^sha256:[0-9a-f]{64}$ ]] || die "$digests: $c: '$d' is not a sha256 digest"
  digest[$c]=$d
done <"$digests"
for c in "${components[@]}"; do
  [ -n "${digest[$c]:-}" ] || die "$digests: no digest for $c"
done

if [ -n "${KUSTOMIZE:-}" ]; then read -r -a build <<<"$KUSTOMIZE"; else build=(kubectl kustomize); fi
for dir in kustomize/overlays/*/; do
  overlay=$(basename "$dir")
  k=$work/$overlay
  mkdir -p "$k"
  {
    echo "apiVersion: kustomize.config.k8s.io/v1beta1"
    echo "kind: Kustomization"
    echo "resources:"
    echo "  - $(realpath --relative-to="$k" "$root/kustomize/overlays/$overlay")"
    echo "images:"
    for c in "${components[@]}"; do
      echo "  - name: $bundle_repo/$c"
      echo "    newName: $registry/$c"
      echo "    digest: ${digest[$c]}"
    done
  } >"$k/kustomization.yaml"
  dest=$out/install-$overlay.yaml
  {
    echo "# kt $version, overlay $overlay: kubectl apply --server-side -f install-$overlay.yaml"
    echo "# Images pinned by digest:"
    for c in "${components[@]}"; do echo "#   $registry/$c@${digest[$c]}"; done
    "${build[@]}" "$k"
  } >"$dest" || die "rendering $overlay failed"
  # Every image is pinned, and only kt's images are in the bundle.
  unpinned=$(grep -E '^\s*image:' "$dest" | grep -v '@sha256:' || true)
  [ -z "$unpinned" ] || die "$dest: images not pinned by digest:"$'\n'"$unpinned"
  for c in "${components[@]}"; do
    if grep -E '^\s*image:' "$dest" | grep -q "/$c@" &&
      ! grep -qF "image: $registry/$c@${digest[$c]}" "$dest"; then
      die "$dest: $c is not at $registry/$c@${digest[$c]}"
    fi
  done
  labels=$(grep -ho 'app.kubernetes.io/version: .*' "$dest" | sort -u)
  [ "$labels" = "app.kubernetes.io/version: $version" ] ||
    die "$dest: version labels are '$labels', the workspace is $version"
  echo "release-bundle.sh: $dest ($(grep -c '^kind:' "$dest") objects)"
done
# Workloads get the agent from the agent-sidecar component (at the release's
# tag; GPU workloads get kt-agent-gpu from the gpu component), or from the
# sidecar-injector webhook (its ConfigMap's agent-image, an image field to
# kustomize); this `images:` stanza pins them (and the client image) by
# digest too, and the Dataset controller's image for an install over this
# bundle's production overlay that adds the datasets component
# (kustomize/examples/datasets).
[ -n "${digest[kt-agent-gpu]:-}" ] || die "$digests: no digest for kt-agent-gpu"
{
  echo "# kt $version: add under a kustomization that lists the agent-sidecar component (or sidecar-injector, or datasets)"
  echo "images:"
  for c in kt-agent kt-agent-gpu kt-client kt-dataset; do
    echo "  - name: $bundle_repo/$c"
    echo "    newName: $registry/$c"
    echo "    digest: ${digest[$c]}"
  done
} >"$out/images.yaml"
(cd "$out" && sha256sum install-*.yaml images.yaml >SHA256SUMS)

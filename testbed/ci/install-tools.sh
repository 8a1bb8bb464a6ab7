#!/usr/bin/env bash
# Installs pinned tools for the workflows into DIR (added to GITHUB_PATH by
# the caller), each verified against its published checksum:
#   testbed/ci/install-tools.sh DIR kubectl [kind] [k3d]
# Versions: KUBECTL_VERSION, KIND_VERSION, K3D_VERSION (defaults below).
set -euo pipefail
dir=${1:?usage: install-tools.sh DIR TOOL...}
shift
# kubectl v1.32.x embeds kustomize v5.5.0, which manifests/ is rendered
# with (testbed/k8s/KUSTOMIZE_VERSION).
KUBECTL_VERSION=${KUBECTL_VERSION:-v1.32.4}
KIND_VERSION=${KIND_VERSION:-v0.27.0}
K3D_VERSION=${K3D_VERSION:-v5.8.3}
mkdir -p "$dir"
cd "$dir"
fetch() { curl -fsSL --retry 3 -o "$1" "$2"; }
for tool in "$@"; do
  case $tool in
    kubectl)
      fetch kubectl "https://dl.k8s.io/release/${KUBECTL_VERSION}/bin/linux/amd64/kubectl"
      echo "$(curl -fsSL --retry 3 "https://dl.k8s.io/release/${KUBECTL_VERSION}/bin/linux/amd64/kubectl.sha256")  kubectl" | sha256sum -c -
      ;;
    kind)
      fetch kind "https://github.com/kubernetes-sigs/kind/releases/download/${KIND_VERSION}/kind-linux-amd64"
      curl -fsSL --retry 3 "https://github.com/kubernetes-sigs/kind/releases/download/${KIND_VERSION}/kind-linux-amd64.sha256sum" |
        awk '{print $1"  kind"}' | sha256sum -c -
      ;;
    k3d)
      # k3d publishes one checksums.txt whose lines name build paths
      # (`<sha256>  _dist/k3d-linux-amd64`): take the binary's line.
      fetch k3d "https://github.com/k3d-io/k3d/releases/download/${K3D_VERSION}/k3d-linux-amd64"
      sums=$(curl -fsSL --retry 3 "https://github.com/k3d-io/k3d/releases/download/${K3D_VERSION}/checksums.txt")
      line=$(awk '$2 ~ /(^|\/)k3d-linux-amd64$/ {print $1"  k3d"}' <<<"$sums")
      [ -n "$line" ] || { echo "install-tools.sh: no k3d-linux-amd64 in k3d's checksums.txt" >&2; exit 1; }
      sha256sum -c - <<<"$line"
      ;;
    *) echo "install-tools.sh: unknown tool $tool" >&2; exit 1 ;;
  esac
  chmod +x "$tool"
done

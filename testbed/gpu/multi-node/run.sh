#!/usr/bin/env bash
# The README's multi-node InfiniBand/RoCE checklist, run against an existing
# cluster (the gpu workflow's `multi-node` job; by hand: the same, with
# kubectl pointing at your cluster). Two cases, one after the other, each
# with this directory's workload (two pods; their agents get a GPU through
# the DRA claim kt-gpu and an HCA, IPC_LOCK and 2Gi through gpu-rdma):
#   across     the pods on two nodes: a CUDA tensor put in one is got in the
#              other (every byte checked against its seed); the agents' NCCL
#              log (NCCL_DEBUG=INFO) must show the IB transport (NET/IB), not
#              sockets, and says whether GPUDirect RDMA (GDRDMA) was used;
#   same-node  the pods on one node (it needs two GPUs there, one per pod's
#              claim), KT_NCCL_SAME_NODE=p2p with KT_NODE_NAME and hostIPC:
#              the same get must go over P2P (`via P2P`).
# What the cluster must have (checked first, each refused with the reason):
# kt installed in KT_MN_NAMESPACE (default kt) with the gpu overlay; that
# namespace labelled pod-security.kubernetes.io/enforce=privileged (IPC_LOCK;
# hostIPC for same-node); the ResourceClaimTemplate kt-gpu there (see
# kustomize/components/gpu-dra/gpu-dra.yaml); two nodes or more that offer
# the RDMA resource KT_MN_RDMA_RESOURCE (default rdma/rdma_shared_device_a).
# Optional: KT_MN_NCCL_ENV, a file of NAME=value lines (NCCL_IB_HCA,
# NCCL_IB_GID_INDEX, ...: the allow-list of the README's GPU section) for
# the agents; KT_MN_IMAGES, a file with a kustomize `images:` list (a
# release's images.yaml) to test those images instead of the bundle's.
#
# usage: testbed/gpu/multi-node/run.sh [across] [same-node]   (default: both)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ns=${KT_MN_NAMESPACE:-kt}
rdma=${KT_MN_RDMA_RESOURCE:-rdma/rdma_shared_device_a}
cases=("$@")
[ "${#cases[@]}" -gt 0 ] || cases=(across same-node)
tmp=$(mktemp -d)
holder=
cleanup() {
  [ -z "$holder" ] || kill "$holder" 2>/dev/null || true
  [ ! -f "$tmp/rendered.yaml" ] || kubectl -n "$ns" delete --ignore-not-found --wait=false -f "$tmp/rendered.yaml" >/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "multi-node: $*" >&2; exit 1; }

# The inputs come from a workflow dispatch: check them before they reach a
# kubectl argument, the kustomization written below or the replacement in
# render (a sed script would run an input ending in `#e` as a command).
[[ $ns =~ ^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$ ]] ||
  fail "KT_MN_NAMESPACE '$ns' is not a namespace name (a DNS label)"
[[ $rdma =~ ^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$ ]] ||
  fail "KT_MN_RDMA_RESOURCE '$rdma' is not a resource name (e.g. rdma/rdma_shared_device_a)"
for c in "${cases[@]}"; do
  case $c in across | same-node) ;; *) fail "unknown case '$c' (across, same-node)" ;; esac
done

# ---- what the cluster must have --------------------------------------------
level=$(kubectl get namespace "$ns" -o jsonpath='{.metadata.labels.pod-security\.kubernetes\.io/enforce}') ||
  fail "no namespace $ns (install kt there with the gpu overlay, or set KT_MN_NAMESPACE)"
[ "$level" = privileged ] ||
  fail "namespace $ns enforces Pod Security '${level:-unset}': IPC_LOCK (and hostIPC) need 'privileged' (label pod-security.kubernetes.io/enforce=privileged)"
kubectl -n "$ns" get resourceclaimtemplate kt-gpu >/dev/null ||
  fail "no ResourceClaimTemplate kt-gpu in $ns: create one for one GPU (kustomize/components/gpu-dra/gpu-dra.yaml says how)"
key=${rdma//./\\.}
nodes=$(kubectl get nodes -o jsonpath="{range .items[*]}{.metadata.name}={.status.allocatable.${key}}{'\n'}{end}" |
  awk -F= '$2 != "" && $2 != "0" {print $1}')
[ "$(printf '%s\n' "$nodes" | grep -c .)" -ge 2 ] ||
  fail "fewer than two nodes offer $rdma (set KT_MN_RDMA_RESOURCE to your RDMA device plugin's resource): ${nodes:-none}"

# ---- the workload of one case ----------------------------------------------
render() { # CASE: the workload with its placement, NCCL's log and the images
  local case=$1 affinity=podAntiAffinity
  [ "$case" = across ] || affinity=podAffinity
  local base
  base=$(kubectl kustomize "$here")
  printf '%s\n' "${base//rdma\/rdma_shared_device_a/$rdma}" >"$tmp/base.yaml"
  { echo "NCCL_DEBUG=INFO"; echo "NCCL_DEBUG_SUBSYS=INIT,NET"
    [ -z "${KT_MN_NCCL_ENV:-}" ] || grep -v '^NCCL_DEBUG\(_SUBSYS\)\?=' "$KT_MN_NCCL_ENV"; } >"$tmp/nccl.env"
  cat >"$tmp/kustomization.yaml" <<EOF
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
namespace: $ns
resources: [base.yaml]
labels:
  - pairs: {kt.dev/multi-node: $case}
    includeSelectors: true
configMapGenerator:
  - name: kt-nccl
    envs: [nccl.env]
patches:
  - target: {kind: Deployment, name: kt-multi-node}
    patch: |-
      - op: add
        path: /spec/template/spec/affinity
        value:
          $affinity:
            requiredDuringSchedulingIgnoredDuringExecution:
              - labelSelector: {matchLabels: {kt.dev/multi-node: $case}}
                topologyKey: kubernetes.io/hostname
EOF
  if [ "$case" = same-node ]; then
    cat >>"$tmp/kustomization.yaml" <<'EOF'
  - target: {kind: Deployment, name: kt-multi-node}
    patch: |-
      apiVersion: apps/v1
      kind: Deployment
      metadata: {name: kt-multi-node}
      spec:
        template:
          spec:
            hostIPC: true
            initContainers:
              - name: kt-agent
                env:
                  - {name: KT_NCCL_SAME_NODE, value: p2p}
                  - name: KT_NODE_NAME
                    valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
EOF
  fi
  [ -z "${KT_MN_IMAGES:-}" ] || grep -v '^#' "$KT_MN_IMAGES" >>"$tmp/kustomization.yaml"
  kubectl kustomize "$tmp" >"$tmp/rendered.yaml"
}

run_case() {
  local case=$1 a b na nb
  echo "== $case"
  render "$case"
  kubectl -n "$ns" apply --server-side -f "$tmp/rendered.yaml"
  kubectl -n "$ns" rollout status deploy/kt-multi-node --timeout=10m
  read -r a b <<<"$(kubectl -n "$ns" get pods -l "kt.dev/multi-node=$case" \
    --field-selector=status.phase=Running -o jsonpath='{.items[*].metadata.name}')"
  [ -n "$b" ] || fail "$case: two running pods expected"
  na=$(kubectl -n "$ns" get pod "$a" -o jsonpath='{.spec.nodeName}')
  nb=$(kubectl -n "$ns" get pod "$b" -o jsonpath='{.spec.nodeName}')
  echo "pods $a on $na, $b on $nb"
  if [ "$case" = across ]; then [ "$na" != "$nb" ] || fail "across: both pods on $na"
  else [ "$na" = "$nb" ] || fail "same-node: the pods are on $na and $nb"; fi

  local k="kt-multi-node/$case/w" layout='w=f32[4096,4096]'
  kubectl -n "$ns" exec "$a" -c workload -- \
    kt tensor put "$k" --layout "$layout" --seed 7 --device cuda:0 --hold &
  holder=$!
  local deadline=$((SECONDS + 180))
  until kubectl -n "$ns" exec "$a" -c workload -- kt tensor ls 2>/dev/null | grep -qF "$k"; do
    kill -0 "$holder" 2>/dev/null || fail "$case: the put in $a ended before registering $k"
    [ "$SECONDS" -lt "$deadline" ] || fail "$case: $k not registered in $a after 180 s"
    sleep 2
  done
  # Every byte checked against the seed by kt itself.
  kubectl -n "$ns" exec "$b" -c workload -- \
    kt tensor get "$k" --layout "$layout" --seed 7 --device cuda:0
  kill "$holder" 2>/dev/null || true
  holder=
  kubectl -n "$ns" logs "$a" -c kt-agent >"$tmp/agents.log"
  kubectl -n "$ns" logs "$b" -c kt-agent >>"$tmp/agents.log"
  if [ "$case" = across ]; then
    grep -q 'NET/IB' "$tmp/agents.log" ||
      fail "across: NCCL did not use InfiniBand/RoCE (no NET/IB in the agents' log): the agent sees no HCA (the RDMA resource), or NCCL_IB_HCA names none; see the README's checklist"
    if grep -q 'GDRDMA' "$tmp/agents.log"; then echo "across: GPUDirect RDMA in use"
    else echo "::warning::across: no GDRDMA in the agents' log: NCCL stages through host memory (nvidia-peermem or dma-buf missing on the nodes)"; fi
  else
    grep -q 'via P2P' "$tmp/agents.log" ||
      fail "same-node: NCCL did not use P2P between the pods (no 'via P2P' in the agents' log): the agents must see each other's GPUs and share an IPC namespace (hostIPC); see the README's checklist"
  fi
  kubectl -n "$ns" delete --wait=true -f "$tmp/rendered.yaml"
  echo "$case: ok"
}

for c in "${cases[@]}"; do
  case $c in
    across | same-node) run_case "$c" ;;
    *) fail "unknown case $c (across, same-node)" ;;
  esac
done

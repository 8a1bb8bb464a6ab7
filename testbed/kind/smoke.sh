#!/usr/bin/env bash
# The release's smoke test: what the `smoke` job of
# .github/workflows/release.yml runs, for each Kubernetes version it tests,
# before any release tag is pushed. README.md ("Deploying on Kubernetes",
# "The release's smoke test") lists the same steps as commands to type.
#
#   testbed/kind/smoke.sh --bundle DIR [--node-image IMAGE] [--cluster NAME] [--keep-cluster]
#
#   DIR      a release bundle: what testbed/k8s/release-bundle.sh writes
#            (install-production.yaml, images.yaml), or a release's assets
#   IMAGE    the kindest/node image of the cluster (default: the one
#            testbed/kind/cluster.yaml pins)
#   NAME     the kind cluster to create (default kt-smoke; it must not exist)
#   --keep-cluster  leave the cluster (and its kubeconfig) for a look
#            afterwards; by default it is deleted when the script ends
#   KT_SMOKE_PULL_CREDS=USER:TOKEN  pull every image of the install and of
#            the workload into every node first (crictl, by digest), with
#            these credentials: the release job's token, since its packages
#            may not be public before it publishes; without it the nodes
#            pull the images themselves when the pods start, as any cluster
#
# Needs kind, kubectl, docker, kt (the CLI, for `kt --kube`), jq and tar on
# PATH. Every step prints `== [n/9]` and fails the script on the first error.
#
#  1. cluster   kind create cluster from testbed/kind/cluster.yaml (a control
#               plane and two workers: the production overlay's servers
#               request three CPUs between them)
#  2. images    (KT_SMOKE_PULL_CREDS only) crictl pull, in every node, of
#               every image the install and the workload name, by digest
#  3. install   kubectl apply --server-side -f install-production.yaml;
#               rollout status of deploy/kt-metadata and sts/kt-store
#  4. workload  kustomize/examples/trainer (agent-sidecar + agent-identity)
#               with the bundle's images.yaml; rollout status of
#               deploy/trainer (two pods); the Job trainer-eval completes
#  5. put/get   a data set put from one trainer pod, got in the other, and
#               compared byte for byte (put with --lifespan cluster); a
#               second key put with no lifespan (resource: trainer's base path)
#  6. broadcast both trainer pods get the key as one broadcast group with
#               fanout 1 (ranks 1 and 2: rank 2 fetches from rank 1)
#  7. outside   kt --kube put from outside the cluster, got in a pod; kt
#               --kube get of the key the pod put
#  8. teardown  kt teardown trainer, in a pod: the resource key is gone, the
#               lifespan=cluster keys under trainer/ stay (kt --kube ls)
#  9. cleanup   kind delete cluster (unless --keep-cluster)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)

die() { echo "smoke.sh: $*" >&2; exit 1; }
bundle="" node_image="" cluster=kt-smoke keep=0
while [ $# -gt 0 ]; do
  case $1 in
    --bundle) bundle=${2:?--bundle needs a directory}; shift 2 ;;
    --node-image) node_image=${2:?--node-image needs an image}; shift 2 ;;
    --cluster) cluster=${2:?--cluster needs a name}; shift 2 ;;
    --keep-cluster) keep=1; shift ;;
    *) die "unknown argument $1 (usage: smoke.sh --bundle DIR [--node-image IMAGE] [--cluster NAME] [--keep-cluster])" ;;
  esac
done
[ -n "$bundle" ] || die "--bundle DIR is required"
bundle=$(cd "$bundle" && pwd) || die "no bundle directory $bundle"
for f in install-production.yaml images.yaml; do
  [ -f "$bundle/$f" ] || die "$bundle has no $f (testbed/k8s/release-bundle.sh writes it)"
done
for t in kind kubectl docker kt jq tar; do
  command -v "$t" >/dev/null || die "$t is not on PATH"
done

work=$(mktemp -d "${TMPDIR:-/tmp}/kt-smoke.XXXXXX")
created=0
cleanup() {
  local rc=$?
  if [ "$created" = 1 ] && [ "$keep" = 0 ]; then
    echo "== [9/9] cleanup: kind delete cluster --name $cluster"
    kind delete cluster --name "$cluster" || true
  elif [ "$created" = 1 ]; then
    echo "smoke.sh: kept cluster $cluster (KUBECONFIG=$work/kubeconfig; kind delete cluster --name $cluster)"
  fi
  [ "$keep" = 1 ] || rm -rf "$work"
  [ "$rc" = 0 ] && echo "smoke.sh: ok" || echo "smoke.sh: FAILED (exit $rc)" >&2
}
trap cleanup EXIT
started=$SECONDS
step() { echo "== [$1/9] $2 (+$((SECONDS - started))s)"; }
ns=kt
k() { kubectl -n "$ns" "$@"; }
# A pod's directory, fetched to DIR here (tar through kubectl exec).
fetch() { # POD PATH DIR
  mkdir -p "$3"
  k exec "$1" -c trainer -- tar -C "$2" -cf - . | tar -C "$3" -xf -
}
same() { # WHAT DIR: DIR holds exactly the data set, byte for byte
  diff -r "$work/data" "$2" >/dev/null || { diff -r "$work/data" "$2" | head -20 >&2; die "$1: not the data set"; }
  echo "   $1: $(find "$2" -type f | wc -l) files, identical"
}

step 1 "cluster: kind create cluster --name $cluster${node_image:+ --image $node_image}"
args=(--name "$cluster" --config "$here/cluster.yaml" --kubeconfig "$work/kubeconfig" --wait 3m)
[ -z "$node_image" ] || args+=(--image "$node_image")
created=1
kind create cluster "${args[@]}"
export KUBECONFIG=$work/kubeconfig
kubectl get nodes

# The workload: the example, with the release's images (images.yaml pins
# the agent sidecar and the client image by digest).
mkdir -p "$work/trainer"
{
  echo "resources:"
  echo "  - $(realpath --relative-to="$work/trainer" "$root/kustomize/examples/trainer")"
  grep -v '^#' "$bundle/images.yaml"
} >"$work/trainer/kustomization.yaml"

step 2 "images: crictl pull of the install's and the workload's images, in every node"
if [ -n "${KT_SMOKE_PULL_CREDS:-}" ]; then
  kubectl kustomize "$work/trainer" >"$work/trainer.yaml"
  mapfile -t images < <(grep -ho 'image: [^ ]*@sha256:[0-9a-f]*' "$bundle/install-production.yaml" "$work/trainer.yaml" |
    sed 's/^image: //' | sort -u)
  [ "${#images[@]}" -gt 0 ] || die "no image pinned by digest in the install or the workload"
  mapfile -t nodes < <(kind get nodes --name "$cluster")
  export KT_SMOKE_PULL_CREDS
  for node in "${nodes[@]}"; do
    for img in "${images[@]}"; do
      # The credentials reach the node's environment, never a command line here.
      docker exec -e KT_SMOKE_PULL_CREDS "$node" sh -c 'crictl pull --creds "$KT_SMOKE_PULL_CREDS" "$0"' "$img" >/dev/null
    done
  done
  printf '   %s\n' "${images[@]}"
  echo "   pulled into ${#nodes[@]} node(s)"
else
  echo "   skipped (no KT_SMOKE_PULL_CREDS): the nodes pull the images as the pods start"
fi

step 3 "install: kubectl apply --server-side -f install-production.yaml"
kubectl apply --server-side -f "$bundle/install-production.yaml"
k rollout status deploy/kt-metadata --timeout=5m
k rollout status sts/kt-store --timeout=5m

step 4 "workload: kustomize/examples/trainer with the release's images.yaml"
kubectl apply --server-side -k "$work/trainer"
k rollout status deploy/trainer --timeout=5m
k wait --for=condition=complete job/trainer-eval --timeout=5m
read -r -a pods <<<"$(k get pods -l app.kubernetes.io/name=trainer --field-selector=status.phase=Running \
  -o jsonpath='{.items[*].metadata.name}')"
[ "${#pods[@]}" = 2 ] || die "expected the two pods of deploy/trainer, got: ${pods[*]:-none}"
a=${pods[0]} b=${pods[1]}
echo "   pods $a, $b"

step 5 "put/get: put in $a, get in $b"
mkdir -p "$work/data/shards"
head -c 3145728 /dev/urandom >"$work/data/weights.bin"
seq 1 20000 >"$work/data/shards/numbers.txt"
echo "kt smoke test $(date -u +%FT%TZ)" >"$work/data/shards/README"
k exec "$a" -c trainer -- mkdir -p /work/smoke
tar -C "$work/data" -cf - . | k exec -i "$a" -c trainer -- tar -C /work/smoke -xf -
k exec "$a" -c trainer -- kt put trainer/smoke/data --src /work/smoke --lifespan cluster
k exec "$a" -c trainer -- kt put trainer/smoke/scratch --src /work/smoke
k exec "$b" -c trainer -- kt get trainer/smoke/data --dest /var/lib/kt/data/smoke
fetch "$b" /var/lib/kt/data/smoke "$work/got-get"
same "get in $b" "$work/got-get"

step 6 "broadcast: $a and $b get trainer/smoke/data as one group (fanout 1)"
group=smoke-$(date +%s)-$$
pids=()
for i in 0 1; do
  k exec "${pods[$i]}" -c trainer -- kt get trainer/smoke/data --dest /var/lib/kt/data/broadcast \
    --broadcast --group "$group" --fanout 1 -o json >"$work/broadcast-$i.json" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || die "a broadcast getter failed"; done
jq -s -e --arg g "$group" '(map(.broadcast.group) | unique) == [$g] and (map(.broadcast.rank) | sort) == [1, 2]' \
  "$work"/broadcast-*.json >/dev/null || { cat "$work"/broadcast-*.json >&2; die "broadcast: not ranks 1 and 2 of group $group"; }
jq -c '{rank: .broadcast.rank, parents: .broadcast.parents}' "$work"/broadcast-*.json | sed 's/^/   /'
fetch "$a" /var/lib/kt/data/broadcast "$work/got-broadcast-a"
fetch "$b" /var/lib/kt/data/broadcast "$work/got-broadcast-b"
same "broadcast in $a" "$work/got-broadcast-a"
same "broadcast in $b" "$work/got-broadcast-b"

step 7 "outside: kt --kube (port-forward through the API server)"
kt --kube --namespace "$ns" put trainer/smoke/outside --src "$work/data" --lifespan cluster
k exec "$b" -c trainer -- kt get trainer/smoke/outside --dest /var/lib/kt/data/outside
fetch "$b" /var/lib/kt/data/outside "$work/got-outside-in-pod"
same "kt --kube put, get in $b" "$work/got-outside-in-pod"
kt --kube --namespace "$ns" get trainer/smoke/data --dest "$work/got-outside"
same "put in $a, kt --kube get" "$work/got-outside"

step 8 "teardown: kt teardown trainer (in $a)"
k exec "$a" -c trainer -- kt teardown trainer
kt --kube --namespace "$ns" ls trainer/smoke -o json >"$work/ls.json"
jq -e '(map(.key) | index("trainer/smoke/scratch")) == null' "$work/ls.json" >/dev/null ||
  die "teardown: trainer/smoke/scratch (lifespan resource) is still there"
for key in trainer/smoke/data trainer/smoke/outside; do
  jq -e --arg k "$key" 'map(.key) | index($k) != null' "$work/ls.json" >/dev/null ||
    die "teardown: $key (lifespan cluster) is gone"
done
kt --kube --namespace "$ns" ls trainer/smoke | sed 's/^/   /'

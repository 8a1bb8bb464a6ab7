#!/usr/bin/env bash
# Datasets on a real cluster: what the `datasets` steps of
# .github/workflows/kind.yml and k3d.yml run, after the scenario library,
# on the cluster the runner kept. The Dataset controller and the node-cache
# agents (the components `datasets` and `node-cache`, over the testbed's
# overlay) are installed into the namespace kt; a tree is put under a key,
# placed on nodes, read by the dataset-consumer example's Job from its
# node's disk, and removed; a bad key ends Failed with a Warning event; an
# S3 source is ingested from a MinIO container started next to the nodes.
#
#   testbed/datasets/on-cluster.sh --flavor kind|k3d [--cluster NAME] [--tag TAG] [--keep-cluster]
#   testbed/datasets/on-cluster.sh --render DIR
#       no cluster: what it would deploy, for both flavors, rendered into
#       DIR/datasets-<flavor>.yaml (the install) and
#       DIR/datasets-consumer-<flavor>.yaml (a consumer Job), images at the
#       workspace version (`make manifests-check` validates them and runs
#       testbed/k8s/policy.py over them)
#
#   --flavor    kind (nodes: kind's containers, images loaded with `kind load
#               docker-image`) or k3d (`k3d image import`)
#   NAME        the cluster: used as it is when it exists (and kept), else
#               created from testbed/kind/cluster.yaml or
#               testbed/k3d/config.yaml and deleted at the end (unless
#               --keep-cluster). Default: $KT_CLUSTER, else kt-datasets
#   TAG         the tag of kt's images (default $KT_IMAGE_TAG, else
#               testbed/images/tag.sh: what `make images` built)
#   KT_MINIO_IMAGE  the MinIO image (default: MINIO_IMAGE below, pinned by
#               digest); it is pulled on this machine (the runner), so this
#               step needs the network, unlike the rest of the job
#
# Needs docker, kubectl, jq, curl (with --aws-sigv4: 7.75 or newer), kind
# or k3d, and kt (the CLI, built with the `kube` feature: `kt dataset`) on
# PATH. Every step prints `== [n/10]`; the first error fails the script.
#
#  1. cluster   the cluster (existing, or created)
#  2. images    kt's five images loaded into the nodes; MinIO pulled here
#  3. install   overlays/<flavor> + components node-cache and datasets, the
#               namespace at Pod Security `privileged` (hostPath), images at
#               TAG; rollouts of the servers, the DaemonSet and the controller
#  4. key       a tree put with `kt --kube put`; `kt dataset apply train
#               --key ... --replicas 2 --wait Ready`
#  5. nodes     exactly the 2 nodes its status names carry
#               data.kt.dev/kt.train=<version>, and hold the directory
#  6. consumer  kustomize/examples/dataset-consumer's Job (its job.yaml,
#               the component dataset-consumer) for `train`, verifying every
#               file's sha256 from its node's hostPath; it ran on a
#               labelled node
#  7. remove    `kt dataset rm train --wait`: no node labelled, no node
#               holding the directory
#  8. bad key   a Dataset of a key that does not exist: `kt dataset get
#               --wait Ready` exits non-zero naming KeyNotFound, and a
#               Warning event KeyNotFound is on the Dataset
#  9. s3        MinIO (a container on the cluster's Docker network), the
#               tree uploaded with curl --aws-sigv4; a Dataset of
#               s3://kt-ci/train/ on 1 node: Ready, the key
#               datasets/kt/s3train in the store, the consumer Job verifies
#               it, `rm --wait` leaves no label
# 10. cleanup   MinIO removed; the cluster deleted when this script made it
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$root"

# MinIO's last community image, pinned by its index digest.
MINIO_IMAGE=${KT_MINIO_IMAGE:-docker.io/minio/minio:RELEASE.2025-04-22T22-12-26Z@sha256:a1ea29fa28355559ef137d71fc570e508a214ec84ff8083e39bc5428980b015e}
IMAGES=(kt-metadata kt-store kt-agent kt-client kt-dataset)
REPO=ghcr.io/kt-dev
NS=kt

die() { echo "on-cluster.sh: $*" >&2; exit 1; }
rel() { realpath --relative-to="$2" "$root/$1"; }
# write_install DIR FLAVOR: the install's kustomization in DIR.
write_install() {
  local d=$1
  mkdir -p "$d"
  {
    echo "apiVersion: kustomize.config.k8s.io/v1beta1"
    echo "kind: Kustomization"
    echo "namespace: $NS"
    echo "resources:"
    echo "  - $(rel "kustomize/overlays/$2" "$d")"
    echo "components:"
    echo "  - $(rel kustomize/components/node-cache "$d")"
    echo "  - $(rel kustomize/components/datasets "$d")"
    echo "images:"
    for c in "${IMAGES[@]}"; do
      echo "  - name: $REPO/$c"
      echo "    newTag: \"$tag\""
    done
    # hostPath (the node-cache agents, the consumer) needs `privileged`; warn
    # and audit stay at restricted.
    cat <<'EOF'
patches:
  - target:
      kind: Namespace
      name: kt
    patch: |-
      - op: replace
        path: /metadata/labels/pod-security.kubernetes.io~1enforce
        value: privileged
EOF
  } >"$d/kustomization.yaml"
}

# write_consumer DIR NAME SUMS: the dataset-consumer example's Job (its
# job.yaml and component) for dataset NAME, checking every sum of the file
# SUMS from its node's hostPath.
write_consumer() {
  local d=$1 name=$2
  mkdir -p "$d"
  cp kustomize/examples/dataset-consumer/job.yaml "$d/job.yaml"
  cp "$3" "$d/SHA256SUMS"
  cat >"$d/dataset.yaml" <<EOF
apiVersion: v1
kind: ConfigMap
metadata:
  name: kt-dataset
  annotations:
    config.kubernetes.io/local-config: "true"
data:
  namespace: $NS
  name: $name
EOF
  cat >"$d/kustomization.yaml" <<EOF
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
namespace: $NS
resources:
  - dataset.yaml
  - job.yaml
components:
  - $(rel kustomize/components/dataset-consumer "$d")
images:
  - name: $REPO/kt-client
    newTag: "$tag"
configMapGenerator:
  - name: kt-dataset-sums
    files:
      - SHA256SUMS
patches:
  - target:
      kind: Job
      name: train
    patch: |-
      - op: replace
        path: /metadata/name
        value: consume-$name
      - op: replace
        path: /metadata/labels/kt.dev~1dataset
        value: $name
      - op: replace
        path: /spec/template/spec/containers/0/command
        value:
          - /busybox/sh
          - -c
          - |
            set -e
            cd "\$KT_DATASET_DIR"
            echo "\$KT_EXPECT" | sha256sum -c -
            want=\$(echo "\$KT_EXPECT" | grep -c .)
            got=\$(find . -type f | wc -l)
            echo "files: \$got, expected \$want"
            [ "\$got" = "\$want" ]
      - op: add
        path: /spec/template/spec/containers/0/env/-
        value:
          name: KT_EXPECT
          valueFrom:
            configMapKeyRef:
              name: kt-dataset-sums
              key: SHA256SUMS
EOF
}

flavor="" cluster=${KT_CLUSTER:-kt-datasets} tag=${KT_IMAGE_TAG:-} keep=0 render=""
while [ $# -gt 0 ]; do
  case $1 in
    --flavor) flavor=${2:?--flavor needs kind or k3d}; shift 2 ;;
    --cluster) cluster=${2:?--cluster needs a name}; shift 2 ;;
    --tag) tag=${2:?--tag needs a tag}; shift 2 ;;
    --keep-cluster) keep=1; shift ;;
    --render) render=${2:?--render needs a directory}; shift 2 ;;
    *) die "unknown argument $1 (usage: on-cluster.sh --flavor kind|k3d [--cluster NAME] [--tag TAG] [--keep-cluster])" ;;
  esac
done
if [ -n "$render" ]; then
  command -v kubectl >/dev/null || die "kubectl is not on PATH (it renders with its kustomize)"
  tag=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
  mkdir -p "$render"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  printf '%s  ./README\n' "$(printf 'kt\n' | sha256sum | cut -d' ' -f1)" >"$work/SHA256SUMS"
  for flavor in kind k3d; do
    write_install "$work/install-$flavor" "$flavor"
    kubectl kustomize "$work/install-$flavor" >"$render/datasets-$flavor.yaml" ||
      die "rendering the $flavor install failed"
    write_consumer "$work/consumer-$flavor" train "$work/SHA256SUMS"
    kubectl kustomize "$work/consumer-$flavor" >"$render/datasets-consumer-$flavor.yaml" ||
      die "rendering the $flavor consumer failed"
  done
  echo "on-cluster.sh: rendered $render/datasets-{kind,k3d}.yaml and datasets-consumer-{kind,k3d}.yaml"
  exit 0
fi
case $flavor in
  kind | k3d) ;;
  *) die "--flavor kind or --flavor k3d is required" ;;
esac
[ -n "$tag" ] || tag=$(bash testbed/images/tag.sh)
for t in "$flavor" kubectl docker kt jq curl; do
  command -v "$t" >/dev/null || die "$t is not on PATH"
done

work=$(mktemp -d "${TMPDIR:-/tmp}/kt-datasets.XXXXXX")
created=0 minio=""
cleanup() {
  local rc=$?
  echo "== [10/10] cleanup"
  [ -z "$minio" ] || docker rm -f "$minio" >/dev/null 2>&1 || true
  if [ "$created" = 1 ] && [ "$keep" = 0 ]; then
    case $flavor in
      kind) kind delete cluster --name "$cluster" || true ;;
      k3d) k3d cluster delete "$cluster" || true ;;
    esac
  elif [ "$created" = 1 ]; then
    echo "on-cluster.sh: kept cluster $cluster (KUBECONFIG=$work/kubeconfig)"
  fi
  [ "$keep" = 1 ] || rm -rf "$work"
  [ "$rc" = 0 ] && echo "on-cluster.sh: ok" || echo "on-cluster.sh: FAILED (exit $rc)" >&2
}
trap cleanup EXIT
started=$SECONDS
step() { echo "== [$1/10] $2 (+$((SECONDS - started))s)"; }
k() { kubectl -n "$NS" "$@"; }
# kt's dataset commands and kt --kube, on this cluster's kubeconfig.
ktk() { kt --kubeconfig "$KUBECONFIG" --namespace "$NS" "$@"; }
# The nodes carrying a label (selector), one per line, sorted.
labelled() {
  kubectl get nodes -l "$1" -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}' | sort
}
# Whether a node (its container) has PATH: `docker exec NODE test -e PATH`.
node_has() { docker exec "$1" test -e "$2"; }
# poll SECONDS CMD...: CMD succeeds within SECONDS (tried once a second).
poll() {
  local deadline=$((SECONDS + $1))
  shift
  until "$@"; do
    [ "$SECONDS" -lt "$deadline" ] || return 1
    sleep 1
  done
}
dataset_dir() { echo "/var/lib/kt/datasets/$NS/$1"; }

step 1 "cluster: $flavor cluster $cluster"
exists=0
case $flavor in
  kind) clusters=$(kind get clusters 2>/dev/null || true); grep -qx "$cluster" <<<"$clusters" && exists=1 ;;
  k3d) k3d cluster list -o json | jq -e --arg c "$cluster" 'map(.name) | index($c) != null' >/dev/null && exists=1 ;;
esac
if [ "$exists" = 1 ]; then
  echo "   using the existing cluster $cluster (kept)"
else
  created=1
  case $flavor in
    kind) kind create cluster --name "$cluster" --config testbed/kind/cluster.yaml --wait 3m ;;
    k3d) k3d cluster create "$cluster" --config testbed/k3d/config.yaml ;;
  esac
fi
case $flavor in
  kind)
    kind get kubeconfig --name "$cluster" >"$work/kubeconfig"
    network=kind
    ;;
  k3d)
    k3d kubeconfig get "$cluster" >"$work/kubeconfig"
    network=k3d-$cluster
    ;;
esac
export KUBECONFIG=$work/kubeconfig
kubectl get nodes

step 2 "images: kt's at $tag into the nodes; $MINIO_IMAGE pulled here"
refs=()
for c in "${IMAGES[@]}"; do refs+=("$REPO/$c:$tag"); done
case $flavor in
  kind) kind load docker-image "${refs[@]}" --name "$cluster" ;;
  k3d) k3d image import "${refs[@]}" --cluster "$cluster" ;;
esac
docker pull -q "$MINIO_IMAGE"

step 3 "install: overlays/$flavor + node-cache + datasets (namespace $NS, Pod Security privileged)"
write_install "$work/install" "$flavor"
kubectl apply --server-side -k "$work/install"
kubectl wait --for=condition=established crd/datasets.kt.dev --timeout=1m
k rollout status deploy/kt-metadata --timeout=5m
k rollout status sts/kt-store --timeout=5m
k rollout status ds/kt-node-cache --timeout=5m
k rollout status deploy/kt-dataset-controller --timeout=5m
mapfile -t cache_nodes < <(k get pods -l app.kubernetes.io/component=node-cache \
  -o jsonpath='{range .items[*]}{.spec.nodeName}{"\n"}{end}' | sort)
echo "   node-cache agents on: ${cache_nodes[*]}"
[ "${#cache_nodes[@]}" -ge 2 ] || die "need node-cache agents on 2 nodes at least, got ${#cache_nodes[@]}"

# The tree: files of several sizes in nested directories, and their sums.
mkdir -p "$work/data/shards/a" "$work/data/shards/b"
head -c 3145728 /dev/urandom >"$work/data/weights.bin"
for i in 1 2 3 4 5; do head -c $((i * 4099)) /dev/urandom >"$work/data/shards/a/part-$i"; done
seq 1 20000 >"$work/data/shards/b/numbers.txt"
echo "kt datasets on $flavor $(date -u +%FT%TZ)" >"$work/data/README"
(cd "$work/data" && find . -type f | sort | xargs sha256sum) >"$work/SHA256SUMS"
files=$(wc -l <"$work/SHA256SUMS")

# consumer NAME: that Job for dataset NAME, with the tree's sums; it must
# complete, on a node labelled for NAME.
consumer() {
  local name=$1 d=$work/consumer-$1
  write_consumer "$d" "$name" "$work/SHA256SUMS"
  k delete job "consume-$name" --ignore-not-found --wait=true >/dev/null
  kubectl apply --server-side -k "$d"
  if ! k wait --for=condition=complete "job/consume-$name" --timeout=3m; then
    k logs "job/consume-$name" --tail=50 >&2 || true
    k describe "job/consume-$name" >&2 || true
    die "consumer of $name: the Job did not complete"
  fi
  k logs "job/consume-$name" --tail=3 | sed 's/^/   /'
  local ran
  ran=$(k get pods -l "batch.kubernetes.io/job-name=consume-$name" -o jsonpath='{.items[0].spec.nodeName}')
  labelled "data.kt.dev/$NS.$name" | grep -qx "$ran" ||
    die "consumer of $name ran on $ran, which does not carry data.kt.dev/$NS.$name"
  echo "   consumer of $name: $files files verified on node $ran"
}

step 4 "key: kt put datasets-ci/train; kt dataset apply train --replicas 2 --wait Ready"
ktk --kube put datasets-ci/train --src "$work/data" --lifespan cluster
ktk dataset apply train --key datasets-ci/train --replicas 2 --wait Ready --timeout 5m
ktk dataset get train -o json >"$work/train.json"
version=$(jq -r '.status.version // empty' "$work/train.json")
[ -n "$version" ] || die "train is Ready without a version in its status"
jq -e '.status.readyNodes == 2' "$work/train.json" >/dev/null ||
  die "train: readyNodes is $(jq -c .status.readyNodes "$work/train.json"), want 2"

step 5 "nodes: data.kt.dev/$NS.train=$version on exactly the 2 nodes holding it"
mapfile -t held < <(jq -r '.status.nodes[] | select(.state == "Ready") | .name' "$work/train.json" | sort)
mapfile -t got < <(labelled "data.kt.dev/$NS.train=$version")
[ "${#got[@]}" = 2 ] || die "nodes labelled data.kt.dev/$NS.train=$version: ${got[*]:-none}, want 2"
[ "${got[*]}" = "${held[*]}" ] || die "labelled nodes (${got[*]}) are not those the status says hold it (${held[*]})"
[ -z "$(labelled "data.kt.dev/$NS.train!=$version,data.kt.dev/$NS.train")" ] ||
  die "a node carries data.kt.dev/$NS.train with another version"
for n in "${cache_nodes[@]}"; do
  if printf '%s\n' "${got[@]}" | grep -qx "$n"; then
    node_has "$n" "$(dataset_dir train)" || die "labelled node $n has no $(dataset_dir train)"
  else
    ! node_has "$n" "$(dataset_dir train)" || die "node $n holds $(dataset_dir train) without the label"
  fi
done
printf '   %s\n' "${got[@]}"

step 6 "consumer: kustomize/examples/dataset-consumer's Job reads train from its node"
consumer train

step 7 "remove: kt dataset rm train --wait"
ktk dataset rm train --wait --timeout 3m
[ -z "$(labelled "data.kt.dev/$NS.train")" ] || die "nodes still labelled after rm: $(labelled "data.kt.dev/$NS.train")"
for n in "${cache_nodes[@]}"; do
  ! node_has "$n" "$(dataset_dir train)" || die "node $n still holds $(dataset_dir train) after rm"
done
echo "   no label, no copy left"

step 8 "bad key: a Dataset of datasets-ci/no-such-key ends Failed (KeyNotFound) with a Warning event"
ktk dataset apply missing --key datasets-ci/no-such-key --replicas 1
if ktk dataset get missing --wait Ready --timeout 2m 2>"$work/missing.err"; then
  die "dataset missing reached Ready from a key that does not exist"
fi
grep -q KeyNotFound "$work/missing.err" || { cat "$work/missing.err" >&2; die "kt dataset get --wait did not name KeyNotFound"; }
sed 's/^/   /' "$work/missing.err"
# The event is posted after the status is written: wait for it.
warning_event() {
  k get events --field-selector "involvedObject.kind=Dataset,involvedObject.name=missing,type=Warning" \
    -o jsonpath='{range .items[*]}{.reason}{": "}{.message}{"\n"}{end}' >"$work/missing.events" &&
    grep -q '^KeyNotFound: ' "$work/missing.events"
}
poll 30 warning_event || { cat "$work/missing.events" >&2; die "no Warning event KeyNotFound on dataset missing in 30s"; }
sed 's/^/   event /' "$work/missing.events"
ktk dataset rm missing --wait --timeout 2m

step 9 "s3: MinIO next to the nodes, a Dataset of s3://kt-ci/train/ on 1 node"
user=kt-ci-$RANDOM$RANDOM pass=$(head -c 24 /dev/urandom | base64 | tr -d '/+=')
minio=kt-datasets-minio-$cluster
docker rm -f "$minio" >/dev/null 2>&1 || true
docker run -d --name "$minio" --network "$network" -p 127.0.0.1::9000 \
  -e "MINIO_ROOT_USER=$user" -e "MINIO_ROOT_PASSWORD=$pass" "$MINIO_IMAGE" server /data >/dev/null
ip=$(docker inspect -f "{{(index .NetworkSettings.Networks \"$network\").IPAddress}}" "$minio")
port=$(docker port "$minio" 9000/tcp | head -1 | sed 's/.*://')
[ -n "$ip" ] && [ -n "$port" ] || die "MinIO: no address on network $network (ip '$ip', port '$port')"
s3=http://127.0.0.1:$port
poll 60 curl -sf -o /dev/null "$s3/minio/health/ready" ||
  { docker logs "$minio" 2>&1 | tail -20 >&2; die "MinIO did not get ready in 60s"; }
sig=(--aws-sigv4 "aws:amz:us-east-1:s3" --user "$user:$pass")
curl -sSf "${sig[@]}" -X PUT "$s3/kt-ci" >/dev/null
while read -r _ f; do
  curl -sSf "${sig[@]}" -T "$work/data/${f#./}" "$s3/kt-ci/train/${f#./}" >/dev/null
done <"$work/SHA256SUMS"
echo "   MinIO at $ip:9000 (network $network): $files objects under s3://kt-ci/train/"
k create secret generic kt-ci-minio --from-literal=AWS_ACCESS_KEY_ID="$user" \
  --from-literal=AWS_SECRET_ACCESS_KEY="$pass" --dry-run=client -o yaml | kubectl apply --server-side -f -
# The controller's NetworkPolicy lets it reach S3 on 443 only: MinIO's
# port needs a rule, as the datasets component says.
kubectl apply --server-side -f - <<EOF
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: kt-dataset-controller-minio
  namespace: $NS
spec:
  podSelector:
    matchLabels:
      app.kubernetes.io/name: kt-dataset-controller
  policyTypes: [Egress]
  egress:
    - to:
        - ipBlock:
            cidr: $ip/32
      ports:
        - port: 9000
          protocol: TCP
EOF
ktk dataset apply s3train --s3 s3://kt-ci/train/ --endpoint "http://$ip:9000" --region us-east-1 \
  --credentials-secret kt-ci-minio --replicas 1 --wait Ready --timeout 5m
mapfile -t got < <(labelled "data.kt.dev/$NS.s3train")
[ "${#got[@]}" = 1 ] || die "nodes labelled data.kt.dev/$NS.s3train: ${got[*]:-none}, want 1"
echo "   labelled: ${got[0]}"
ktk --kube ls "datasets/$NS" -o json >"$work/ls.json"
jq -e --arg k "datasets/$NS/s3train" 'map(.key) | index($k) != null' "$work/ls.json" >/dev/null ||
  die "no key datasets/$NS/s3train in the store after the S3 ingest"
consumer s3train
ktk dataset rm s3train --wait --timeout 3m
[ -z "$(labelled "data.kt.dev/$NS.s3train")" ] || die "nodes still labelled data.kt.dev/$NS.s3train after rm"
echo "   removed"

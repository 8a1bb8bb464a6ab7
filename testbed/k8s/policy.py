"""Checks rendered kt bundles against the rules a real cluster and its
operators hold them to, beyond what the API schemas say (`make
manifests-check` runs it on every rendered overlay, example and test case).
Each rule names the defect it prevents; one line per violation, exit 1 if
any.

usage: python policy.py --version X.Y.Z FILE...

File names say what a file is: base.yaml and the overlays (kind, k3d, gpu,
production) are installs; the default installs (base, gpu, production) must
not filter a user's traffic or need a CRD; examples/*.yaml and cases/*.yaml
are users' kustomizations with the components applied.

A bundle whose metadata server has KT_KUBE_AUTH=true (kube-identity: the
production overlay and the examples over it) uses Kubernetes identities:
nothing there may refer to the static kt-token Secret, every kt server and
agent checks tokens the same way, kt's projected tokens are for the
audience kt and live an hour at most, and the metadata server may create
TokenReviews and reads an access map that the bundle carries.

A container with KT_TLS_CERT serves HTTPS (the tls component: the
metadata server and the store; examples/tls): its certificate and key come
as a pair from cert-manager, on a volume it mounts read-only (a
Certificate's Secret); its pod's kt URLs are https://, its probes HTTPS;
the servers' certificates name what clients call them. Every https://
client trusts a CA file (for the workloads' pods, agent-tls: the ca.crt of
cert-manager's csi-driver volume, with attributes the driver accepts), and
a kt server that serves plain HTTP has HTTP probes and advertises http://.
In one bundle the servers and their clients agree on TLS or none; the
agents and the broadcast relays in the workloads' `kt` serve plain HTTP
either way: peers reach them by pod IP, which no certificate of theirs can
name (the csi-driver cannot put the pod's IP in it), so one that served
TLS would be refused by every peer.

The static token is admin everywhere: outside the kind and k3d testbeds
(their overlays, and the scenario plans over them) no workload pod mounts
the kt-token Secret; only kt's own servers may, in an install that keeps
it. A pod that agent-identity marked (kt.dev/identity: serviceaccount)
keeps its agent's KT_KUBE_AUTH and projected token: an agent-sidecar
listed after it would silently put the static token back.

One install per namespace, several per cluster: a cluster-scoped object
(ClusterRole, ClusterRoleBinding, ...) is named after its install's
namespace (`<name>-<namespace>`), so two installs never share one; and
kube-identity's ValidatingAdmissionPolicy binding (kt-serviceaccounts-*:
who may run pods as kt's ServiceAccounts) selects that namespace alone
(sa-policy-namespace). Every
object of an install is labelled app.kubernetes.io/part-of=kt and with its
instance (the metadata server's), so one selector finds the whole of it;
so is every object of kt's (or named kt-*) in a bundle over an install.

Storage is chosen, not defaulted by accident: every claim of kt's in a
bundle that installs kt (not the base, which leaves it to the overlays)
names a storageClassName or carries the annotation
kt.dev/storage-class: cluster-default (the cluster's default class is
meant; a cluster without one leaves the claim Pending).

The sidecar injector (the sidecar-injector component: a mutating
admission webhook served by kt-metadata) fails closed or open by an
explicit failurePolicy, sends only pods labelled kt.dev/agent: sidecar
(never kt's own servers', which it would hold up) of the install's
namespace (never kube-system), reaches a listener of kt-metadata's that
serves cert-manager's certificate for the name the API server calls, with
the CA cert-manager injects, through the NetworkPolicies; and what it
injects (the template of its ConfigMap) passes the rules of a labelled
pod: a native sidecar, the install's way of presenting tokens, its
version's image, and no https:// server it cannot reach.

GPUs come from Kubernetes' allocation only: no container sets
NVIDIA_VISIBLE_DEVICES (the NVIDIA toolkit would hand it GPUs past the
device plugin, every GPU of the node), and every resources.claims entry
names a claim of its pod.

RDMA (the gpu-rdma component): a container given an HCA (an rdma/*
extended resource) adds IPC_LOCK (ibverbs registration fails without it:
Kubernetes cannot raise the memlock limit) and no other capability, and
one that adds IPC_LOCK has an HCA; an agent with an HCA has at least 1Gi
of memory (a CUDA context and NCCL's pinned buffers). A pod template
annotated `kt.dev/memlock: node` (the nodes' container runtime raises the
memlock limit) may give an HCA without IPC_LOCK. The agent never takes a
whole ConfigMap or Secret (`envFrom`: whoever edits it would set
LD_PRELOAD, KT_* or OTEL_* there); its values from the ConfigMap kt-nccl
are exactly the NCCL settings the agent honours (netenv.rs's
WORKLOAD_NCCL_ENV, as components.py reads it), each under its own name.

Arrow Flight (the flight component): an agent with KT_FLIGHT_ADDR fetches
into an emptyDir of its own (KT_FLIGHT_DIR) whose sizeLimit holds
KT_FLIGHT_BUDGET x KT_FLIGHT_MAX_CALLS (flight-scratch); its memory limit
holds 512Mi plus KT_FLIGHT_MAX_CALLS x what one call may hold, flight.rs's
CALL_MEMORY (flight-memory); the agents' NetworkPolicy, where the bundle
has it, admits the Flight port (flight-port).

Ephemeral storage: a pod's disk-backed emptyDirs (their sizeLimits
together) stay below its ephemeral-storage limit, the sum of its
containers' (emptydir-fit): the kubelet counts them, the logs and the
writable layers against that one limit, and evicts the pod (deleting its
emptyDirs) once they pass it.

Service links: every pod that runs kt (a container of kt's image, the
agent, or one given kt's variables) sets enableServiceLinks: false
(service-links). Otherwise the kubelet sets <SERVICE>_PORT=tcp://<ip>:<port>
for each Service of the namespace, and a user's Service named kt-relay,
kt-tensor or kt-node-cache would set kt's own KT_RELAY_PORT, KT_TENSOR_PORT
or KT_NODE_CACHE_PORT there. A pod that asks the sidecar injector for its
agent (labelled kt.dev/agent: sidecar, no agent yet) gets it from the
injector, whose template is held to the rule instead.

testbed/k8s/cases/<name>/ are rendered test cases: those with a file
`expect-policy` are negative cases, whose every line `Kind/name rule`
names a violation that must be reported (and is then not an error);
anything else reported there still is. (Those with `expect-render-error`
must fail to render: render.sh checks them.)
"""

import argparse
import pathlib
import re
import sys

import yaml

from components import NCCL_CONFIGMAP, workload_nccl_env

HERE = pathlib.Path(__file__).resolve().parent
# The agent's Flight module: its CALL_MEMORY is what one Flight call may
# hold in memory (rule flight-memory).
FLIGHT_RS = HERE.parents[1] / "components" / "kt-agent" / "src" / "flight.rs"
# The agent's memory limit without Flight (agent-sidecar's): Flight calls
# need theirs on top.
AGENT_MEMORY = 512 << 20

INSTALLS = {"base", "kind", "k3d", "gpu", "production"}
# The testbeds: installs (and the scenario plans over them, by instance)
# that keep the static admin token for their workloads.
TESTBEDS = {"kind", "k3d"}
TESTBED_INSTANCES = {"kt-" + t for t in TESTBEDS}
# What a user installs as is: nothing there may cut their traffic or need an
# operator they may not have.
DEFAULT_INSTALLS = {"base", "gpu", "production"}
WORKLOAD_KINDS = {
    "Deployment": ("spec", "template"),
    "StatefulSet": ("spec", "template"),
    "DaemonSet": ("spec", "template"),
    "ReplicaSet": ("spec", "template"),
    "Job": ("spec", "template"),
    "CronJob": ("spec", "jobTemplate", "spec", "template"),
}
RECOMMENDED = ["name", "instance", "version", "component", "part-of", "managed-by"]
PART_OF = "app.kubernetes.io/part-of"
INSTANCE = "app.kubernetes.io/instance"
# Kinds that belong to no namespace: one object of a name per cluster.
CLUSTER_SCOPED = {
    "Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
    "StorageClass", "VolumeAttributesClass", "PriorityClass", "RuntimeClass",
    "IngressClass", "PersistentVolume", "CSIDriver", "DeviceClass",
    "ValidatingWebhookConfiguration", "MutatingWebhookConfiguration",
    "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
    "MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding", "APIService",
    "ClusterIssuer", "PodSecurityPolicy",
}
# The annotation agent-identity puts on a pod template (and agent-sidecar
# never resets): the pod's kt presents its ServiceAccount's token.
IDENTITY_ANNOTATION = "kt.dev/identity"
# kube-identity's ValidatingAdmissionPolicy (and binding): who may run pods
# as kt's own ServiceAccounts, `<SA_POLICY>-<namespace>`.
SA_POLICY = "kt-serviceaccounts"
# The annotation of a claim that means the cluster's default StorageClass.
STORAGE_MARKER = "kt.dev/storage-class"
STORAGE_DEFAULT = "cluster-default"
def mem_bytes(q):
    """A memory quantity (e.g. 512Mi, 2G, 1073741824) in bytes; 0 when it
    is not one."""
    m = re.fullmatch(r"(\d+)([KMGT]i?)?", q.strip())
    if not m:
        return 0
    units = {None: 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    return int(m.group(1)) * units[m.group(2)]


def flight_call_memory():
    """flight.rs's CALL_MEMORY (`pub const CALL_MEMORY: u64 = N << 20;`)
    in bytes: the memory one Flight call may hold."""
    m = re.search(r"^pub const CALL_MEMORY: u64 = (\d+) << 20;$", FLIGHT_RS.read_text(),
                  re.MULTILINE)
    if not m:
        sys.exit(f"policy.py: no `pub const CALL_MEMORY: u64 = N << 20;` in {FLIGHT_RS}")
    return int(m.group(1)) << 20


def kt_size(q):
    """A size as kt's flags take it (1GiB, 512MiB, 4096, 2G) in bytes."""
    m = re.fullmatch(r"(\d+)\s*([KMGT]i?)?B?", q.strip(), re.IGNORECASE)
    if not m:
        return 0
    unit = m.group(2)
    if unit:
        unit = unit[0].upper() + unit[1:].lower()
    return mem_bytes(m.group(1) + (unit or ""))


# NVIDIA_VISIBLE_DEVICES values that give a container no GPU.
NO_GPUS = {"", "void", "none"}
# Labels the bundle's transformers set: they change with the overlay or the
# version, so they must never reach a StatefulSet's volumeClaimTemplates.
TRANSFORMED = {"app.kubernetes.io/instance", "app.kubernetes.io/version",
               "app.kubernetes.io/managed-by"}
KT_SERVERS = {"kt-metadata", "kt-store"}
# API groups of custom resources: an object of one needs its CRDs, which an
# operator (the Prometheus Operator, cert-manager) installs first. kt ships
# one CRD of its own, datasets.kt.dev (the opt-in component datasets), and
# no other's.
CRD_GROUPS = {"monitoring.coreos.com", "cert-manager.io"}
KT_CRDS = {"datasets.kt.dev"}
# Datasets on nodes (node-cache, dataset-consumer): the only hostPath kt's
# bundles may mount, who may write it, and the pod label of the node-cache
# agents.
DATASET_ROOT = "/var/lib/kt/datasets"
NODE_CACHE = "kt-node-cache"
NODE_CACHE_INIT = "kt-node-cache-init"
AGENT = "kt-agent"
# kt's images (the last part of the repository): a pod that runs one runs
# kt (rule service-links).
KT_IMAGES = {"kt-metadata", "kt-store", "kt-agent", "kt-agent-gpu", "kt-client", "kt-dataset"}
# kt's variables that the workload reads, not kt (dataset-consumer's).
WORKLOAD_KT_ENV = {"KT_DATASET_DIR"}
# The static token: a Secret the operator creates for the installs without
# kube identity (kube-identity: projected ServiceAccount tokens instead).
TOKEN_SECRET = "kt-token"
# kt's projected tokens: the audience the metadata server reviews them for,
# and their lifetime (the API's minimum; at most an hour, so a leaked one
# is soon useless and the servers' re-reading of KT_TOKEN_FILE is
# exercised).
AUDIENCE = "kt"
TOKEN_SECONDS = (600, 3600)
# The containers that check callers' tokens: KT_KUBE_AUTH decides how.
VERIFIERS = {"kt-metadata", "kt-store", AGENT, NODE_CACHE}
# The access map's vocabulary (kt_types::auth::AccessMap).
ROLES = {"admin", "store", "agent", "workload", "pod", "metrics"}
RULE_FIELDS = {"serviceAccount", "namespace", "role", "services", "podService", "reads"}
# TLS (the tls and agent-tls components): the variables of a server's
# certificate, its key and the CA its clients trust, and the file
# cert-manager writes each to (a Certificate's Secret, or the csi-driver's
# volume, whose attribute may rename it).
TLS_FILES = {"KT_TLS_CERT": ("tls.crt", "certificate-file"),
             "KT_TLS_KEY": ("tls.key", "privatekey-file"),
             "KT_CA_FILE": ("ca.crt", "ca-file")}
# kt's URLs: https:// wherever the pod serves TLS (and only where the
# server serves it).
URL_ENV = ("KT_METADATA_URL", "KT_ADVERTISE_URL")
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")
CSI_DRIVER = "csi.cert-manager.io"
CSI = CSI_DRIVER + "/"
# The csi-driver expands ${VAR} in these attributes only, and knows only
# these variables (the pod has no IP yet when its volumes are mounted): any
# other `${` fails the mount, and the pod never starts.
CSI_EXPANDED = {"dns-names", "uri-sans", "common-name", "literal-subject"}
CSI_VARS = {"POD_NAME", "POD_NAMESPACE", "POD_UID", "SERVICE_ACCOUNT_NAME"}


def dig(d, *path):
    for p in path:
        if not isinstance(d, dict):
            return None
        d = d.get(p)
    return d


def ident(doc):
    return f"{doc.get('kind')}/{dig(doc, 'metadata', 'name')}"


def labels(doc):
    return dig(doc, "metadata", "labels") or {}


def is_kt(doc):
    return labels(doc).get("app.kubernetes.io/part-of") == "kt"


def pod_template(doc):
    path = WORKLOAD_KINDS.get(doc.get("kind"))
    return dig(doc, *path) if path else None


def replicas(doc):
    if doc.get("kind") in ("Deployment", "StatefulSet", "ReplicaSet"):
        return dig(doc, "spec", "replicas") or 1
    return None


def selects(selector, pod_labels):
    """Does a LabelSelector match these labels?"""
    if selector is None:
        return False
    for k, v in (selector.get("matchLabels") or {}).items():
        if pod_labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        key, op, vals = e["key"], e["operator"], e.get("values") or []
        have = key in pod_labels
        if op == "In" and not (have and pod_labels[key] in vals):
            return False
        if op == "NotIn" and have and pod_labels[key] in vals:
            return False
        if op == "Exists" and not have:
            return False
        if op == "DoesNotExist" and have:
            return False
    return True


def containers(spec):
    return (spec.get("initContainers") or []) + (spec.get("containers") or [])


def runs_kt(spec):
    """The name of a container of the pod that runs kt (kt's image, the
    agent, or kt's variables), or None."""
    for c in containers(spec):
        image = (c.get("image") or "").rsplit("/", 1)[-1]
        repo = re.split(r"[:@]", image, maxsplit=1)[0]
        env = {e.get("name") or "" for e in c.get("env") or []}
        if (c.get("name") == AGENT or repo in KT_IMAGES
                or any(n.startswith("KT_") and n not in WORKLOAD_KT_ENV for n in env)):
            return c.get("name")
    return None


def env_of(c):
    return {e.get("name"): e.get("value") for e in c.get("env") or []}


def kube_auth(c):
    return env_of(c).get("KT_KUBE_AUTH") == "true"


def mount_of(c, spec, file_path):
    """The volume a container's file path lies on: (volume, path inside it),
    or (None, None)."""
    best = None
    for m in c.get("volumeMounts") or []:
        mp = (m.get("mountPath") or "").rstrip("/")
        if file_path.startswith(mp + "/") and (best is None or len(mp) > len(best[0])):
            best = (mp, m.get("name"))
    if best is None:
        return None, None
    vol = next((v for v in spec.get("volumes") or [] if v.get("name") == best[1]), None)
    return vol, file_path[len(best[0]) + 1:]


def mount_entry(c, file_path):
    """The volumeMount of a container that a file path lies under (the
    deepest), or None."""
    best = None
    for m in c.get("volumeMounts") or []:
        mp = (m.get("mountPath") or "").rstrip("/")
        if file_path.startswith(mp + "/") and (
                best is None or len(mp) > len(best.get("mountPath", "").rstrip("/"))):
            best = m
    return best


def env_with(c, configmaps):
    """A container's environment as its process sees it, so far as the
    bundle says: its envFrom ConfigMaps (of the bundle), then its env."""
    out = {}
    for e in c.get("envFrom") or []:
        data = configmaps.get(dig(e, "configMapRef", "name")) or {}
        out.update({(e.get("prefix") or "") + k: v for k, v in data.items()})
    out.update(env_of(c))
    return out


def env_expanded(c, configmaps, ns):
    """env_with, as the process sees it in namespace `ns`: the downward
    API's metadata.namespace resolved, and `$(VAR)` references to the
    container's other variables expanded (as the kubelet does)."""
    env = env_with(c, configmaps)
    for e in c.get("env") or []:
        if dig(e, "valueFrom", "fieldRef", "fieldPath") == "metadata.namespace":
            env[e.get("name")] = ns
    ref = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
    return {k: ref.sub(lambda m: env.get(m.group(1)) or m.group(0), v) if isinstance(v, str)
            else v for k, v in env.items()}


def url_host(url):
    rest = url.split("://", 1)[-1]
    return rest.split("/", 1)[0].rsplit(":", 1)[0] if rest else ""


def csi_attrs(vol):
    """The volume attributes of a cert-manager csi-driver volume (without
    the csi.cert-manager.io/ prefix), or None for any other volume."""
    if dig(vol, "csi", "driver") != CSI_DRIVER:
        return None
    return {k[len(CSI):]: v for k, v in (dig(vol, "csi", "volumeAttributes") or {}).items()
            if k.startswith(CSI)}


def secret_refs(spec):
    """Where a pod spec refers to Secrets: (what, secret name)."""
    out = []
    for v in spec.get("volumes") or []:
        name = dig(v, "secret", "secretName")
        if name:
            out.append((f"volume {v.get('name')}", name))
        for src in dig(v, "projected", "sources") or []:
            name = dig(src, "secret", "name")
            if name:
                out.append((f"volume {v.get('name')}", name))
    for c in containers(spec):
        for e in c.get("env") or []:
            name = dig(e, "valueFrom", "secretKeyRef", "name")
            if name:
                out.append((f"container {c.get('name')} env {e.get('name')}", name))
        for e in c.get("envFrom") or []:
            name = dig(e, "secretRef", "name")
            if name:
                out.append((f"container {c.get('name')} envFrom", name))
    return out


def path_of(where):
    """The file of a violation's `where` (`file: Kind/name`)."""
    return where.split(": ", 1)[0]


def rule_matches(rule, sa, ns, home):
    return ((rule.get("namespace") or home) == ns
            and rule.get("serviceAccount") in ("*", sa))


class Checker:
    def __init__(self, version):
        self.version = version
        self.errors = []

    def fail(self, where, rule, msg):
        self.errors.append((where, rule, msg))

    def report(self):
        return [f"{where}: {msg} [{rule}]" for where, rule, msg in self.errors]

    def expect(self, path, start):
        """A negative case (testbed/k8s/cases/<name>/expect-policy): each
        expected violation must be among those reported for the file since
        `start`, and is then no error; an expectation that did not fire is
        one."""
        spec = HERE / "cases" / path.stem / "expect-policy"
        if path.parent.name != "cases" or not spec.is_file():
            return
        want = set()
        for line in spec.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                obj, _, rule = line.rpartition(" ")
                want.add((obj.strip(), rule))
        got = self.errors[start:]
        keep, seen = [], set()
        for e in got:
            key = (e[0].split(": ", 1)[1] if ": " in e[0] else "", e[1])
            if key in want:
                seen.add(key)
            else:
                keep.append(e)
        for obj, rule in sorted(want - seen):
            keep.append((f"{path}: {obj}", "negative-case",
                         f"expected a violation of [{rule}] here "
                         f"({spec.relative_to(HERE.parent.parent)}), none was reported: the "
                         "rule no longer guards what this case breaks"))
        self.errors[start:] = keep

    # --- rules over every pod template -----------------------------------

    def sidecar(self, where, spec):
        """The injected agent is a native sidecar the workload waits for."""
        inits = spec.get("initContainers") or []
        conts = spec.get("containers") or []
        if any(c.get("name") == AGENT for c in conts):
            self.fail(where, "sidecar-race",
                      f"{AGENT} is a regular container: the workload can start before its "
                      "agent (it must be an init container with restartPolicy Always)")
        agent = next((c for c in inits if c.get("name") == AGENT), None)
        if agent is None:
            return
        if agent.get("restartPolicy") != "Always":
            self.fail(where, "sidecar-race",
                      f"init container {AGENT} lacks restartPolicy Always (not a native sidecar)")
        probe = dig(agent, "startupProbe", "httpGet", "path")
        if probe != "/readyz":
            self.fail(where, "sidecar-race",
                      f"{AGENT} has no startup probe on /readyz, so the workload does not "
                      "wait for its socket")
        if dig(agent, "resources", "limits", "ephemeral-storage") is not None:
            self.fail(where, "ephemeral-storage",
                      f"{AGENT} sets an ephemeral-storage limit: the kubelet would cap the "
                      "whole pod, the workload's own emptyDirs included, at the sum of limits")
        if spec.get("shareProcessNamespace") is not True:
            self.fail(where, "sidecar", "shareProcessNamespace is not true")
        if not conts:
            self.fail(where, "sidecar", "no workload container")
            return
        first = conts[0]
        env = {e.get("name"): e.get("value") for e in first.get("env") or []}
        agent_env = {e.get("name"): e.get("value") for e in agent.get("env") or []}
        if env.get("KT_AGENT_AUTOSTART") != "0":
            self.fail(where, "sidecar-race",
                      f"container {first.get('name')} lacks KT_AGENT_AUTOSTART=0: kt there "
                      "would try to start an agent of its own")
        if env.get("KT_AGENT_SOCKET") != agent_env.get("KT_AGENT_SOCKET"):
            self.fail(where, "sidecar",
                      f"container {first.get('name')} and {AGENT} disagree on KT_AGENT_SOCKET")
        run = [m for m in first.get("volumeMounts") or [] if m.get("name") == "kt-run"]
        if not run or not all(m.get("readOnly") for m in run):
            self.fail(where, "socket-dir",
                      f"container {first.get('name')} does not mount kt-run read-only: it "
                      "could create or replace the agent's socket directory")

    def service_links(self, where, tpl, spec):
        """A pod that runs kt has no service links: a Service named like a
        kt variable (kt-relay: KT_RELAY_PORT=tcp://...) would set it."""
        if spec.get("enableServiceLinks") is False:
            return
        runs = runs_kt(spec)
        if runs is None:
            return
        pod_labels = dig(tpl, "metadata", "labels") or {}
        if (pod_labels.get("kt.dev/agent") == "sidecar"
                and AGENT not in {c.get("name") for c in containers(spec)}):
            return  # the injector's to add (its template is checked)
        self.fail(where, "service-links",
                  f"container {runs} runs kt, but the pod has service links "
                  "(enableServiceLinks is not false): a Service named kt-relay, kt-tensor or "
                  "kt-node-cache would set KT_RELAY_PORT, KT_TENSOR_PORT or KT_NODE_CACHE_PORT "
                  "(tcp://<ip>:<port>) in it")

    def volumes(self, where, spec, kt_pod):
        """Every disk-backed emptyDir of kt's has a sizeLimit."""
        for v in spec.get("volumes") or []:
            ed = v.get("emptyDir")
            if ed is None:
                continue
            ours = kt_pod or v.get("name", "").startswith("kt-")
            if ours and ed.get("medium") != "Memory" and not ed.get("sizeLimit"):
                self.fail(where, "ephemeral-storage",
                          f"emptyDir {v.get('name')} has no sizeLimit")

    def emptydir_fit(self, where, spec):
        """A pod's disk-backed emptyDirs fit in its ephemeral-storage limit.
        The kubelet adds its containers' limits into one pod-level limit and
        evicts the pod once its emptyDirs, logs and writable layers together
        pass it: an emptyDir whose sizeLimit is at or above that limit gets
        the pod evicted before the volume is full (and an evicted pod's
        emptyDirs are deleted, so a Deployment's next pod starts over)."""
        def limit_of(c):
            q = dig(c, "resources", "limits", "ephemeral-storage")
            return None if q is None else mem_bytes(str(q))

        regular = list(spec.get("containers") or [])
        regular += [c for c in spec.get("initContainers") or []
                    if c.get("restartPolicy") == "Always"]
        inits = [c for c in spec.get("initContainers") or []
                 if c.get("restartPolicy") != "Always"]
        if all(limit_of(c) is None for c in regular + inits):
            return  # no container has a limit: the pod has none
        # The kubelet's pod-level limit (resourcehelper.PodLimits): the sum
        # over the containers and native sidecars, or a larger init
        # container's (which runs alone).
        limit = max([sum(limit_of(c) or 0 for c in regular)]
                    + [limit_of(c) or 0 for c in inits])
        sized = [(v.get("name"), mem_bytes(str(dig(v, "emptyDir", "sizeLimit"))))
                 for v in spec.get("volumes") or []
                 if v.get("emptyDir") is not None and v["emptyDir"].get("medium") != "Memory"
                 and dig(v, "emptyDir", "sizeLimit") is not None]
        total = sum(n for _, n in sized)
        if sized and total >= limit:
            self.fail(where, "emptydir-fit",
                      f"the disk emptyDirs ({', '.join(f'{n} {q >> 20}Mi' for n, q in sized)}) "
                      f"add up to {total >> 20}Mi, not below the pod's ephemeral-storage limit "
                      f"of {limit >> 20}Mi (the sum of its containers'): the kubelet evicts the "
                      "pod before they are full, and deletes them with it; raise the limit "
                      "above their sizeLimits plus logs, or put the data on a claim")

    def restricted(self, where, spec):
        """Pod Security `restricted`, as the namespace enforces it."""
        psc = spec.get("securityContext") or {}
        for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
            sc = c.get("securityContext") or {}
            name = c.get("name")
            if name == NODE_CACHE_INIT:
                continue  # root with CAP_CHOWN alone: host_paths checks it
            non_root = sc.get("runAsNonRoot", psc.get("runAsNonRoot"))
            seccomp = dig(sc, "seccompProfile", "type") or dig(psc, "seccompProfile", "type")
            problems = []
            if non_root is not True:
                problems.append("runAsNonRoot")
            if sc.get("allowPrivilegeEscalation") is not False:
                problems.append("allowPrivilegeEscalation: false")
            if "ALL" not in (dig(sc, "capabilities", "drop") or []):
                problems.append("capabilities.drop [ALL]")
            if seccomp not in ("RuntimeDefault", "Localhost"):
                problems.append("seccompProfile RuntimeDefault")
            if problems:
                self.fail(where, "pod-security",
                          f"container {name} does not meet Pod Security restricted: "
                          + ", ".join(problems))

    def host_paths(self, where, spec, docs):
        """Datasets on nodes: the only hostPath is below the dataset root;
        only the node-cache agent (non-root) writes it, after an init
        container that may chown it and nothing else; every other
        container mounts it read-only; and the bundle's namespace admits
        hostPath volumes (Pod Security privileged)."""
        host = {v.get("name"): dig(v, "hostPath", "path") for v in spec.get("volumes") or []
                if v.get("hostPath") is not None}
        if not host:
            return
        for name, p in host.items():
            p = (p or "").rstrip("/")
            if p != DATASET_ROOT and not p.startswith(DATASET_ROOT + "/"):
                self.fail(where, "host-path",
                          f"volume {name}: hostPath {p or '?'} is not below {DATASET_ROOT}: kt's "
                          "pods mount the node's datasets and nothing else of the node")
        for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
            cname = c.get("name")
            for m in c.get("volumeMounts") or []:
                if m.get("name") not in host or m.get("readOnly"):
                    continue
                if cname == NODE_CACHE:
                    sc = c.get("securityContext") or {}
                    user = sc.get("runAsUser", dig(spec, "securityContext", "runAsUser"))
                    if user in (None, 0):
                        self.fail(where, "host-path",
                                  f"{NODE_CACHE} writes the node's datasets as root")
                elif cname == NODE_CACHE_INIT:
                    sc = c.get("securityContext") or {}
                    caps = dig(sc, "capabilities") or {}
                    cmd = c.get("command") or []
                    if ("ALL" not in (caps.get("drop") or []) or set(caps.get("add") or [])
                            - {"CHOWN"} or sc.get("allowPrivilegeEscalation") is not False
                            or not cmd or not cmd[0].endswith("chown")):
                        self.fail(where, "host-path",
                                  f"{NODE_CACHE_INIT} does more than chown the dataset root "
                                  "(capabilities: drop ALL, add CHOWN alone; no privilege "
                                  "escalation; its command chown)")
                else:
                    self.fail(where, "host-path",
                              f"container {cname} mounts the node's datasets ({m.get('name')}) "
                              "read-write: only the node-cache agent writes them")
        for ns in (d for d in docs if d.get("kind") == "Namespace"):
            level = labels(ns).get("pod-security.kubernetes.io/enforce")
            if level not in (None, "privileged"):
                self.fail(where, "pod-security",
                          f"mounts a hostPath, which Pod Security {level!r} (the namespace "
                          f"{dig(ns, 'metadata', 'name')}'s) refuses: the pod would never be "
                          "admitted (label it enforce: privileged; PodSecurity cannot exempt a "
                          "ServiceAccount)")

    def gpus(self, where, spec):
        """GPUs only as Kubernetes allocates them: no NVIDIA_VISIBLE_DEVICES
        (under the NVIDIA toolkit, a container that sets it gets those
        GPUs, `all` of the node's, past the device plugin and whatever other
        pods were given); a container's DRA claims are its pod's."""
        for c in containers(spec):
            env = env_of(c)
            if "NVIDIA_VISIBLE_DEVICES" in env and (
                    env["NVIDIA_VISIBLE_DEVICES"] or "").strip().lower() not in NO_GPUS:
                self.fail(where, "gpu-devices",
                          f"container {c.get('name')} sets NVIDIA_VISIBLE_DEVICES="
                          f"{env['NVIDIA_VISIBLE_DEVICES']}: the NVIDIA toolkit hands it those GPUs "
                          "past the device plugin (with `all`, every GPU of the node, other pods' "
                          "included); request nvidia.com/gpu, or share a DRA claim (gpu-dra)")
        claims = {rc.get("name") for rc in spec.get("resourceClaims") or []}
        for c in containers(spec):
            for rc in dig(c, "resources", "claims") or []:
                if rc.get("name") not in claims:
                    self.fail(where, "resource-claims",
                              f"container {c.get('name')} uses the claim {rc.get('name')!r}, which "
                              "is not among the pod's resourceClaims: the API server refuses the pod")
        # gpu-dra's claim (`gpu`) is the agent's as much as the workload's:
        # an agent without it was replaced by an agent-sidecar listed later.
        agent = next((c for c in containers(spec) if c.get("name") == AGENT), None)
        if agent is not None and "gpu" in claims and "gpu" not in {
                rc.get("name") for rc in dig(agent, "resources", "claims") or []}:
            self.fail(where, "resource-claims",
                      f"the pod has gpu-dra's claim `gpu`, but {AGENT} does not use it, so it sees "
                      "no GPU: agent-sidecar was listed after gpu-dra (list gpu-dra again after "
                      "it)")

    def agent_env(self, where, spec):
        """The agent's environment is named entry by entry (module doc)."""
        for c in containers(spec):
            if c.get("name") != AGENT:
                continue
            if c.get("envFrom"):
                self.fail(where, "agent-env-from",
                          f"{AGENT} takes envFrom {c.get('envFrom')}: whoever may edit that "
                          "ConfigMap or Secret sets any variable in the agent (LD_PRELOAD, KT_*, "
                          "OTEL_*); name each variable with valueFrom instead")
            refs = {}
            for e in c.get("env") or []:
                ref = dig(e, "valueFrom", "configMapKeyRef") or {}
                if ref.get("name") == NCCL_CONFIGMAP:
                    refs[e.get("name")] = ref.get("key")
            if not refs:
                continue
            allowed = workload_nccl_env()
            wrong = sorted(k for k, key in refs.items() if k != key)
            if wrong or sorted(refs) != sorted(allowed):
                self.fail(where, "agent-nccl-env",
                          f"{AGENT}'s settings from ConfigMap {NCCL_CONFIGMAP} are "
                          f"{sorted(refs)} (renamed: {wrong}), not the NCCL settings it honours "
                          f"{allowed} each under its own name (netenv.rs's WORKLOAD_NCCL_ENV; "
                          "`make manifests`)")

    def rdma(self, where, spec, memlock=False):
        """RDMA grants come together (see the module doc); with memlock
        the nodes raise the memlock limit, and IPC_LOCK is not needed."""
        for c in containers(spec):
            name = c.get("name")
            res = c.get("resources") or {}
            hca = any(k.startswith("rdma/") for side in ("requests", "limits")
                      for k in (res.get(side) or {}))
            added = set(dig(c, "securityContext", "capabilities", "add") or [])
            if hca and "IPC_LOCK" not in added and not memlock:
                self.fail(where, "rdma-grants",
                          f"container {name} is given an HCA (rdma/*) without IPC_LOCK: ibverbs "
                          "cannot register NCCL's buffers under the default memlock limit, and "
                          "every inter-node connect fails")
            if hca and memlock and "IPC_LOCK" in added:
                self.fail(where, "rdma-grants",
                          f"container {name} adds IPC_LOCK though its pod says kt.dev/memlock: "
                          "node (the nodes raise the memlock limit): drop the capability")
            if hca and added - {"IPC_LOCK"}:
                self.fail(where, "rdma-grants",
                          f"container {name} adds {sorted(added - {'IPC_LOCK'})} besides IPC_LOCK: "
                          "RDMA needs IPC_LOCK alone")
            if "IPC_LOCK" in added and not hca:
                self.fail(where, "rdma-grants",
                          f"container {name} adds IPC_LOCK without an HCA (an rdma/* resource): "
                          "a capability for nothing")
            mem = str(dig(res, "limits", "memory") or "")
            if hca and name == AGENT and mem_bytes(mem) < 1 << 30:
                self.fail(where, "rdma-grants",
                          f"{AGENT} runs NCCL over RDMA in a memory limit of {mem or 'none'}: a CUDA "
                          "context and NCCL's pinned buffers need 1Gi or more")

    def flight(self, where, spec, docs):
        """An agent serving Arrow Flight (KT_FLIGHT_ADDR) fetches into a
        volume of its own (KT_FLIGHT_DIR, mounted from an emptyDir) whose
        sizeLimit holds KT_FLIGHT_BUDGET times KT_FLIGHT_MAX_CALLS: the
        calls' files would otherwise fill the agent's small state volume
        and the kubelet evicts the pod. Its memory limit holds
        KT_FLIGHT_MAX_CALLS times what one call may hold (flight.rs's
        CALL_MEMORY) above the agent's own 512Mi: past it the agent is
        OOM-killed, and with it the pod's exports, tensors and relays.
        Where the bundle has the agents' NetworkPolicy, it admits the
        Flight port."""
        agent = next((c for c in containers(spec) if c.get("name") == AGENT), None)
        if agent is None:
            return
        env = {e.get("name"): e.get("value") for e in agent.get("env") or []}
        addr = env.get("KT_FLIGHT_ADDR")
        if not addr:
            return
        budget = kt_size(env.get("KT_FLIGHT_BUDGET") or "1GiB")
        calls = int(env.get("KT_FLIGHT_MAX_CALLS") or 16)
        need = budget * calls
        d = env.get("KT_FLIGHT_DIR")
        mount = next((m for m in agent.get("volumeMounts") or []
                      if d and m.get("mountPath") == d), None)
        vol = next((v for v in spec.get("volumes") or []
                    if mount and v.get("name") == mount.get("name")), None)
        limit = mem_bytes(str(dig(vol or {}, "emptyDir", "sizeLimit") or ""))
        if vol is None or dig(vol, "emptyDir") is None:
            self.fail(where, "flight-scratch",
                      f"{AGENT} serves Flight but KT_FLIGHT_DIR ({d or 'unset'}) is no emptyDir "
                      f"of its own: its calls may hold {need} bytes (budget x calls) in the "
                      "agent's state volume, and the kubelet evicts the pod past its sizeLimit")
        elif limit < need:
            self.fail(where, "flight-scratch",
                      f"{AGENT}'s Flight volume {vol.get('name')} has a sizeLimit of "
                      f"{limit} bytes, less than KT_FLIGHT_BUDGET x KT_FLIGHT_MAX_CALLS = {need}: "
                      "the agent refuses to start")
        memory = mem_bytes(str(dig(agent, "resources", "limits", "memory") or ""))
        want = AGENT_MEMORY + calls * flight_call_memory()
        if memory < want:
            self.fail(where, "flight-memory",
                      f"{AGENT} serves Flight with a memory limit of {memory or 'none'} bytes, less "
                      f"than 512Mi + KT_FLIGHT_MAX_CALLS ({calls}) x {flight_call_memory()} "
                      f"(flight.rs's CALL_MEMORY) = {want}: calls at once get it OOM-killed "
                      "(the flight component sets it for 4 calls; raise it with the calls)")
        port = int(addr.rsplit(":", 1)[-1])
        for doc in docs:
            if doc.get("kind") != "NetworkPolicy" or dig(doc, "metadata", "name") != "kt-agent":
                continue
            ports = [p for rule in dig(doc, "spec", "ingress") or []
                     for p in rule.get("ports") or []]
            if not any(p.get("port") == port or
                       (isinstance(p.get("port"), int) and p.get("endPort")
                        and p["port"] <= port <= p["endPort"]) for p in ports):
                self.fail(where, "flight-port",
                          f"{AGENT} serves Flight on {port}, which NetworkPolicy kt-agent does not "
                          "admit: list the flight component after agent-networkpolicy")

    def identity_order(self, where, tpl, spec):
        """A pod agent-identity marked still has what agent-identity gave
        it: a later agent-sidecar (listed after it, here or in a
        kustomization over this one) replaces the agent and the kt-token
        volume, silently putting the static token back."""
        mark = dig(tpl, "metadata", "annotations", IDENTITY_ANNOTATION)
        if mark is None:
            return
        if mark != "serviceaccount":
            self.fail(where, "identity-order",
                      f"{IDENTITY_ANNOTATION}: {mark!r} is not `serviceaccount`")
            return
        agent = next((c for c in containers(spec) if c.get("name") == AGENT), None)
        vol = next((v for v in spec.get("volumes") or [] if v.get("name") == "kt-token"), {})
        projected = any(src.get("serviceAccountToken")
                        for src in dig(vol, "projected", "sources") or [])
        lost = []
        if agent is None:
            lost.append(f"no {AGENT}")
        elif not kube_auth(agent):
            lost.append(f"{AGENT} without KT_KUBE_AUTH=true")
        if not projected:
            lost.append("a kt-token volume that is no projected ServiceAccount token")
        if lost:
            self.fail(where, "identity-order",
                      f"marked {IDENTITY_ANNOTATION}: serviceaccount by agent-identity, but has "
                      + " and ".join(lost) + ": agent-sidecar was listed after agent-identity "
                      "(here or in a kustomization over this one) and put the static token back; "
                      "list agent-identity again after it")

    def static_workload(self, where, spec):
        """The static token is admin: outside the testbeds no workload has it."""
        for what, name in secret_refs(spec):
            if name == TOKEN_SECRET:
                self.fail(where, "static-token-workload",
                          f"{what} refers to the Secret {TOKEN_SECRET}, the static token, which is "
                          "admin (any key, any service, teardowns): outside the kind/k3d testbeds "
                          "a workload presents its pod's ServiceAccount token (install with "
                          "kube-identity, list agent-identity after agent-sidecar)")

    # --- identity: the static token or kube identity ---------------------

    def tokens(self, where, spec, kube_bundle):
        """KT_TOKEN_FILE is a credential the pod really has, of the kind its
        verifiers expect; kt's projected tokens are for kt, and short-lived."""
        if kube_bundle or any(kube_auth(c) for c in containers(spec)):
            for what, name in secret_refs(spec):
                if name == TOKEN_SECRET:
                    self.fail(where, "static-token",
                              f"{what} refers to the Secret {TOKEN_SECRET}, which an install "
                              "with kube identity does not have: the pod would never start "
                              "(workloads: list agent-identity after agent-sidecar)")
        seen = set()
        for c in containers(spec):
            path = env_of(c).get("KT_TOKEN_FILE")
            if not path:
                continue
            name = c.get("name")
            vol, rel = mount_of(c, spec, path)
            if vol is None:
                self.fail(where, "token-file",
                          f"container {name}: KT_TOKEN_FILE {path} is on no volume it mounts")
                continue
            projected = [src["serviceAccountToken"]
                         for src in dig(vol, "projected", "sources") or []
                         if src.get("serviceAccountToken")]
            own = next((t for t in projected if t.get("path") == rel), None)
            static = dig(vol, "secret", "secretName") == TOKEN_SECRET
            if own is None and not static:
                self.fail(where, "token-file",
                          f"container {name}: KT_TOKEN_FILE {path} is neither the "
                          f"{TOKEN_SECRET} Secret's token nor a projected ServiceAccount token")
            if name in VERIFIERS and kube_auth(c) and own is None:
                self.fail(where, "identity-mode",
                          f"container {name} has KT_KUBE_AUTH=true but presents no projected "
                          "ServiceAccount token (KT_TOKEN_FILE): the metadata server cannot "
                          "review it")
            if name in VERIFIERS and not kube_auth(c) and own is not None:
                self.fail(where, "identity-mode",
                          f"container {name} presents a projected ServiceAccount token without "
                          "KT_KUBE_AUTH=true: it would take that token for the one static "
                          "token and refuse every other caller")
            if vol.get("name") in seen:
                continue
            seen.add(vol.get("name"))
            for t in projected:
                aud = t.get("audience")
                if aud != AUDIENCE:
                    self.fail(where, "token-audience",
                              f"volume {vol.get('name')}: a ServiceAccount token for the audience "
                              f"{aud!r}, not {AUDIENCE!r}: the metadata server reviews tokens for "
                              f"{AUDIENCE!r} only (and one without an audience is good against "
                              "the API server)")
                secs = t.get("expirationSeconds", 3600)
                lo, hi = TOKEN_SECONDS
                if not (isinstance(secs, int) and lo <= secs <= hi):
                    self.fail(where, "token-lifetime",
                              f"volume {vol.get('name')}: expirationSeconds {secs} is outside "
                              f"{lo}..{hi} (the API's minimum; an hour at most, so a leaked token "
                              "is soon of no use)")

    def metadata_identity(self, path, docs, meta, store_sa):
        """A metadata server with KT_KUBE_AUTH can review tokens and read its
        access map, and the map gives the servers their roles."""
        where = f"{path}: {ident(meta)}"
        spec = dig(pod_template(meta), "spec") or {}
        c = next((c for c in spec.get("containers") or [] if c.get("name") == "kt-metadata"), {})
        ns = dig(meta, "metadata", "namespace")
        sa = spec.get("serviceAccountName") or "default"
        cluster_roles = {dig(d, "metadata", "name"): d for d in docs
                         if d.get("kind") == "ClusterRole"}

        def reviews(role):
            if role == "system:auth-delegator":  # built in
                return True
            for r in dig(cluster_roles.get(role) or {}, "rules") or []:
                if (set(r.get("apiGroups") or []) & {"authentication.k8s.io", "*"}
                        and set(r.get("resources") or []) & {"tokenreviews", "*"}
                        and set(r.get("verbs") or []) & {"create", "*"}):
                    return True
            return False

        bound = any(
            d.get("kind") == "ClusterRoleBinding"
            and dig(d, "roleRef", "kind") == "ClusterRole"
            and reviews(dig(d, "roleRef", "name"))
            and any(s.get("kind") == "ServiceAccount" and s.get("name") == sa
                    and s.get("namespace") == ns for s in d.get("subjects") or [])
            for d in docs)
        if not bound:
            self.fail(where, "tokenreview",
                      f"has KT_KUBE_AUTH=true, but no ClusterRoleBinding of the bundle lets its "
                      f"ServiceAccount {ns}/{sa} create tokenreviews (authentication.k8s.io): "
                      "every caller would be refused")
        amap = env_of(c).get("KT_ACCESS_MAP")
        if not amap:
            self.fail(where, "access-map", "has KT_KUBE_AUTH=true but no KT_ACCESS_MAP")
            return
        vol, rel = mount_of(c, spec, amap)
        cm_name = dig(vol or {}, "configMap", "name")
        if cm_name is None:
            self.fail(where, "access-map",
                      f"KT_ACCESS_MAP {amap} is not on a ConfigMap volume it mounts")
            return
        items = dig(vol, "configMap", "items")
        key = next((i.get("key") for i in items if i.get("path") == rel), None) if items else rel
        cm = next((d for d in docs if d.get("kind") == "ConfigMap"
                   and dig(d, "metadata", "name") == cm_name), None)
        text = dig(cm or {}, "data", key) if key else None
        if text is None:
            self.fail(where, "access-map",
                      f"KT_ACCESS_MAP {amap}: the bundle has no ConfigMap {cm_name} with the key "
                      f"{key}: the pod would not start (or the server not read its map)")
            return
        expect = {sa: {"admin"}}
        if store_sa:
            expect[store_sa] = {"store"}
        # The datasets components' ServiceAccounts, where the bundle runs them
        # (the controller's PVC ingest Jobs: `kt put datasets/...` only).
        writes = {}
        for d in docs:
            pod_sa = dig(pod_template(d) or {}, "spec", "serviceAccountName")
            if dig(d, "metadata", "name") == "kt-dataset-controller" and pod_sa:
                expect[pod_sa] = {"admin"}
                for c in dig(pod_template(d), "spec", "containers") or []:
                    ingest_sa = env_of(c).get("KT_INGEST_SERVICE_ACCOUNT")
                    if ingest_sa:
                        expect[ingest_sa] = {"workload"}
                        writes[ingest_sa] = ["datasets"]
            elif dig(d, "metadata", "name") == NODE_CACHE and pod_sa:
                expect[pod_sa] = {"pod"}
        self.access_map(f"{path}: ConfigMap/{cm_name}", text, ns, expect, writes)

    def access_map(self, where, text, home, expect, writes=None):
        """The access map parses as the metadata server reads it, every rule
        can be reached, kt's own ServiceAccounts get their roles, and those
        of `writes` write exactly the services named there."""
        try:
            m = yaml.safe_load(text)
        except yaml.YAMLError as e:
            self.fail(where, "access-map", f"not YAML: {e}")
            return
        rules = m.get("rules") if isinstance(m, dict) else None
        if not isinstance(m, dict) or set(m) != {"rules"} or not isinstance(rules, list) \
                or not rules:
            self.fail(where, "access-map", "not a map of a non-empty `rules` list alone")
            return
        for i, r in enumerate(rules):
            if not isinstance(r, dict):
                self.fail(where, "access-map", f"rules[{i}] is not a map")
                continue
            at = f"rules[{i}] ({r.get('serviceAccount')})"
            unknown = sorted(set(r) - RULE_FIELDS)
            if unknown:
                self.fail(where, "access-map",
                          f"{at}: unknown field(s) {', '.join(unknown)}: the metadata server "
                          "refuses the map")
            if not isinstance(r.get("serviceAccount"), str) or not r.get("serviceAccount"):
                self.fail(where, "access-map", f"{at}: no serviceAccount")
            role = r.get("role")
            if role not in ROLES:
                self.fail(where, "access-map",
                          f"{at}: role {role!r} is none of {', '.join(sorted(ROLES))}")
            svc = r.get("services")
            reads = r.get("reads")
            if (svc is not None or r.get("podService") or reads is not None) \
                    and role not in ("workload", "pod"):
                self.fail(where, "access-map",
                          f"{at}: only workload and pod rules have services, podService or reads")
            if svc is not None and not (isinstance(svc, list) and svc
                                        and all(isinstance(x, str) and x for x in svc)):
                self.fail(where, "access-map", f"{at}: services is not a list of names")
            # `reads: []` is meaningful (its own services only).
            if reads is not None and not (isinstance(reads, list)
                                          and all(isinstance(x, str) and x for x in reads)):
                self.fail(where, "access-map", f"{at}: reads is not a list of names")
            for j, e in enumerate(rules[:i]):
                if isinstance(e, dict) and rule_matches(
                        e, r.get("serviceAccount"), r.get("namespace") or home, home):
                    self.fail(where, "access-map",
                              f"{at} is never reached: rules[{j}] ({e.get('serviceAccount')}) "
                              "matches first (the first matching rule wins)")
                    break
        for sa, want in expect.items():
            rule = next((r for r in rules if isinstance(r, dict)
                         and rule_matches(r, sa, home, home)), None)
            got = rule.get("role") if rule else None
            if got not in want:
                why = "more than it needs" if got == "admin" else "its calls would be refused"
                self.fail(where, "access-map",
                          f"kt's own ServiceAccount {sa} is {got or 'in no rule'}, not "
                          f"{' or '.join(sorted(want))}: {why}")
            elif sa in (writes or {}) and (rule.get("services") != writes[sa]
                                           or rule.get("podService")):
                self.fail(where, "access-map",
                          f"kt's own ServiceAccount {sa} writes "
                          f"{rule.get('services') or 'every service'}"
                          f"{' and its pod service' if rule.get('podService') else ''}, not "
                          f"{writes[sa]} alone: more than it needs")

    # --- TLS: cert-manager's certificates ---------------------------------

    def tls(self, where, spec, configmaps):
        """A container's TLS files are a pair, on volumes it mounts read-only,
        each the file cert-manager writes for it; a pod that serves TLS calls
        kt at https:// URLs, with a CA to trust; a kt server's probes speak
        what it serves; every https:// URL has a CA to trust; nothing in an
        agent's pod serves TLS (yet); cert-manager's csi-driver gets
        attributes it accepts."""
        psc = spec.get("securityContext") or {}
        pod_tls = any(env_with(c, configmaps).get("KT_TLS_CERT") for c in containers(spec))
        # A pod with the agent: the agent, and the workload whose `kt` runs
        # broadcast relays (which serve TLS whenever KT_TLS_CERT is set).
        agent_pod = any(c.get("name") == AGENT for c in containers(spec))
        for v in spec.get("volumes") or []:
            attrs = csi_attrs(v)
            if attrs is None:
                continue
            at = f"volume {v.get('name')}"
            if dig(v, "csi", "readOnly") is not True:
                self.fail(where, "tls-csi",
                          f"{at}: the csi-driver mounts read-only volumes only (readOnly: true)")
            if not attrs.get("issuer-name"):
                self.fail(where, "tls-csi", f"{at}: no {CSI}issuer-name")
            for k, val in sorted(attrs.items()):
                if "${" not in str(val):
                    continue
                if k not in CSI_EXPANDED:
                    self.fail(where, "tls-csi",
                              f"{at}: {CSI}{k} {val!r}: the csi-driver expands no variable "
                              "there: the mount fails and the pod never starts (it has no IP "
                              "yet when its volumes are mounted: name the pod in dns-names)")
                    continue
                unknown = sorted(set(re.findall(r"\$\{([^}]*)\}", str(val))) - CSI_VARS)
                if unknown:
                    self.fail(where, "tls-csi",
                              f"{at}: {CSI}{k} uses {', '.join(unknown)}, which the csi-driver "
                              f"does not know (only {', '.join(sorted(CSI_VARS))}): the mount "
                              "fails")
            # The driver writes its files 0440, root's, of the group fs-group:
            # a non-root container reads them only as that group.
            for c in containers(spec):
                if not any(m.get("name") == v.get("name") for m in c.get("volumeMounts") or []):
                    continue
                group = dig(c, "securityContext", "runAsGroup")
                groups = {group if group is not None else psc.get("runAsGroup"),
                          psc.get("fsGroup"), *(psc.get("supplementalGroups") or [])} - {None}
                if not groups:
                    continue  # the image's group: the bundle does not say
                fs_group = attrs.get("fs-group")
                if fs_group is None or not str(fs_group).isdigit() or int(fs_group) not in groups:
                    self.fail(where, "tls-csi",
                              f"{at}: container {c.get('name')} cannot read the certificate's "
                              f"files (0440, group {fs_group or 'root'}): it runs as group(s) "
                              f"{', '.join(map(str, sorted(groups)))} (set {CSI}fs-group to "
                              "one of them)")
        for c in containers(spec):
            name = c.get("name")
            env = env_with(c, configmaps)
            cert, key, ca = (env.get(k) for k in ("KT_TLS_CERT", "KT_TLS_KEY", "KT_CA_FILE"))
            if bool(cert) != bool(key):
                self.fail(where, "tls-files",
                          f"container {name} has {'KT_TLS_CERT' if cert else 'KT_TLS_KEY'} "
                          f"without {'KT_TLS_KEY' if cert else 'KT_TLS_CERT'}: it needs both to "
                          "serve HTTPS")
            if agent_pod and (cert or key):
                # agent-tls makes the pod's kt a TLS client only. Peers call
                # an agent or a relay at https://<pod IP>:<port> and check
                # the certificate against that IP, which the csi-driver
                # cannot put in it: every peer would refuse this one. Until
                # kt verifies agents by pod name, they serve plain HTTP.
                self.fail(where, "tls-agents",
                          f"container {name} of an agent's pod has "
                          f"{'KT_TLS_CERT' if cert else 'KT_TLS_KEY'}: the agent (or the "
                          "broadcast relays of its `kt`) would serve HTTPS with a certificate "
                          "that does not name the pod's IP, which its peers call it by")
            for var, want in TLS_FILES.items():
                path = env.get(var)
                if not path:
                    continue
                m = mount_entry(c, path)
                vol, rel = mount_of(c, spec, path)
                if vol is None:
                    self.fail(where, "tls-files",
                              f"container {name}: {var} {path} is on no volume it mounts")
                    continue
                if not m.get("readOnly"):
                    self.fail(where, "tls-files",
                              f"container {name}: {var} {path} is on a mount it may write to "
                              f"({m.get('mountPath')}): mount volume {vol.get('name')} read-only")
                attrs = csi_attrs(vol)
                if attrs is not None:
                    file = attrs.get(want[1], want[0])
                elif vol.get("secret") is not None:
                    # The Secret's key behind the file (items may rename it).
                    items = dig(vol, "secret", "items") or []
                    rel = next((i.get("key") for i in items if i.get("path") == rel), rel)
                    file = want[0]
                else:
                    self.fail(where, "tls-files",
                              f"container {name}: {var} {path} is on volume {vol.get('name')}, "
                              "neither a Secret (of a cert-manager Certificate) nor the "
                              "csi-driver's: nothing renews it")
                    continue
                if rel != file:
                    self.fail(where, "tls-files",
                              f"container {name}: {var} {path} is {rel} of volume "
                              f"{vol.get('name')}, where cert-manager writes {var}'s file to "
                              f"{file}")
            if name in VERIFIERS:
                for p in PROBES:
                    hg = dig(c, p, "httpGet")
                    if hg is None:
                        continue
                    scheme = hg.get("scheme", "HTTP")
                    if cert and scheme != "HTTPS":
                        self.fail(where, "tls-probes",
                                  f"container {name} serves HTTPS (KT_TLS_CERT) but its {p} "
                                  f"speaks {scheme}: the probe fails and the pod never gets "
                                  "ready")
                    if not cert and scheme == "HTTPS":
                        self.fail(where, "tls-probes",
                                  f"container {name} serves plain HTTP (no KT_TLS_CERT) but its "
                                  f"{p} speaks HTTPS: the probe fails")
                if cert and not ca:
                    self.fail(where, "tls-ca",
                              f"container {name} serves HTTPS but has no KT_CA_FILE: its calls to "
                              "the other kt servers, at https://, would trust nothing")
            for var in URL_ENV:
                url = env.get(var)
                if not url:
                    continue
                if pod_tls and not url.startswith("https://"):
                    self.fail(where, "tls-urls",
                              f"container {name}: {var} {url} is not https:// in a pod with "
                              "TLS")
                if url.startswith("https://") and not ca:
                    self.fail(where, "tls-ca",
                              f"container {name}: {var} is https:// but there is no KT_CA_FILE: "
                              "it would not trust kt's CA")
            url = env.get("KT_ADVERTISE_URL")
            if url and url.startswith("https://") and not cert:
                self.fail(where, "tls-urls",
                          f"container {name} advertises {url} but serves plain HTTP (no "
                          "KT_TLS_CERT)")

    def tls_bundle(self, path, docs, pods, configmaps):
        """The issuers and certificates of a bundle hang together: each
        Certificate's Issuer and each CA Issuer's CA are in it; the servers
        serve their own Certificate's Secret (never the CA's), whose names
        are those clients call them by, in the bundle's namespace; the csi
        volumes ask an Issuer of their pod's namespace; and the servers (the
        metadata server and the store), their clients and the scrapes agree
        on https:// or http://. Not the agents: they serve plain HTTP in
        every bundle (see tls(), "tls-agents"), and their callers follow the
        scheme each one advertises."""
        issuers = {(dig(d, "metadata", "namespace"), dig(d, "metadata", "name")): d
                   for d in docs if d.get("kind") == "Issuer"
                   and d.get("apiVersion", "").startswith("cert-manager.io/")}
        certs = [d for d in docs if d.get("kind") == "Certificate"
                 and d.get("apiVersion", "").startswith("cert-manager.io/")]
        by_secret = {(dig(d, "metadata", "namespace"), dig(d, "spec", "secretName")): d
                     for d in certs}
        services = {dig(d, "metadata", "name") for d in docs if d.get("kind") == "Service"}
        for d in certs:
            where = f"{path}: {ident(d)}"
            ns = dig(d, "metadata", "namespace")
            ref = dig(d, "spec", "issuerRef") or {}
            if ref.get("kind", "Issuer") == "Issuer" and (ns, ref.get("name")) not in issuers:
                self.fail(where, "tls-issuer",
                          f"its Issuer {ref.get('name')} is not in the bundle (namespace {ns}): "
                          "the certificate is never issued")
            for n in dig(d, "spec", "dnsNames") or []:
                parts = n.split(".")
                for i, label in enumerate(parts[:-1]):
                    if label in services and parts[i + 1] != "svc" and parts[i + 1] != ns:
                        self.fail(where, "tls-namespace",
                                  f"dnsName {n} names the namespace {parts[i + 1]!r}, the "
                                  f"Certificate and its Service are in {ns!r} (kustomize's "
                                  "namespace: does not rewrite dnsNames: patch them)")
                        break
        for (ns, name), d in issuers.items():
            secret = dig(d, "spec", "ca", "secretName")
            if secret is None:
                continue
            ca = by_secret.get((ns, secret))
            if ca is None or dig(ca, "spec", "isCA") is not True:
                self.fail(f"{path}: {ident(d)}", "tls-issuer",
                          f"its CA Secret {secret} is no isCA Certificate's of the bundle: "
                          "nothing creates (or renews) it")
        meta_tls = None   # does the bundle's metadata server serve HTTPS?
        for d, _ in pods:
            spec = dig(pod_template(d), "spec") or {}
            where = f"{path}: {ident(d)}"
            ns = dig(d, "metadata", "namespace")
            for v in spec.get("volumes") or []:
                attrs = csi_attrs(v)
                if attrs is None or not issuers:
                    continue
                if attrs.get("issuer-kind", "Issuer") == "Issuer" and (
                        ns, attrs.get("issuer-name")) not in issuers:
                    self.fail(where, "tls-issuer",
                              f"volume {v.get('name')} asks the Issuer "
                              f"{attrs.get('issuer-name')}, which is not in the pod's namespace "
                              f"{ns}: the pod never starts")
            for c in containers(spec):
                env = env_with(c, configmaps)
                cert = env.get("KT_TLS_CERT")
                if dig(d, "metadata", "name") == "kt-metadata" and c.get("name") == "kt-metadata":
                    meta_tls = bool(cert)
                if not cert or not certs:
                    continue
                vol, _ = mount_of(c, spec, cert)
                secret = dig(vol or {}, "secret", "secretName")
                if secret is None:
                    continue
                owner = by_secret.get((ns, secret))
                if owner is None:
                    self.fail(where, "tls-secret",
                              f"container {c.get('name')} serves the Secret {secret}, which no "
                              "Certificate of the bundle writes: nothing renews it")
                    continue
                if dig(owner, "spec", "isCA") is True:
                    self.fail(where, "tls-secret",
                              f"container {c.get('name')} serves the CA's own Secret {secret}: "
                              "the CA's key would sign for anyone who reads it")
                names = set(dig(owner, "spec", "dnsNames") or [])
                advertised = env_expanded(c, configmaps, ns).get("KT_ADVERTISE_URL")
                if c.get("name") == "kt-store" and advertised:
                    host = url_host(advertised)
                    if host not in names:
                        self.fail(where, "tls-names",
                                  f"container kt-store advertises {host}, which its certificate "
                                  f"{ident(owner)} does not name: clients refuse it")
                if c.get("name") == "kt-metadata":
                    for d2, _ in pods:
                        for c2 in containers(dig(pod_template(d2), "spec") or {}):
                            u = env_with(c2, configmaps).get("KT_METADATA_URL")
                            if u and url_host(u) not in names:
                                self.fail(f"{path}: {ident(d2)}", "tls-names",
                                          f"container {c2.get('name')} calls the metadata "
                                          f"server at {url_host(u)}, which its certificate "
                                          f"{ident(owner)} does not name")
        if meta_tls is None:
            return
        # "TLS or none" binds the servers and every client of theirs (the
        # agents and the workloads' `kt` included, as clients), never what
        # the agents serve: peers reach an agent or a relay by pod IP, which
        # its certificate cannot name, so agents serve plain HTTP even in a
        # bundle with TLS.
        for d, _ in pods:
            for c in containers(dig(pod_template(d), "spec") or {}):
                if c.get("name") == "kt-store" and bool(
                        env_with(c, configmaps).get("KT_TLS_CERT")) != meta_tls:
                    self.fail(f"{path}: {ident(d)}", "tls-mode",
                              "container kt-store serves "
                              + ("plain HTTP, but the metadata server HTTPS" if meta_tls
                                 else "HTTPS, but the metadata server plain HTTP")
                              + ": the tls component switches both")
                u = env_with(c, configmaps).get("KT_METADATA_URL")
                if u and u.startswith("https://") != meta_tls:
                    self.fail(f"{path}: {ident(d)}", "tls-mode",
                              f"container {c.get('name')}: KT_METADATA_URL {u}, but the "
                              "metadata server serves "
                              + ("HTTPS (the tls component; workloads: list agent-tls after "
                                 "agent-sidecar)" if meta_tls else "plain HTTP"))
        for d in docs:
            if d.get("kind") == "ServiceMonitor" and meta_tls:
                for ep in dig(d, "spec", "endpoints") or []:
                    if ep.get("scheme", "http") != "https":
                        self.fail(f"{path}: {ident(d)}", "tls-mode",
                                  f"endpoint {ep.get('port')} scrapes http://, which the "
                                  "servers with TLS refuse")

    # --- the sidecar injector (admission webhook) -------------------------

    def webhooks(self, path, docs, metas, pods, configmaps, kube_bundle):
        """kt's mutating webhooks (sidecar-injector): explicit failure
        policy, the pods it may touch, how the API server reaches and trusts
        it, and what it injects."""
        hooks = [d for d in docs if d.get("kind") == "MutatingWebhookConfiguration"
                 and (is_kt(d) or (dig(d, "metadata", "name") or "").startswith("kt-"))]
        if not hooks:
            return
        meta = metas[0] if metas else None
        ns = dig(meta or {}, "metadata", "namespace")
        spec = dig(pod_template(meta), "spec") or {} if meta else {}
        c = next((c for c in spec.get("containers") or [] if c.get("name") == "kt-metadata"), {})
        env = env_with(c, configmaps)
        meta_labels = dig(pod_template(meta), "metadata", "labels") or {} if meta else {}
        services = {dig(d, "metadata", "name"): d for d in docs if d.get("kind") == "Service"}
        certs = {(dig(d, "metadata", "namespace"), dig(d, "metadata", "name")): d
                 for d in docs if d.get("kind") == "Certificate"
                 and d.get("apiVersion", "").startswith("cert-manager.io/")}
        for d in hooks:
            where = f"{path}: {ident(d)}"
            if meta is None:
                self.fail(where, "webhook-service",
                          "no kt-metadata in the bundle to serve it (list sidecar-injector where "
                          "kt is installed)")
                continue
            for w in d.get("webhooks") or []:
                at = f"webhook {w.get('name')}"
                self.webhook_selection(where, at, w, ns, pods)
                if w.get("failurePolicy") not in ("Fail", "Ignore"):
                    self.fail(where, "webhook-failure-policy",
                              f"{at}: failurePolicy is not set to Fail or Ignore: whether a "
                              "labelled pod is created without its agent when kt-metadata cannot "
                              "answer is a choice to write down (Fail: refused; Ignore: admitted "
                              "without it)")
                if w.get("sideEffects") not in ("None", "NoneOnDryRun"):
                    self.fail(where, "webhook-protocol",
                              f"{at}: sideEffects {w.get('sideEffects')!r}: the injection has none "
                              "(None), and dry runs fail on a webhook that says otherwise")
                if "v1" not in (w.get("admissionReviewVersions") or []):
                    self.fail(where, "webhook-protocol",
                              f"{at}: admissionReviewVersions lacks v1, the only one kt-metadata "
                              "answers")
                secs = w.get("timeoutSeconds", 10)
                if not (isinstance(secs, int) and 1 <= secs <= 10):
                    self.fail(where, "webhook-protocol",
                              f"{at}: timeoutSeconds {secs}: each labelled pod's creation waits "
                              "that long while kt-metadata is down (1..10)")
                self.webhook_endpoint(where, at, d, w, ns, c, env, meta_labels, services,
                                      certs, spec, docs)
        self.webhook_template(path, c, spec, configmaps, kube_bundle, env)

    def webhook_selection(self, where, at, w, ns, pods):
        """Only pods labelled for the agent, never kt's own servers' (with
        failurePolicy Fail, a kt-metadata that needed itself to start never
        would), in the install's namespace only (where the injected agent
        reaches kt-metadata and the access map admits it), never
        kube-system."""
        sel = w.get("objectSelector")
        if dig(sel or {}, "matchLabels", "kt.dev/agent") != "sidecar":
            self.fail(where, "webhook-selector",
                      f"{at}: objectSelector does not ask for matchLabels kt.dev/agent: sidecar: "
                      "it would inject into pods that did not ask for the agent")
        for d, lab in pods:
            # No objectSelector selects every pod.
            if dig(d, "metadata", "name") in KT_SERVERS and is_kt(d) and selects(
                    {} if sel is None else sel, lab):
                self.fail(where, "webhook-selector",
                          f"{at}: its objectSelector selects the pods of {ident(d)}: kt's own "
                          "server would wait for the webhook it serves")
        nsel = w.get("namespaceSelector")
        if not nsel:
            self.fail(where, "webhook-namespace",
                      f"{at}: no namespaceSelector: it would inject in every namespace, "
                      "kube-system included, where kt-metadata does not resolve")
            return
        name = lambda n: {"kubernetes.io/metadata.name": n}  # noqa: E731
        for other in ("kube-system", "kube-public", "kube-node-lease"):
            if selects(nsel, name(other)):
                self.fail(where, "webhook-namespace",
                          f"{at}: its namespaceSelector selects {other}")
        if ns and not selects(nsel, name(ns)):
            self.fail(where, "webhook-namespace",
                      f"{at}: its namespaceSelector does not select the install's namespace "
                      f"{ns!r}, where workloads with the agent go")
        # The names it may select: those its kubernetes.io/metadata.name
        # constraints (matchLabels, In) allow; None: any name.
        names = None
        key = "kubernetes.io/metadata.name"
        if key in (nsel.get("matchLabels") or {}):
            names = {nsel["matchLabels"][key]}
        for e in nsel.get("matchExpressions") or []:
            if e.get("key") == key and e.get("operator") == "In":
                vals = set(e.get("values") or [])
                names = vals if names is None else names & vals
        if ns and (names is None or names - {ns}):
            self.fail(where, "webhook-namespace",
                      f"{at}: its namespaceSelector selects namespaces other than {ns!r}: the "
                      "injected agent reaches kt-metadata by its short name, and kt's access map "
                      "and policies admit the install's namespace")

    def webhook_endpoint(self, where, at, d, w, ns, c, env, meta_labels, services, certs,
                         spec, docs):
        """The API server reaches kt-metadata's webhook listener through its
        Service and the NetworkPolicies, and trusts the certificate it
        serves."""
        svc_ref = dig(w, "clientConfig", "service")
        if not svc_ref:
            self.fail(where, "webhook-service", f"{at}: no clientConfig.service")
            return
        if svc_ref.get("namespace") != ns:
            self.fail(where, "webhook-service",
                      f"{at}: calls a Service in namespace {svc_ref.get('namespace')!r}, the "
                      f"install's is {ns!r}")
        if svc_ref.get("path") != "/mutate":
            self.fail(where, "webhook-service",
                      f"{at}: path {svc_ref.get('path')!r}: kt-metadata answers on /mutate")
        svc = services.get(svc_ref.get("name"))
        port = None
        if svc is None or not selects({"matchLabels": dig(svc, "spec", "selector") or {}},
                                      meta_labels):
            self.fail(where, "webhook-service",
                      f"{at}: the Service {svc_ref.get('name')} is not in the bundle or does not "
                      "select kt-metadata")
        else:
            want = svc_ref.get("port", 443)
            sp = next((p for p in dig(svc, "spec", "ports") or [] if p.get("port") == want), None)
            target = (sp or {}).get("targetPort", want)
            cp = next((p for p in c.get("ports") or []
                       if p.get("name") == target or p.get("containerPort") == target), None)
            port = (cp or {}).get("containerPort")
            listen = env.get("KT_WEBHOOK_LISTEN") or ""
            if port is None or not listen.endswith(f":{port}"):
                self.fail(where, "webhook-service",
                          f"{at}: port {want} of Service {svc_ref.get('name')} leads to "
                          f"{target!r}, which is not kt-metadata's webhook listener "
                          f"(KT_WEBHOOK_LISTEN {listen or 'unset'})")
        # TLS: cert-manager injects the CA of the Certificate it names; that
        # certificate names <service>.<namespace>.svc, and kt-metadata
        # serves its Secret.
        ref = dig(d, "metadata", "annotations", "cert-manager.io/inject-ca-from") or ""
        cns, _, cname = ref.partition("/")
        cert = certs.get((cns, cname))
        if cert is None or cns != ns:
            self.fail(where, "webhook-ca",
                      f"cert-manager.io/inject-ca-from {ref!r} names no Certificate of the bundle "
                      f"in {ns!r}: nothing puts a CA the API server trusts in the caBundle")
        else:
            host = f"{svc_ref.get('name')}.{ns}.svc"
            if host not in (dig(cert, "spec", "dnsNames") or []):
                self.fail(where, "webhook-ca",
                          f"Certificate {cname} does not name {host}, which the API server "
                          "calls: it refuses the certificate")
            for var, file in (("KT_WEBHOOK_TLS_CERT", "tls.crt"), ("KT_WEBHOOK_TLS_KEY", "tls.key")):
                p = env.get(var)
                vol, rel = mount_of(c, spec, p) if p else (None, None)
                m = mount_entry(c, p) if p else None
                secret = dig(vol or {}, "secret", "secretName")
                if secret != dig(cert, "spec", "secretName") or rel != file \
                        or not (m or {}).get("readOnly"):
                    self.fail(where, "webhook-ca",
                              f"kt-metadata's {var} ({p or 'unset'}) is not {file} of the Secret "
                              f"{dig(cert, 'spec', 'secretName')} (Certificate {cname}), mounted "
                              "read-only: it would not serve the certificate whose CA is injected")
        if port is None:
            return
        for np in docs:
            if np.get("kind") != "NetworkPolicy" or "Ingress" not in (
                    dig(np, "spec", "policyTypes") or ["Ingress"]):
                continue
            if not selects(dig(np, "spec", "podSelector") or {}, meta_labels):
                continue
            if not any(not r.get("from") and any(
                    p.get("port") in (port, next((q.get("name") for q in c.get("ports") or []
                                                   if q.get("containerPort") == port), None))
                    for p in r.get("ports") or [{"port": port}])
                       for r in dig(np, "spec", "ingress") or []):
                self.fail(f"{path_of(where)}: {ident(np)}", "webhook-network",
                          f"selects kt-metadata but admits no traffic from outside the namespace "
                          f"to its webhook port {port}: the API server (no pod of the namespace) "
                          "could not call the webhook")

    def webhook_template(self, path, c, spec, configmaps, kube_bundle, env):
        """What the injector injects: the ConfigMap's template (as
        kt-metadata reads it, with its KT_INJECT_AGENT_IMAGE) is a pod that
        passes the rules of a labelled pod of this bundle."""
        where = f"{path}: Deployment/kt-metadata"
        tpath = env.get("KT_INJECT_TEMPLATE")
        vol, rel = mount_of(c, spec, tpath) if tpath else (None, None)
        cm_name = dig(vol or {}, "configMap", "name")
        items = dig(vol or {}, "configMap", "items")
        key = next((i.get("key") for i in items if i.get("path") == rel), None) if items else rel
        text = (configmaps.get(cm_name) or {}).get(key) if cm_name and key else None
        if text is None:
            self.fail(where, "webhook-template",
                      f"KT_INJECT_TEMPLATE {tpath or 'unset'} is no key of a ConfigMap of the "
                      "bundle that kt-metadata mounts: it would not start")
            return
        # Named without the generator's hash suffix (stable in expect-policy).
        where = f"{path}: ConfigMap/{re.sub(r'-[0-9a-z]{10}$', '', cm_name)}"
        try:
            tpl = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            self.fail(where, "webhook-template", f"{key} is not YAML: {e}")
            return
        image = None
        for e in c.get("env") or []:
            if e.get("name") == "KT_INJECT_AGENT_IMAGE":
                ref = dig(e, "valueFrom", "configMapKeyRef") or {}
                image = e.get("value") or (configmaps.get(ref.get("name")) or {}).get(
                    ref.get("key"))
        pod_spec = dict(tpl.get("spec") or {})
        inits = [dict(i) for i in pod_spec.get("initContainers") or []]
        agent = next((i for i in inits if i.get("name") == AGENT), None)
        if agent is None:
            self.fail(where, "webhook-template", f"{key} has no {AGENT} init container")
            return
        image = image or agent.get("image")
        agent["image"] = image
        pod_spec["initContainers"] = inits
        if not image:
            self.fail(where, "webhook-template",
                      f"neither {key} nor KT_INJECT_AGENT_IMAGE names the agent's image")
        elif "@sha256:" not in image and not image.endswith(":" + self.version):
            self.fail(where, "version",
                      f"the injected agent's image {image} is neither pinned by digest nor "
                      f"tagged with the workspace version {self.version}")
        # The rules of a labelled pod, on the template as injected (its
        # container `workload` standing for the pod's; the pod's own
        # securityContext is the pod's affair).
        self.sidecar(where, pod_spec)
        self.service_links(where, tpl, pod_spec)
        self.volumes(where, pod_spec, False)
        self.tokens(where, pod_spec, kube_bundle)
        self.identity_order(where, tpl, pod_spec)
        self.gpus(where, pod_spec)
        self.restricted(where, {**pod_spec, "containers": []})
        if not kube_bundle:
            self.fail(where, "webhook-template",
                      "the injected agent presents the pod's ServiceAccount token "
                      "(agent-identity), which this install, without kube-identity, does not "
                      "review")
        if env.get("KT_TLS_CERT"):
            for x in containers(pod_spec):
                u = env_of(x).get("KT_METADATA_URL") or ""
                if u.startswith("http://"):
                    self.fail(where, "tls-mode",
                              f"the injected container {x.get('name')} calls {u}, but the "
                              "metadata server serves HTTPS (the tls component): the injector "
                              "supports installs without tls; list agent-tls for such workloads")

    # --- rules over a whole file -----------------------------------------

    def check_file(self, path, docs):
        stem = path.stem
        install = stem in INSTALLS and path.parent.name != "examples"
        default_install = install and stem in DEFAULT_INSTALLS
        case = path.parent.name == "cases"
        services = {dig(d, "metadata", "name"): d for d in docs if d.get("kind") == "Service"}
        configmaps = {dig(d, "metadata", "name"): d.get("data") or {}
                      for d in docs if d.get("kind") == "ConfigMap"}
        pods = []  # (doc, template labels)
        # Kube identity (kube-identity): the metadata server reviews tokens,
        # and every kt server, agent and scrape must do without the Secret.
        metas = [d for d in docs if d.get("kind") == "Deployment"
                 and dig(d, "metadata", "name") == "kt-metadata"]
        kube_bundle = any(kube_auth(c) for d in metas
                          for c in containers(dig(pod_template(d), "spec") or {}))
        meta_instance = labels(metas[0]).get(INSTANCE) if metas else None
        # The testbeds keep the static (admin) token for their workloads.
        testbed = ((install and stem in TESTBEDS) or meta_instance in TESTBED_INSTANCES
                   or (case and not metas))

        for d in docs:
            where = f"{path}: {ident(d)}"
            kind = d.get("kind")
            group = d.get("apiVersion", "").rpartition("/")[0]
            tpl = pod_template(d)
            if kind not in WORKLOAD_KINDS and (dig(d, "spec", "template", "spec") is not None
                                               or dig(d, "spec", "jobTemplate") is not None
                                               or dig(d, "spec", "shareProcessNamespace") is not None):
                self.fail(where, "kind-filter",
                          "pod-spec fields injected into an object that has no pods")
            if group in CRD_GROUPS and install:
                self.fail(where, "no-crds",
                          f"{group} needs an operator's CRDs: an install may not include it "
                          "(make it an opt-in component)")
            if kind == "CustomResourceDefinition" and (
                    dig(d, "metadata", "name") not in KT_CRDS or default_install):
                self.fail(where, "no-crds",
                          "a CRD: kt's bundles use custom resources (opt-in), but their CRDs "
                          "are the operator's to install and upgrade, never kt's (but kt's own "
                          "datasets.kt.dev, in the opt-in component datasets)")
            if tpl is not None and path.parent.name == "examples" and AGENT in {
                    c.get("name") for c in containers(tpl.get("spec") or {})}:
                ns = dig(d, "metadata", "namespace")
                if ns in (None, "", "default"):
                    self.fail(where, "workload-namespace",
                              f"a workload with the agent sidecar in namespace {ns or 'default'!r}: "
                              "kt-metadata does not resolve there, and the access map and "
                              "policies name kt's namespace (set `namespace:` in the kustomization)")
            if tpl is not None:
                spec = tpl.get("spec") or {}
                kt_pod = is_kt(d)
                self.sidecar(where, spec)
                self.service_links(where, tpl, spec)
                self.volumes(where, spec, kt_pod)
                self.emptydir_fit(where, spec)
                self.tokens(where, spec, kube_bundle)
                self.identity_order(where, tpl, spec)
                self.gpus(where, spec)
                memlock = dig(tpl, "metadata", "annotations", "kt.dev/memlock") == "node"
                self.rdma(where, spec, memlock)
                self.agent_env(where, spec)
                self.flight(where, spec, docs)
                server = kt_pod and dig(d, "metadata", "name") in KT_SERVERS
                if not testbed and not kube_bundle and not server:
                    self.static_workload(where, spec)
                self.tls(where, spec, configmaps)
                self.host_paths(where, spec, docs)
                if not case:
                    self.restricted(where, spec)
                pods.append((d, dig(tpl, "metadata", "labels") or {}))
                if kt_pod:
                    for c in spec.get("containers") or []:
                        res = c.get("resources") or {}
                        for side in ("requests", "limits"):
                            if dig(res, side, "ephemeral-storage") is None:
                                self.fail(where, "ephemeral-storage",
                                          f"container {c.get('name')} has no ephemeral-storage "
                                          f"{side[:-1]}")
                        image = c.get("image", "")
                        if "@sha256:" not in image and not image.endswith(":" + self.version):
                            self.fail(where, "version",
                                      f"image {image} is neither pinned by digest nor tagged "
                                      f"with the workspace version {self.version}")
            if kind == "StatefulSet":
                self.statefulset(where, d, services)
            if (kind in WORKLOAD_KINDS and dig(d, "metadata", "name") == "kt-store"
                    and (replicas(d) or 1) > 1):
                self.fail(where, "store-replicas",
                          f"{replicas(d)} store replicas behind one Service: each holds its "
                          "own keys, so a read lands on a store that may not have the key "
                          "(kt runs one store per install)")
            if kind in ("ServiceMonitor", "PodMonitor"):
                # The servers' scrapes and the agents' (which check tokens
                # the same way).
                eps = dig(d, "spec", "endpoints" if kind == "ServiceMonitor"
                          else "podMetricsEndpoints")
                for ep in eps or []:
                    cred = dig(ep, "authorization", "credentials") or {}
                    if not cred.get("name") or not cred.get("key"):
                        self.fail(where, "metrics-auth",
                                  f"endpoint {ep.get('port')} scrapes without a bearer token: "
                                  "/metrics answers 401")
                    elif kube_bundle and cred["name"] == TOKEN_SECRET:
                        self.fail(where, "static-token",
                                  f"endpoint {ep.get('port')} sends the {TOKEN_SECRET} Secret's "
                                  "token, which an install with kube identity does not have: "
                                  "give Prometheus a token of its own (see "
                                  "kustomize/examples/monitoring)")
                    elif not kube_bundle and cred["name"] != TOKEN_SECRET:
                        self.fail(where, "metrics-auth",
                                  f"endpoint {ep.get('port')} sends the Secret "
                                  f"{cred['name']}'s token, not the install's static token "
                                  f"({TOKEN_SECRET}): /metrics answers 401")
            if kind == "NetworkPolicy" and default_install:
                sel = dig(d, "spec", "podSelector") or {}
                names = set()
                names.update(v for k, v in (sel.get("matchLabels") or {}).items()
                             if k == "app.kubernetes.io/name")
                for e in sel.get("matchExpressions") or []:
                    if e.get("key") == "app.kubernetes.io/name" and e.get("operator") == "In":
                        names.update(e.get("values") or [])
                if not names or not names <= KT_SERVERS:
                    self.fail(where, "user-traffic",
                              "a default install's NetworkPolicy selects pods other than the "
                              "kt servers: it would close a workload's own ports (make it "
                              "opt-in)")
            if dig(tpl or {}, "spec", "nodeSelector", "nvidia.com/gpu.present") is not None:
                self.fail(where, "gpu-label",
                          "nodeSelector nvidia.com/gpu.present needs GPU feature discovery")
            if install and is_kt(d):
                self.recommended(where, d, stem)

        for d in docs:
            if d.get("kind") == "PodDisruptionBudget":
                self.pdb(f"{path}: {ident(d)}", d, pods)
        self.tls_bundle(path, docs, pods, configmaps)
        self.webhooks(path, docs, metas, pods, configmaps, kube_bundle)
        if metas:
            # One way of checking tokens per install: a verifier in the other
            # mode refuses every caller.
            for d, _ in pods:
                for c in containers(dig(pod_template(d), "spec") or {}):
                    if c.get("name") in VERIFIERS and kube_auth(c) != kube_bundle:
                        self.fail(f"{path}: {ident(d)}", "identity-mode",
                                  f"container {c.get('name')} "
                                  + ("lacks KT_KUBE_AUTH=true, which the metadata server has"
                                     if kube_bundle else
                                     "has KT_KUBE_AUTH=true, which the metadata server lacks"))
            stores = [d for d, _ in pods if d.get("kind") == "StatefulSet"
                      and dig(d, "metadata", "name") == "kt-store"]
            store_sa = (dig(pod_template(stores[0]), "spec", "serviceAccountName") or "default"
                        if stores else None)
            for d in metas:
                if any(kube_auth(c) for c in containers(dig(pod_template(d), "spec") or {})):
                    self.metadata_identity(path, docs, d, store_sa)
        self.install_labels(path, docs, install, testbed, bool(metas), meta_instance)
        self.cluster_names(path, docs, metas)
        # Every bundle that installs kt, but the base (which leaves the
        # choice to the overlays) and the testbeds (their classes are known).
        if metas and not testbed and not (install and stem == "base"):
            self.storage(path, docs)
        if install:
            self.namespace(path, docs)
            if stem == "gpu":
                for d, _ in pods:
                    if dig(d, "metadata", "name") in KT_SERVERS:
                        aff = dig(pod_template(d), "spec", "affinity", "nodeAffinity")
                        if not aff:
                            self.fail(f"{path}: {ident(d)}", "off-gpu",
                                      "a kt server has no node affinity keeping it off GPU nodes")

    def recommended(self, where, d, stem):
        lab = labels(d)
        # part-of and instance: install_labels.
        want = [k for k in RECOMMENDED if k not in ("instance", "part-of")]
        if d.get("kind") == "Namespace":
            want = [k for k in want if k != "component"]
        missing = [k for k in want if f"app.kubernetes.io/{k}" not in lab]
        if missing:
            self.fail(where, "labels", "missing recommended labels: "
                      + ", ".join(f"app.kubernetes.io/{k}" for k in missing))
        v = lab.get("app.kubernetes.io/version")
        if v is not None and v != self.version:
            self.fail(where, "version",
                      f"app.kubernetes.io/version is {v}, the workspace is {self.version}")

    def install_labels(self, path, docs, install, testbed, has_meta, meta_instance):
        """Every object of an install, and every object of kt's in a bundle
        over one, has part-of=kt and the install's instance: what the
        README's uninstall selects, and what tells two installs apart."""
        # In the bundles of this repository (installs, examples, test
        # cases), an object named like kt's is kt's; a bundle of someone
        # else's (the scenario runner's) may name its own kt-*.
        shipped = install or path.parent.name in ("examples", "cases")
        for d in docs:
            name = dig(d, "metadata", "name") or ""
            ours = install or is_kt(d) or (
                shipped and has_meta and not testbed
                and (name == "kt" or name.startswith("kt-")))
            if not ours:
                continue
            where = f"{path}: {ident(d)}"
            lab = labels(d)
            if lab.get(PART_OF) != "kt":
                self.fail(where, "install-labels",
                          f"not labelled {PART_OF}=kt: the selectors that find an install (the "
                          "README's uninstall) miss it (a component's object: label it in its "
                          "file)")
                continue
            inst = lab.get(INSTANCE)
            if not inst:
                self.fail(where, "install-labels",
                          f"no {INSTANCE}: it belongs to no install (components that add objects "
                          "list install-labels, which copies kt-metadata's)")
            elif meta_instance and inst != meta_instance:
                self.fail(where, "install-labels",
                          f"{INSTANCE} is {inst}, the install's (kt-metadata's) {meta_instance}")

    def cluster_names(self, path, docs, metas):
        """A cluster-scoped object's name ends in its install's namespace:
        there is one object of a name per cluster, and an install in another
        namespace that kept the name would take this one's over (and
        deleting either install would delete it for both)."""
        nss = [d for d in docs if d.get("kind") == "Namespace"]
        ns = (dig(nss[0], "metadata", "name") if len(nss) == 1
              else dig(metas[0], "metadata", "namespace") if metas else None)
        if not ns:
            return
        for d in docs:
            # A CRD's name is its group's: one per cluster by design.
            if d.get("kind") in CLUSTER_SCOPED and d.get("kind") not in (
                    "Namespace", "CustomResourceDefinition"):
                name = dig(d, "metadata", "name") or ""
                if (d.get("kind") == "ValidatingAdmissionPolicyBinding"
                        and name.startswith(SA_POLICY + "-")):
                    got = dig(d, "spec", "matchResources", "namespaceSelector")
                    want = {"matchExpressions": [{"key": "kubernetes.io/metadata.name",
                                                  "operator": "In", "values": [ns]}]}
                    if got != want:
                        self.fail(f"{path}: {ident(d)}", "sa-policy-namespace",
                                  f"binds kt's ServiceAccount policy to {got}, not to the "
                                  f"install's namespace {ns} alone: kt's ServiceAccounts there "
                                  "are anyone's to run pods as (rename it with the names)")
                if not name.endswith("-" + ns):
                    self.fail(f"{path}: {ident(d)}", "cluster-name",
                              f"cluster-scoped, but its name does not end in -{ns} (the "
                              "install's namespace): an install in another namespace would "
                              "share it (apply moves it to that install, delete removes it "
                              "from both); name it <name>-<namespace> (the overlays' "
                              "`replacements:` do)")

    def storage(self, path, docs):
        """Every claim of kt's names its StorageClass, or says that the
        cluster's default is meant: without a default class (EKS since 1.30,
        many bare-metal clusters) a claim with neither stays Pending."""
        claims = []
        for d in docs:
            if not is_kt(d):
                continue
            if d.get("kind") == "PersistentVolumeClaim":
                claims.append((f"{path}: {ident(d)}", d))
            elif d.get("kind") == "StatefulSet":
                for t in dig(d, "spec", "volumeClaimTemplates") or []:
                    claims.append((f"{path}: {ident(d)}", t))
        for where, c in claims:
            at = f"claim {dig(c, 'metadata', 'name')}"
            cls = dig(c, "spec", "storageClassName")
            mark = dig(c, "metadata", "annotations", STORAGE_MARKER)
            if mark is not None and mark != STORAGE_DEFAULT:
                self.fail(where, "storage-class",
                          f"{at}: {STORAGE_MARKER}: {mark!r} is not {STORAGE_DEFAULT!r}")
            if cls == "":
                self.fail(where, "storage-class",
                          f"{at}: storageClassName \"\" is no class at all: the claim binds only "
                          "a PersistentVolume created by hand, never a provisioned one")
            elif cls is None and mark != STORAGE_DEFAULT:
                self.fail(where, "storage-class",
                          f"{at} names no storageClassName and lacks {STORAGE_MARKER}: "
                          f"{STORAGE_DEFAULT}: choose (a cluster without a default StorageClass "
                          "leaves it Pending)")

    def statefulset(self, where, d, services):
        name = dig(d, "spec", "serviceName")
        svc = services.get(name)
        if name and svc is not None:
            if dig(svc, "spec", "clusterIP") != "None":
                self.fail(where, "headless",
                          f"serviceName {name} is not a headless Service (clusterIP: None)")
        elif name and is_kt(d):
            self.fail(where, "headless", f"serviceName {name} is not in the bundle")
        for t in dig(d, "spec", "volumeClaimTemplates") or []:
            bad = sorted(TRANSFORMED & set(dig(t, "metadata", "labels") or {}))
            if bad:
                self.fail(where, "immutable-vct",
                          f"volumeClaimTemplate {dig(t, 'metadata', 'name')} carries "
                          f"{', '.join(bad)}: a StatefulSet's claim templates cannot change, "
                          "so the next change of those labels fails `kubectl apply`")

    def pdb(self, where, d, pods):
        sel = dig(d, "spec", "selector")
        for w, lab in pods:
            if not selects(sel, lab):
                continue
            n = replicas(w)
            if n is None:
                continue
            mu, ma = dig(d, "spec", "maxUnavailable"), dig(d, "spec", "minAvailable")
            blocks = (mu in (0, "0", "0%")) or (ma is not None and (
                ma == "100%" or (isinstance(ma, int) and ma >= n)))
            if blocks:
                self.fail(where, "drain",
                          f"allows no voluntary disruption of {ident(w)} ({n} replica(s)): "
                          "every node drain would block on it")

    def namespace(self, path, docs):
        nss = [d for d in docs if d.get("kind") == "Namespace"]
        if len(nss) != 1:
            self.fail(str(path), "namespace", f"{len(nss)} Namespace objects, expected one")
            return
        ns = nss[0]
        if labels(ns).get("pod-security.kubernetes.io/enforce") != "restricted":
            self.fail(f"{path}: {ident(ns)}", "pod-security",
                      "no pod-security.kubernetes.io/enforce: restricted")
        name = dig(ns, "metadata", "name")
        if path.stem == "base":
            return
        for d in docs:
            if d.get("kind") in CLUSTER_SCOPED:
                continue
            got = dig(d, "metadata", "namespace")
            if got != name:
                self.fail(f"{path}: {ident(d)}", "namespace",
                          f"in namespace {got!r}, not the install's {name!r}")


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", required=True)
    ap.add_argument("files", nargs="+", type=pathlib.Path)
    args = ap.parse_args(argv)
    c = Checker(args.version)
    for f in args.files:
        docs = [d for d in yaml.safe_load_all(f.read_text()) if d]
        start = len(c.errors)
        c.check_file(f, docs)
        c.expect(f, start)
    for e in c.report():
        print(e, file=sys.stderr)
    print(f"policy.py: {len(args.files)} file(s), {len(c.errors)} violation(s)")
    return 1 if c.errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

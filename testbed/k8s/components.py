"""Generates the kustomization.yaml of the components that inject into
users' workloads: agent-sidecar, agent-identity, agent-tls, flight, gpu and
gpu-dra, and the admission webhook's injection template
(sidecar-injector's template.yaml and agent-image.env) (`make manifests`
runs it; `make manifests-check` fails when the committed files differ).

Why generated: kustomize can only select a workload by kind, and a
replacement or patch that names no kind also hits a labelled Service or
ConfigMap (creating pod-spec fields there, which fails the render or the
apply). So every injected field is copied once per workload kind, each with
its own path to the pod spec (a CronJob's is under jobTemplate): about a
hundred near-identical entries that nobody should write or review by hand.
What is injected lives in the components' template files (sidecar.yaml,
identity.yaml, tls.yaml, gpu.yaml, gpu-dra.yaml); this script only says
where each piece goes. gpu-rdma's template (gpu-rdma.yaml) is generated
too: its env entries are the agent's NCCL allow-list, read from
components/kt-tensor/src/cuda/netenv.rs (WORKLOAD_NCCL_ENV), so the
manifests and the agent cannot disagree.

The webhook (sidecar-injector) injects what agent-sidecar then
agent-identity inject, from no definition of its own: its template is
kustomize's rendering of those two components over a placeholder workload
(see injector_template), so both paths give a pod the same agent. That
needs kustomize: `kubectl kustomize`, or $KUSTOMIZE as render.sh takes it
(the committed files come from the pinned version, KUSTOMIZE_VERSION).

usage: python3 testbed/k8s/components.py [--check]   (stdlib only)
"""

import os
import pathlib
import shlex
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMPONENTS = ROOT / "kustomize" / "components"
ME = "testbed/k8s/components.py"

# Every workload kind a labelled object may be, and where its pod spec is.
KINDS = [
    ("apps", "Deployment", "spec.template.spec"),
    ("apps", "StatefulSet", "spec.template.spec"),
    ("apps", "DaemonSet", "spec.template.spec"),
    ("batch", "Job", "spec.template.spec"),
    ("batch", "CronJob", "spec.jobTemplate.spec.template.spec"),
]
SELECTOR = "kt.dev/agent=sidecar"


def replacement(template, source, target, comment, create=True, of="spec"):
    """A replacement copying `source` (a field path of the template) into
    `target` (a path below the pod spec, or with of="metadata" below the
    pod template's metadata) of every labelled workload kind, creating what
    is missing (create=False: a target without the field fails the
    build)."""
    out = [("  # " + line).rstrip() for line in comment.strip("\n").splitlines()]
    out += ["  - source:", "      kind: Deployment",
            f"      name: {template}", f"      fieldPath: {source}", "    targets:"]
    for group, kind, pod in KINDS:
        base = pod if of == "spec" else pod[:-len(".spec")] + "." + of
        out += [
            "      - select:",
            f"          group: {group}",
            f"          kind: {kind}",
            f"          labelSelector: {SELECTOR}",
            "        fieldPaths:",
            f"          - {base}.{target}",
        ]
        if create:
            out += ["        options:", "          create: true"]
    return out


# The agent sidecar, below the pod spec.
AGENT = "initContainers.[name=kt-agent]"
AGENT_RESTART = f"{AGENT}.restartPolicy"


def require_agent(template, component):
    """The first replacement of a component that edits agent-sidecar's
    agent: it copies the template's restartPolicy (Always) onto the agent
    WITHOUT creating it, so a labelled workload that has no agent yet (the
    component listed before agent-sidecar in one kustomization) fails the
    build. Otherwise the component's own replacements would create a
    placeholder `kt-agent` that agent-sidecar then replaces whole, silently
    undoing them (the static token instead of the pod's identity, no GPU
    image, http:// URLs)."""
    return replacement(
        template, f"spec.template.spec.{AGENT_RESTART}", AGENT_RESTART,
        f"""First: the agent must be there already (agent-sidecar listed before
{component}). Not created: listed before agent-sidecar, {component}
fails the build with `unable to find field
"...initContainers.[name=kt-agent].restartPolicy" in replacement target`
instead of editing a placeholder that agent-sidecar would replace.""",
        create=False)


def json_patches(path_in_pod, value):
    """One JSON patch per workload kind adding `path_in_pod` (below the pod
    spec) with `value`: for booleans, which a replacement into a missing
    field would turn into strings."""
    out = []
    for group, kind, pod in KINDS:
        ptr = "/" + pod.replace(".", "/") + "/" + path_in_pod
        out += [
            "  - target:",
            f"      group: {group}",
            f"      kind: {kind}",
            f"      labelSelector: {SELECTOR}",
            "    patch: |-",
            "      - op: add",
            f"        path: {ptr}",
            f"        value: {value}",
        ]
    return out


def drop_template(name):
    """The component's last transformer: its template never reaches the
    output."""
    return [
        "transformers:",
        "  - |-",
        "    apiVersion: builtin",
        "    kind: PatchTransformer",
        "    metadata:",
        f"      name: {name}-drop",
        "    target:",
        "      kind: Deployment",
        f"      name: {name}",
        "    patch: |-",
        "      $patch: delete",
        "      apiVersion: apps/v1",
        "      kind: Deployment",
        "      metadata:",
        f"        name: {name}",
    ]


def agent_component(template, template_file, doc, component, body):
    """The kustomization of a component that edits agent-sidecar's agent:
    its head, the check that the agent is there already (require_agent),
    `body` (its replacements, and patches after them), and the template's
    drop."""
    lines = component_head(template_file, doc)
    lines += require_agent(template, component)
    lines += body
    lines += drop_template(template)
    return "\n".join(lines) + "\n"


def pod_field(template, path, comment, of="spec"):
    """The replacement copying the template's `path` (below its pod spec,
    or with of="metadata" below its pod template's metadata) to the same
    path of every labelled workload kind."""
    return replacement(template, f"spec.template.{of}.{path}", path, comment, of=of)


def comment_block(text):
    return [("# " + line).rstrip() for line in text.strip("\n").splitlines()]


def component_head(template_file, doc):
    """The start of a component's kustomization: whence it comes, what it
    does, and its template as its one resource."""
    return [
        f"# Generated by {ME} from {template_file}; do not edit (make manifests).",
        "#",
    ] + comment_block(doc) + [
        "apiVersion: kustomize.config.k8s.io/v1alpha1",
        "kind: Component",
        "resources:",
        f"  - {template_file}",
        "replacements:",
    ]


KINDS_TEXT = ", ".join(k for _, k, _ in KINDS[:-1]) + " and " + KINDS[-1][1]

SIDECAR_DOC = f"""
Injects the kt node agent into every {KINDS_TEXT} labelled
`kt.dev/agent: sidecar` (on the workload's own metadata), in the
kustomization that lists this component. Its pods should carry
`kt.dev/service: <service>` (the agent announces it; KT_SERVICE).
Anything else may carry the label too (a Service, a ConfigMap): only the
kinds above are touched.

The agent is a native sidecar (an init container with restartPolicy
Always, Kubernetes >= 1.29) that the workload's containers wait for; the
workload's first container gets the agent's environment and volumes. See
sidecar.yaml for the whole contract. The component emits no resource of
its own, and each replacement is keyed by name, so it may be listed at
several levels (an overlay and a kustomization over it) and still injects
one agent.
"""

SIDECAR_TEMPLATE = "kt-agent-sidecar-template"
SIDECAR_VOLUMES = ["kt-run", "kt-data", "kt-token", "kt-agent-state", "kt-agent-tmp", "kt-shm"]
WORKLOAD_ENV = ["KT_AGENT_SOCKET", "KT_METADATA_URL", "KT_TOKEN_FILE", "KT_POD_IP",
                "KT_AGENT_AUTOSTART"]
WORKLOAD_MOUNTS = ["kt-run", "kt-data", "kt-token", "kt-shm"]


def agent_sidecar():
    t = SIDECAR_TEMPLATE
    lines = component_head("sidecar.yaml", SIDECAR_DOC)
    for v in SIDECAR_VOLUMES:
        lines += pod_field(t, f"volumes.[name={v}]", f"Pod volume {v}.")
    lines += pod_field(t, AGENT,
                       "The agent: a native sidecar, after the workload's own init containers.")
    for e in WORKLOAD_ENV:
        lines += replacement(t, f"spec.template.spec.containers.[name=workload].env.[name={e}]",
                             f"containers.0.env.[name={e}]",
                             f"The workload's first container: {e}.")
    for m in WORKLOAD_MOUNTS:
        lines += replacement(t,
                             f"spec.template.spec.containers.[name=workload].volumeMounts.[name={m}]",
                             f"containers.0.volumeMounts.[name={m}]",
                             f"The workload's first container: mount of {m}.")
    lines += [
        "# One pid namespace for the pod: the agent ties tensor registrations to the",
        "# processes that made them (see sidecar.yaml).",
        "patches:",
    ] + json_patches("shareProcessNamespace", "true")
    lines += [
        "# No service links: a Service named kt-relay, kt-tensor or kt-node-cache would",
        "# set KT_RELAY_PORT=tcp://... (see sidecar.yaml).",
    ] + json_patches("enableServiceLinks", "false")
    lines += ["# Runs after the replacements: the template never reaches the output."]
    lines += drop_template(t)
    return "\n".join(lines) + "\n"


GPU_DOC = f"""
GPU pods for workloads with the kt agent (labelled `kt.dev/agent:
sidecar`; the same kinds as agent-sidecar: {KINDS_TEXT}):
a toleration of the nvidia.com/gpu taint and, for the agent sidecar, the
image with NCCL (kt-agent-gpu; see gpu.yaml). List it AFTER agent-sidecar
(and agent-identity): listed before it, the build fails.
The workload's own container still requests its GPUs (resources.limits
nvidia.com/gpu, or a DRA claim), which is what puts the pod on a GPU node:
no node selector is added (GPU feature discovery's labels are not assumed).
The agent gets GPUs only as Kubernetes allocates them, never by
NVIDIA_VISIBLE_DEVICES (which would bypass the allocation and show it every
GPU of the node): with the device plugin alone it sees none (a GPU is
allocated to one container), so CUDA tensors are not moved by kt there;
with DRA, the component gpu-dra gives it the workload's claim.
No runtimeClassName: where the NVIDIA runtime is not the node's default
(k3s, a GPU Operator install told not to make it the default) add
`runtimeClassName: nvidia` with a patch of your own; GKE has no such
RuntimeClass and needs none. Like agent-sidecar it emits no resource, so
it may be listed at several levels of one build.
"""

GPU_TEMPLATE = "kt-gpu-template"


def gpu():
    t = GPU_TEMPLATE
    body = pod_field(t, "tolerations.[key=nvidia.com/gpu]", "GPU nodes' taint.")
    body += pod_field(t, f"{AGENT}.image",
                      "The agent sidecar: the image with NCCL.")
    for e in ["NVIDIA_DRIVER_CAPABILITIES"]:
        body += pod_field(t, f"{AGENT}.env.[name={e}]", f"The agent sidecar: {e}.")
    return agent_component(t, "gpu.yaml", GPU_DOC, "gpu", body)


GPU_DRA_DOC = f"""
GPUs shared by the workload and its agent through Dynamic Resource
Allocation (resource.k8s.io; Kubernetes >= 1.34 and a DRA driver for the
GPUs, e.g. NVIDIA's): the pods of every {KINDS_TEXT}
labelled `kt.dev/agent: sidecar` get the claim `gpu`, made from YOUR
ResourceClaimTemplate `kt-gpu` (see gpu-dra.yaml), and both the agent
sidecar and the workload's first container use it, so the agent sees
exactly the workload's GPUs and opens its CUDA memory (IPC). The device
plugin cannot do that: it gives a GPU to one container only. Drop the
workload's nvidia.com/gpu limit: the claim is its GPUs.
List it AFTER agent-sidecar and gpu (listed before agent-sidecar, the
build fails), and again wherever agent-sidecar is listed again. Like
agent-sidecar it emits no resource, so it may be listed at several levels
of one build.
"""

GPU_DRA_TEMPLATE = "kt-gpu-dra-template"


def gpu_dra():
    t = GPU_DRA_TEMPLATE
    body = pod_field(t, "resourceClaims.[name=gpu]",
                     "The pod's claim `gpu`, from the ResourceClaimTemplate kt-gpu.")
    body += pod_field(t, f"{AGENT}.resources.claims.[name=gpu]",
                      "The agent sidecar: the claim's GPUs.")
    body += replacement(
        t, "spec.template.spec.containers.[name=workload].resources.claims.[name=gpu]",
        "containers.0.resources.claims.[name=gpu]",
        "The workload's first container: the same GPUs.")
    return agent_component(t, "gpu-dra.yaml", GPU_DRA_DOC, "gpu-dra", body)


GPU_RDMA_DOC = f"""
NCCL over InfiniBand/RoCE for the agents of every {KINDS_TEXT}
labelled `kt.dev/agent: sidecar`: the agent sidecar gets one HCA (the
extended resource rdma/rdma_shared_device_a: rename it to YOUR RDMA device
plugin's), IPC_LOCK (ibverbs registration; the kernel then ignores the
memlock limit, which Kubernetes cannot set), 2Gi of memory, and the
workload's NCCL settings: one env entry per allow-listed key of the
optional ConfigMap kt-nccl, never the whole ConfigMap (see gpu-rdma.yaml
and the README's GPU section). IPC_LOCK needs the namespace at Pod
Security `privileged`, which then admits ANY pod there (privileged,
hostPath, hostPID): give such workloads a namespace of their own, or drop
IPC_LOCK and raise the nodes' memlock limit instead (see gpu-rdma.yaml).
List it AFTER agent-sidecar and gpu (listed before agent-sidecar, the
build fails). Like agent-sidecar it emits no resource, so it may be listed
at several levels of one build.
"""

GPU_RDMA_TEMPLATE = "kt-gpu-rdma-template"
RDMA_RESOURCE = "rdma/rdma_shared_device_a"
NCCL_CONFIGMAP = "kt-nccl"
NETENV = ROOT / "components" / "kt-tensor" / "src" / "cuda" / "netenv.rs"


def workload_nccl_env():
    """The `NCCL_*` settings the agent honours: netenv.rs's
    WORKLOAD_NCCL_ENV, read from there (the one list; the agent drops the
    rest at its start), so gpu-rdma passes exactly those keys of kt-nccl."""
    text = NETENV.read_text()
    start = text.find("pub const WORKLOAD_NCCL_ENV: &[&str] = &[")
    end = text.find("];", start)
    if start < 0 or end < 0:
        sys.exit(f"components.py: no WORKLOAD_NCCL_ENV list in {NETENV.relative_to(ROOT)}")
    body = text[text.index("[", text.index("=", start)) + 1:end]
    names = [n.strip().strip(",").strip('"') for n in body.split("\n")]
    names = [n for n in names if n]
    if not names or any(not n.startswith("NCCL_") or not n.replace("_", "").isalnum()
                        for n in names):
        sys.exit(f"components.py: WORKLOAD_NCCL_ENV in {NETENV.relative_to(ROOT)} is not a "
                 f"plain list of NCCL_* strings: {names}")
    return names


GPU_RDMA_TEMPLATE_DOC = """
Source of the gpu-rdma component's replacements (deleted by its last
transformer; never in the output). What a labelled workload's agent
sidecar gets on top of agent-sidecar and gpu (and gpu-dra, which gives it
the GPUs) for NCCL over InfiniBand/RoCE between nodes:
- the HCA: one `rdma/rdma_shared_device_a`, the extended resource of the
  NVIDIA Network Operator's RDMA shared device plugin. YOUR cluster names
  its own: patch the key (resources.limits and requests of kt-agent) to
  the resource your RDMA device plugin advertises. Without an HCA in the
  container NCCL silently falls back to TCP sockets;
- IPC_LOCK (the only capability added; every other stays dropped):
  ibverbs pins NCCL's buffers, and with CAP_IPC_LOCK the kernel does not
  hold the registration to RLIMIT_MEMLOCK. Kubernetes has no memlock
  field; the capability makes one unnecessary. The cost: Pod Security
  admits IPC_LOCK only at `privileged`, and a namespace labelled so admits
  EVERY pod in it (privileged containers, hostPath, hostPID, any
  capability), not just this one capability. Run such workloads in a
  namespace of their own. The alternative, no capability at all: raise
  the memlock limit of the nodes' container runtime (containerd's systemd
  unit `LimitMEMLOCK=infinity`, then restart containerd; containers
  inherit it), keep the namespace at `restricted`, and remove the
  capability with a patch of your own, annotating the pod template
  `kt.dev/memlock: node` so that policy.py's rdma-grants rule knows the
  limit is the node's (README, GPU section);
- 2Gi of memory for the agent instead of 512Mi: a CUDA context, NCCL's
  pinned and per-peer proxy buffers (the pod's /dev/shm, kt-shm, is
  memory-backed already: size the pod's memory for it);
- the workload's NCCL settings from the optional ConfigMap `kt-nccl`,
  which YOU create in the namespace: one env entry per key the agent
  honours (netenv.rs's WORKLOAD_NCCL_ENV, listed below), each optional.
  Never `envFrom`: the whole ConfigMap would let whoever edits it set
  LD_PRELOAD, KT_* or OTEL_* in the agent. The agent still checks the
  values at its start (NCCL_NET_PLUGIN only a bare plugin name; README,
  GPU section).
"""


def gpu_rdma_template():
    """gpu-rdma.yaml: the template the replacements copy from."""
    env = []
    for k in workload_nccl_env():
        env += [f"            - name: {k}",
                "              valueFrom:",
                "                configMapKeyRef:",
                f"                  name: {NCCL_CONFIGMAP}",
                f"                  key: {k}",
                "                  optional: true"]
    lines = [f"# Generated by {ME}; do not edit (make manifests).", "#"]
    lines += comment_block(GPU_RDMA_TEMPLATE_DOC) + f"""apiVersion: apps/v1
kind: Deployment
metadata:
  name: {GPU_RDMA_TEMPLATE}
  annotations:
    config.kubernetes.io/local-config: "true"
spec:
  selector:
    matchLabels:
      kt.dev/template: gpu-rdma
  template:
    metadata:
      labels:
        kt.dev/template: gpu-rdma
    spec:
      initContainers:
        - name: kt-agent
          # Required, not copied: listed before agent-sidecar, the build
          # fails (see the component's first replacement).
          restartPolicy: Always
          env:""".splitlines() + env + f"""          resources:
            requests:
              {RDMA_RESOURCE}: "1"
            limits:
              memory: 2Gi
              {RDMA_RESOURCE}: "1"
          securityContext:
            capabilities:
              add:
                - IPC_LOCK
      containers:
        # Stands for the workload's first container: nothing is added to it.
        - name: workload
          image: workload""".splitlines()
    return "\n".join(lines) + "\n"


def gpu_rdma():
    t = GPU_RDMA_TEMPLATE
    body = []
    for side in ("requests", "limits"):
        body += pod_field(t, f"{AGENT}.resources.{side}.{RDMA_RESOURCE}",
                          f"The agent sidecar: one HCA ({side}).")
    body += pod_field(t, f"{AGENT}.resources.limits.memory",
                      "The agent sidecar: room for a CUDA context and NCCL's buffers.")
    body += pod_field(t, f"{AGENT}.securityContext.capabilities.add",
                      "The agent sidecar: IPC_LOCK (ibverbs registration), alone.")
    for k in workload_nccl_env():
        body += pod_field(t, f"{AGENT}.env.[name={k}]",
                          f"The agent sidecar: {k} from the ConfigMap {NCCL_CONFIGMAP}, if set.")
    return agent_component(t, "gpu-rdma.yaml", GPU_RDMA_DOC, "gpu-rdma", body)


IDENTITY_DOC = f"""
For installs with kube-identity (the production and gpu overlays): the
agents of every {KINDS_TEXT}
labelled `kt.dev/agent: sidecar` (the kinds agent-sidecar injects into)
present their pod's ServiceAccount token instead of the static kt-token
Secret, which such an install does not have: the pod volume `kt-token`
becomes a projected ServiceAccount token (audience kt, one hour, renewed
by the kubelet), and the agent gets KT_KUBE_AUTH=true (it asks the
metadata server who a caller's token is).
kt's access map (kube-identity's access.yaml) says what the pod's
ServiceAccount may do; see identity.yaml.
The pod template gets the annotation `kt.dev/identity: serviceaccount`,
which nothing resets: testbed/k8s/policy.py (rule identity-order) refuses
a pod so marked whose agent lost KT_KUBE_AUTH or the projected token.
List it AFTER agent-sidecar (listed before it, the build fails), and again
wherever agent-sidecar is listed again (a later agent-sidecar puts the
Secret volume back). Like agent-sidecar it emits no resource, so it may be
listed at several levels of one build. Leave it out over the testbeds
that keep the static token (kind, k3d).
"""

IDENTITY_TEMPLATE = "kt-agent-identity-template"


def agent_identity():
    t = IDENTITY_TEMPLATE
    body = pod_field(t, "annotations.[kt.dev/identity]",
                     "The pod template: which token its kt uses (policy.py checks it).",
                     of="metadata")
    body += pod_field(t, "volumes.[name=kt-token]",
                      "Pod volume kt-token: the pod's projected ServiceAccount token.")
    body += pod_field(t, f"{AGENT}.env.[name=KT_KUBE_AUTH]",
                      "The agent sidecar: KT_KUBE_AUTH.")
    return agent_component(t, "identity.yaml", IDENTITY_DOC, "agent-identity", body)


TLS_DOC = f"""
For installs with the tls component (see kustomize/examples/tls): the kt
clients in the pods of every {KINDS_TEXT}
labelled `kt.dev/agent: sidecar` (the kinds agent-sidecar injects into)
speak https:// to the metadata server and the store, which then refuse
plain HTTP. The agent and the workload's first container get KT_CA_FILE
(the CA they trust) and an https:// KT_METADATA_URL, and mount the pod
volume `kt-tls` (cert-manager's csi-driver, which must be installed;
Issuer kt-ca of the pod's namespace) at /etc/kt/tls, for its ca.crt.
Nothing in the pod serves TLS: no KT_TLS_CERT or KT_TLS_KEY, so the agent
(8090) and the broadcast relays of `kt get --broadcast` serve plain HTTP,
and the agent's probes stay HTTP. Peers reach them at their pod IP, which
the csi-driver cannot put in a certificate, so agent-to-agent and relay
traffic (peer-to-peer gets, broadcast trees; tensor traffic, raw TCP or
NCCL, has no TLS anyway) stays plaintext on the pod network until kt
verifies agent certificates by pod name: restrict it meanwhile with a
NetworkPolicy (the agent-networkpolicy component). See tls.yaml.
List it AFTER agent-sidecar (listed before it, the build fails), and
again wherever agent-sidecar is listed again (a later agent-sidecar
replaces the agent and puts the http:// URLs back).
Like agent-sidecar it emits no resource, so it may be listed at several
levels of one build. Leave it out over installs without the tls component.
"""

TLS_TEMPLATE = "kt-agent-tls-template"
# No KT_TLS_CERT/KT_TLS_KEY, no HTTPS probes: the pod's kt serves plain
# HTTP (see TLS_DOC).
TLS_ENV = ["KT_METADATA_URL", "KT_CA_FILE"]


def agent_volume_and_env(template, volume, volume_doc, env):
    """Replacements of a pod volume and of the agent sidecar's `env` entries."""
    lines = pod_field(template, f"volumes.[name={volume}]", volume_doc)
    for e in env:
        lines += pod_field(template, f"{AGENT}.env.[name={e}]", f"The agent sidecar: {e}.")
    return lines


def agent_mount(template, volume):
    """The replacement of the agent sidecar's mount of `volume`."""
    return pod_field(template, f"{AGENT}.volumeMounts.[name={volume}]",
                     f"The agent sidecar: mount of {volume}.")


def agent_tls():
    t = TLS_TEMPLATE
    workload = "spec.template.spec.containers.[name=workload]"
    body = agent_volume_and_env(
        t, "kt-tls", "Pod volume kt-tls: the CA's certificate (ca.crt), from the csi-driver.", TLS_ENV)
    body += agent_mount(t, "kt-tls")
    for e in TLS_ENV:
        body += replacement(t, f"{workload}.env.[name={e}]",
                            f"containers.0.env.[name={e}]",
                            f"The workload's first container: {e}.")
    body += replacement(t, f"{workload}.volumeMounts.[name=kt-tls]",
                        "containers.0.volumeMounts.[name=kt-tls]",
                        "The workload's first container: mount of kt-tls.")
    return agent_component(t, "tls.yaml", TLS_DOC, "agent-tls", body)


FLIGHT_DOC = f"""
For agents built with Arrow Flight (the cargo feature `flight`; the
README's Flight section): the agent sidecar of every {KINDS_TEXT}
labelled `kt.dev/agent: sidecar` serves Flight DoGet on its pod's port
8815 (named `flight`), fetching into a volume of its own, `kt-flight`
(an emptyDir whose sizeLimit is KT_FLIGHT_BUDGET times
KT_FLIGHT_MAX_CALLS: 1GiB x 4), never the agent's 256Mi state volume,
which a call would outgrow (the kubelet then evicts the pod). The agent
refuses to start when that volume holds less. Change the three together
(policy.py's flight-scratch rule checks them). The agent's memory limit
becomes 1792Mi: 512Mi plus 320Mi per call (flight.rs's CALL_MEMORY) times
KT_FLIGHT_MAX_CALLS (policy.py's flight-memory rule checks it). See
flight.yaml.
List it AFTER agent-sidecar (listed before it, the build fails), and
after agent-networkpolicy where that is in the same build: it adds the
port to that NetworkPolicy (from the namespace's pods only). Callers' kt
tokens cross the network on every call: an agent given KT_TLS_CERT and
KT_TLS_KEY serves Flight over TLS only (ALPN h2; clients use grpc+tls://
and trust its CA; its HTTP port turns HTTPS too). agent-tls gives it no
certificate, so without one keep that policy.
"""

FLIGHT_TEMPLATE = "kt-agent-flight-template"
FLIGHT_ENV = ["KT_FLIGHT_ADDR", "KT_FLIGHT_DIR", "KT_FLIGHT_BUDGET", "KT_FLIGHT_MAX_CALLS",
              "KT_FLIGHT_MAX_CALLS_PER_TOKEN"]
FLIGHT_PORT = 8815


def flight():
    t = FLIGHT_TEMPLATE
    body = agent_volume_and_env(
        t, "kt-flight", "Pod volume kt-flight: what Flight calls fetch ahead (budget x calls).",
        FLIGHT_ENV)
    body += pod_field(t, f"{AGENT}.ports.[name=flight]", "The agent sidecar: the Flight port.")
    body += pod_field(t, f"{AGENT}.resources.limits.memory",
                      "The agent sidecar: memory for its Flight calls (CALL_MEMORY x calls).")
    body += agent_mount(t, "kt-flight")
    body += [
        "patches:",
        "  # agent-networkpolicy's NetworkPolicy, when listed before this in the",
        "  # same build: the Flight port too (nothing happens without it).",
        "  - target:",
        "      group: networking.k8s.io",
        "      kind: NetworkPolicy",
        "      name: kt-agent",
        "    patch: |-",
        "      - op: add",
        "        path: /spec/ingress/0/ports/-",
        f"        value: {{port: {FLIGHT_PORT}, protocol: TCP}}",
    ]
    return agent_component(t, "flight.yaml", FLIGHT_DOC, "flight", body)


INJECTOR = COMPONENTS / "sidecar-injector"
INJECTOR_TEMPLATE = "kt-sidecar-injector-template"
# The placeholder workload of the template: labelled for the components,
# with one container (`workload`, standing for the pod's) and nothing else,
# so everything its pod template has is what they inject.
INJECTOR_WORKLOAD = f"""apiVersion: apps/v1
kind: Deployment
metadata:
  name: {INJECTOR_TEMPLATE}
  labels:
    kt.dev/agent: sidecar
spec:
  template:
    spec:
      containers:
        - name: workload
"""
AGENT_IMAGE_LINE = "    image: "


def kustomize_build(path):
    """kustomize's rendering of the kustomization at `path` (as render.sh
    runs it)."""
    env = os.environ.get("KUSTOMIZE")
    cmd = (shlex.split(env) if env else ["kubectl", "kustomize"]) + [str(path)]
    try:
        out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    except FileNotFoundError:
        sys.exit("components.py: kubectl not found (the injector's template is rendered with its "
                 "built-in kustomize): install kubectl, or set KUSTOMIZE='kustomize build'")
    except subprocess.CalledProcessError as e:
        sys.exit(f"components.py: rendering the injector's template failed:\n{e.stderr}")
    return out.stdout


def injector_rendered():
    """agent-sidecar then agent-identity over the placeholder workload, as
    kustomize renders them (the order users list them in)."""
    with tempfile.TemporaryDirectory() as tmp:
        rel = lambda c: os.path.relpath(COMPONENTS / c, tmp)  # noqa: E731
        pathlib.Path(tmp, "workload.yaml").write_text(INJECTOR_WORKLOAD)
        pathlib.Path(tmp, "kustomization.yaml").write_text(
            "apiVersion: kustomize.config.k8s.io/v1beta1\n"
            "kind: Kustomization\n"
            "resources:\n  - workload.yaml\n"
            f"components:\n  - {rel('agent-sidecar')}\n  - {rel('agent-identity')}\n")
        return kustomize_build(tmp)


INJECTOR_DOC = """
The pod template that agent-sidecar, then agent-identity, make of a
workload with one container (`workload`), as kustomize renders them: what
the sidecar-injector webhook (kt-metadata's --inject-template) adds to a
pod labelled `kt.dev/agent: sidecar`. Its annotations, its init container
kt-agent (after the pod's own), its volumes, shareProcessNamespace and
enableServiceLinks go to the pod; the env and volumeMounts of `workload`
to the pod's first container (or the one the annotation
kubectl.kubernetes.io/default-container names); whatever the pod already
has of the same name is kept. The agent's image is not here but in
agent-image.env (the ConfigMap's key agent-image,
KT_INJECT_AGENT_IMAGE), where an `images:` entry for kt-agent pins it like
every other image (see kustomizeconfig.yaml). The sources are
agent-sidecar's sidecar.yaml and agent-identity's identity.yaml; change
them, not this.
"""


def injector_files():
    """template.yaml (the pod template of the rendering, without the agent's
    image) and agent-image.env (that image)."""
    text = injector_rendered()
    lines = text.splitlines()
    # kustomize sorts keys: the pod template is the last key of the last
    # key (spec.template), indented by four.
    starts = [i for i, line in enumerate(lines) if line == "  template:"]
    if len(starts) != 1 or any(line and not line.startswith("    ")
                               for line in lines[starts[0] + 1:]):
        sys.exit("components.py: the injector's template is not a Deployment whose last field "
                 f"is spec.template:\n{text}")
    pod = [line[4:] for line in lines[starts[0] + 1:]]
    images = [i for i, line in enumerate(pod) if line.startswith(AGENT_IMAGE_LINE)]
    if len(images) != 1:
        sys.exit("components.py: the injector's template has not exactly one image (the "
                 f"agent's):\n{text}")
    image = pod.pop(images[0])[len(AGENT_IMAGE_LINE):]
    head = [f"# Generated by {ME}; do not edit (make manifests).", "#"]
    template = "\n".join(head + comment_block(INJECTOR_DOC) + pod) + "\n"
    env = "\n".join(head[:1] + [
        "# The agent image of the injected sidecar (the image of sidecar.yaml's kt-agent).",
        f"agent-image={image}"]) + "\n"
    return {INJECTOR / "template.yaml": template, INJECTOR / "agent-image.env": env}


FILES = {
    COMPONENTS / "agent-sidecar" / "kustomization.yaml": agent_sidecar,
    COMPONENTS / "agent-identity" / "kustomization.yaml": agent_identity,
    COMPONENTS / "agent-tls" / "kustomization.yaml": agent_tls,
    COMPONENTS / "gpu" / "kustomization.yaml": gpu,
    COMPONENTS / "gpu-dra" / "kustomization.yaml": gpu_dra,
    COMPONENTS / "gpu-rdma" / "kustomization.yaml": gpu_rdma,
    COMPONENTS / "gpu-rdma" / "gpu-rdma.yaml": gpu_rdma_template,
    COMPONENTS / "flight" / "kustomization.yaml": flight,
}


def main(argv):
    check = argv[1:] == ["--check"]
    if argv[1:] and not check:
        sys.exit(__doc__)
    stale = []
    # The injector's template is rendered from the components as written:
    # theirs first, so one run makes both.
    for outputs in (lambda: {path: make() for path, make in FILES.items()}, injector_files):
        for path, text in outputs().items():
            if check:
                if not path.exists() or path.read_text() != text:
                    stale.append(path.relative_to(ROOT))
            elif not path.exists() or path.read_text() != text:
                path.write_text(text)
                print(f"components.py: wrote {path.relative_to(ROOT)}", file=sys.stderr)
    if stale:
        print("components.py: out of date (run `make manifests` and commit): "
              + ", ".join(map(str, stale)), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

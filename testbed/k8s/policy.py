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
"""

import argparse
import pathlib
import sys

import yaml

INSTALLS = {"base", "kind", "k3d", "gpu", "production"}
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
# Labels the bundle's transformers set: they change with the overlay or the
# version, so they must never reach a StatefulSet's volumeClaimTemplates.
TRANSFORMED = {"app.kubernetes.io/instance", "app.kubernetes.io/version",
               "app.kubernetes.io/managed-by"}
KT_SERVERS = {"kt-metadata", "kt-store"}
CRD_GROUPS = {"monitoring.coreos.com"}
AGENT = "kt-agent"


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


class Checker:
    def __init__(self, version):
        self.version = version
        self.errors = []

    def fail(self, where, rule, msg):
        self.errors.append(f"{where}: {msg} [{rule}]")

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

    def restricted(self, where, spec):
        """Pod Security `restricted`, as the namespace enforces it."""
        psc = spec.get("securityContext") or {}
        for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
            sc = c.get("securityContext") or {}
            name = c.get("name")
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

    # --- rules over a whole file -----------------------------------------

    def check_file(self, path, docs):
        stem = path.stem
        install = stem in INSTALLS and path.parent.name != "examples"
        default_install = install and stem in DEFAULT_INSTALLS
        case = path.parent.name == "cases"
        services = {dig(d, "metadata", "name"): d for d in docs if d.get("kind") == "Service"}
        pods = []  # (doc, template labels)

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
            if tpl is not None:
                spec = tpl.get("spec") or {}
                kt_pod = is_kt(d)
                self.sidecar(where, spec)
                self.volumes(where, spec, kt_pod)
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
            if kind == "ServiceMonitor":
                for ep in dig(d, "spec", "endpoints") or []:
                    if dig(ep, "authorization", "credentials", "name") != "kt-token":
                        self.fail(where, "metrics-auth",
                                  f"endpoint {ep.get('port')} scrapes without the kt-token "
                                  "bearer token: /metrics answers 401")
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
        want = [k for k in RECOMMENDED if not (k == "instance" and stem == "base")]
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
            if d.get("kind") in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
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
        c.check_file(f, docs)
    for e in c.errors:
        print(e, file=sys.stderr)
    print(f"policy.py: {len(args.files)} file(s), {len(c.errors)} violation(s)")
    return 1 if c.errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

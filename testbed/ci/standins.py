"""Stand-ins for the tools the workflows call, for testbed/ci/rehearse.py.

rehearse.py writes one small bash shim per tool into the rehearsal's
stand-in directory (first on PATH); each shim runs

    python standins.py STATE_DIR TOOL ARGS...

STATE_DIR (one per rehearsed job) holds config.json (written by
rehearse.py: the clone, the real make/kubectl/python, the kt-scenario
binary to check against, the workspace's packages, ...), `step` (the step
being rehearsed), calls.log (every stand-in call: the step, argv and the
KT_* environment it saw), `errors` (glue errors: rehearse.py fails the step
on any line there, even when the script masked the exit status with
`|| true`), `warnings`, and what the stand-ins remember between calls
(clusters created, registries logged in to).

Each stand-in answers the calls the workflows make the way the real tool
would (`kind get kubeconfig` prints a kubeconfig, `docker buildx build`
writes its metadata file, ...) and checks what the real tool would refuse
(a Dockerfile COPY source missing from the build context, a make target
that does not exist, an environment value the scenario runner rejects, a
cluster name that was never created). Calls a stand-in does not know fail
loudly rather than pretend: teach it the call (here) when a workflow needs
one. Nothing here touches the network, the Docker engine or a cluster.

Only the standard library: the shims run it with the pyenv interpreter,
but it must not need PyYAML.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# The scenario the runner's dry run plans when a make recipe runs
# `kt-scenario run` on a cluster target (one scenario keeps the rehearsal
# fast; `make cluster-plans` plans them all).
PLAN_SCENARIO = "scenarios/bad-input.yaml"
# What `kt-scenario run --dry-run` says on a target it cannot plan: the
# flags and the environment were accepted by then (clap parses them first).
NOT_PLANNABLE = "--dry-run plans the kind and k3d targets only"
# What `kt-scenario chaos` says when --work-dir is not empty: it checks
# that before starting anything, after clap has accepted every flag.
CHAOS_WORK_DIR_NOT_EMPTY = "is not empty"
# The files `kt-scenario run --report DIR` writes (report::Result::write_all).
REPORT_FILES = ("report.json", "junit.xml", "report.html")


class Ctx:
    """One stand-in call: its state directory and config."""

    def __init__(self, state, tool, args):
        self.state = Path(state)
        self.tool = tool
        self.args = args
        self.cfg = json.loads((self.state / "config.json").read_text())
        self.step = (self.state / "step").read_text().strip() if (self.state / "step").exists() else "?"

    # -- recording ---------------------------------------------------------
    def log_call(self):
        kt_env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
                          if k.startswith("KT_"))
        line = f"[{self.step}] {self.tool} {shlex.join(self.args)}"
        if kt_env:
            line += f"    # {kt_env}"
        with open(self.state / "calls.log", "a") as f:
            f.write(line + "\n")

    def error(self, msg, code=1, prefix=True):
        """A glue error: printed, recorded for rehearse.py, exit status `code`."""
        msg = f"{self.tool}: {msg}" if prefix else msg
        with open(self.state / "errors", "a") as f:
            f.write(msg + "\n")
        print(f"rehearsal: {msg}", file=sys.stderr)
        return code

    def warn(self, msg):
        with open(self.state / "warnings", "a") as f:
            f.write(f"[{self.step}] {self.tool}: {msg}\n")
        print(f"rehearsal: warning: {self.tool}: {msg}", file=sys.stderr)

    def unknown(self):
        return self.error(f"the stand-in does not know `{self.tool} {shlex.join(self.args)}`: "
                          "teach testbed/ci/standins.py this call if a workflow needs it")

    # -- remembered state --------------------------------------------------
    def _load(self, name, default):
        p = self.state / name
        return json.loads(p.read_text()) if p.exists() else default

    def _save(self, name, value):
        (self.state / name).write_text(json.dumps(value, indent=1))

    def clusters(self, flavor):
        return self._load("clusters.json", {}).get(flavor, [])

    def set_clusters(self, flavor, names):
        all_ = self._load("clusters.json", {})
        all_[flavor] = sorted(set(names))
        self._save("clusters.json", all_)

    def scratch(self):
        d = self.state / "scratch"
        d.mkdir(exist_ok=True)
        return Path(tempfile.mkdtemp(dir=d))

    @contextlib.contextmanager
    def locked(self, name, where=None):
        """An exclusive lock on `name` (steps run stand-ins in parallel:
        `kubectl exec ... &`)."""
        d = Path(where or self.state)
        d.mkdir(parents=True, exist_ok=True)
        with open(d / f".{name}.lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    # -- what the workflow's jobs share (rehearse.py: workflow_state) --------
    def wf(self):
        d = Path(self.cfg.get("workflow_state") or self.state / "workflow")
        d.mkdir(parents=True, exist_ok=True)
        return d

    def registry(self):
        p = self.wf() / "registry.json"
        return json.loads(p.read_text()) if p.exists() else {"repos": {}}

    def set_registry(self, reg):
        (self.wf() / "registry.json").write_text(json.dumps(reg, indent=1))


def yaml_docs(ctx, text):
    """The YAML documents of `text` as JSON values, parsed by the
    rehearsal's own interpreter (it has PyYAML; this file must not need
    it): (docs, None) or (None, why)."""
    code = ("import json, sys, yaml\n"
            "json.dump([d for d in yaml.safe_load_all(sys.stdin) if d], sys.stdout)")
    r = subprocess.run([ctx.cfg["python"], "-c", code], input=text, capture_output=True, text=True)
    if r.returncode:
        lines = r.stderr.strip().splitlines()
        return None, lines[-1] if lines else "unreadable YAML"
    return json.loads(r.stdout), None


# ELF e_machine values and the platforms they run on.
ELF_MACHINES = {0x3E: "linux/amd64", 0xB7: "linux/arm64"}


def elf_platform(path):
    """The platform an ELF file is for (None: not an ELF file we know)."""
    try:
        with open(path, "rb") as f:
            head = f.read(20)
    except OSError:
        return None
    if len(head) < 20 or head[:4] != b"\x7fELF":
        return None
    return ELF_MACHINES.get(int.from_bytes(head[18:20], "little"))


def elf_stub(ctx, path, platform="linux/amd64"):
    """A real ELF file (a copy of `true`) marked for `platform`."""
    shutil.copy(ctx.cfg["real"]["true"], path)
    machine = next(m for m, p in ELF_MACHINES.items() if p == platform)
    with open(path, "r+b") as f:
        f.seek(18)
        f.write(machine.to_bytes(2, "little"))


def opt(args, *names, default=None):
    """The value of `--name X` or `--name=X` in args (the last one wins)."""
    val = default
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                val = args[i + 1]
            elif a.startswith(n + "="):
                val = a.split("=", 1)[1]
    return val


def positionals(args, value_flags):
    """args less flags (and the values of those in value_flags)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a.startswith("-"):
            skip = a in value_flags
        else:
            out.append(a)
    return out


def kubeconfig_text(flavor, name):
    port = 40000 + int(hashlib.sha256(name.encode()).hexdigest(), 16) % 20000
    ctx = f"{flavor}-{name}" if flavor == "kind" else f"k3d-{name}"
    return (f"# rehearsal stand-in: the kubeconfig of {flavor} cluster {name}\n"
            "apiVersion: v1\nkind: Config\n"
            f"clusters:\n- cluster:\n    server: https://127.0.0.1:{port}\n  name: {ctx}\n"
            f"contexts:\n- context:\n    cluster: {ctx}\n    user: {ctx}\n  name: {ctx}\n"
            f"current-context: {ctx}\n"
            f"users:\n- name: {ctx}\n  user:\n    token: rehearsal\n")


def missing_cluster(ctx, flavor, name, real_message):
    """The real tool's answer for an unknown cluster; a glue error when the
    job did create clusters, but under other names."""
    print(real_message, file=sys.stderr)
    made = ctx.clusters(flavor)
    if made:
        ctx.error(f"no {flavor} cluster named {name!r}: the runner created {', '.join(made)} "
                  "(does the step see the same KT_CLUSTER?)")
    return 1


# The testbed's cluster configs (what the runner's cluster targets create).
CLUSTER_CONFIGS = {"kind": "testbed/kind/cluster.yaml", "k3d": "testbed/k3d/config.yaml"}


def remember_nodes(ctx, flavor, name, text, agents=None):
    """The node (container) names of a cluster created from config `text`."""
    if flavor == "kind":
        planes = max(1, len(re.findall(r"role:\s*control-plane", text)))
        workers = len(re.findall(r"role:\s*worker", text))
        names = [f"{name}-control-plane" + (str(i + 1) if i else "") for i in range(planes)] + \
            [f"{name}-worker" + (str(i + 1) if i else "") for i in range(workers)]
    else:
        m = re.search(r"^agents:\s*(\d+)", text, re.M)
        n = int(agents or (m.group(1) if m else 0))
        names = [f"k3d-{name}-server-0"] + [f"k3d-{name}-agent-{i}" for i in range(n)]
    nodes = ctx._load(f"{flavor}-nodes.json", {})
    nodes[name] = names
    ctx._save(f"{flavor}-nodes.json", nodes)


def remember_testbed_cluster(ctx, flavor, name):
    """A cluster the scenario runner makes, from the testbed's config."""
    ctx.set_clusters(flavor, ctx.clusters(flavor) + [name])
    cfg = Path(CLUSTER_CONFIGS[flavor])
    remember_nodes(ctx, flavor, name, cfg.read_text() if cfg.is_file() else "")


# -- kind -------------------------------------------------------------------
def kind(ctx):
    a = ctx.args
    version = os.environ.get("REHEARSE_VERSION", "v0.27.0")
    name = opt(a, "--name", "-n", default="kind")
    words = positionals(a, {"--name", "-n", "--config", "--kubeconfig", "--wait", "--image",
                            "--retain", "--loglevel", "-v", "--verbosity"})
    match words[:2]:
        case ["version", *_]:
            print(f"kind {version} go1.23.6 linux/amd64")
        case ["create", "cluster"]:
            config = opt(a, "--config")
            if config and not Path(config).is_file():
                return ctx.error(f"create cluster --config {config}: no such file")
            if name in ctx.clusters("kind"):
                print(f'ERROR: failed to create cluster: node(s) already exist for a cluster with the '
                      f'name "{name}"', file=sys.stderr)
                return 1
            ctx.set_clusters("kind", ctx.clusters("kind") + [name])
            text = Path(config).read_text() if config else ""
            remember_nodes(ctx, "kind", name, text)
            images = ctx._load("kind-images.json", {})
            m = re.search(r"image:\s*(\S+)", text)
            images[name] = opt(a, "--image") or (m.group(1) if m else "kindest/node:v1.32.2")
            ctx._save("kind-images.json", images)
            if kc := opt(a, "--kubeconfig"):
                Path(kc).parent.mkdir(parents=True, exist_ok=True)
                Path(kc).write_text(kubeconfig_text("kind", name))
            print(f'Creating cluster "{name}" ...\n ✓ Ready')
        case ["get", "clusters"]:
            for c in ctx.clusters("kind"):
                print(c)
            if not ctx.clusters("kind"):
                print("No kind clusters found.", file=sys.stderr)
        case ["get", "kubeconfig"]:
            if name not in ctx.clusters("kind"):
                return missing_cluster(ctx, "kind", name,
                                       f"ERROR: could not locate any control plane nodes for cluster named '{name}'")
            print(kubeconfig_text("kind", name), end="")
        case ["get", "nodes"]:
            if name in ctx.clusters("kind"):
                for n in ctx._load("kind-nodes.json", {}).get(name, [f"{name}-control-plane"]):
                    print(n)
            else:
                print(f'No kind nodes found for cluster "{name}".', file=sys.stderr)
        case ["load", "docker-image"] | ["load", "image-archive"]:
            if name not in ctx.clusters("kind"):
                return missing_cluster(ctx, "kind", name, f"ERROR: unknown cluster \"{name}\"")
        case ["export", "logs"]:
            if name not in ctx.clusters("kind"):
                return missing_cluster(ctx, "kind", name, f"ERROR: unknown cluster \"{name}\"")
            out = Path(words[2]) if len(words) > 2 else ctx.scratch()
            (out / f"{name}-control-plane").mkdir(parents=True, exist_ok=True)
            (out / "kind-version.txt").write_text(f"kind {version}\n")
            (out / f"{name}-control-plane" / "kubelet.log").write_text("rehearsal: kubelet log\n")
            print(f"Exported logs for cluster \"{name}\" to:\n{out}")
        case ["delete", "cluster"]:
            ctx.set_clusters("kind", [c for c in ctx.clusters("kind") if c != name])
            print(f'Deleting cluster "{name}" ...')
        case ["delete", "clusters"]:
            ctx.set_clusters("kind", [])
        case _:
            return ctx.unknown()
    return 0


# -- k3d --------------------------------------------------------------------
def k3d(ctx):
    a = ctx.args
    version = os.environ.get("REHEARSE_VERSION", "v5.8.3")
    words = positionals(a, {"--config", "-c", "--cluster", "--image", "-i", "--servers", "-s",
                            "--agents", "-a", "--output", "-o", "--timeout", "--port", "-p",
                            "--volume", "-v"})
    made = ctx.clusters("k3d")
    match words[:2]:
        case ["version", *_]:
            print(f"k3d version {version}\nk3s version v1.31.5-k3s1 (default)")
        case ["cluster", "create"]:
            name = words[2] if len(words) > 2 else None
            config = opt(a, "--config", "-c")
            if config:
                if not Path(config).is_file():
                    return ctx.error(f"cluster create --config {config}: no such file")
                m = re.search(r"^metadata:\s*\n\s+name:\s*(\S+)", Path(config).read_text(), re.M)
                name = name or (m.group(1) if m else None)
            name = name or "k3s-default"
            ctx.set_clusters("k3d", made + [name])
            text = Path(config).read_text() if config else ""
            remember_nodes(ctx, "k3d", name, text, opt(a, "--agents", "-a"))
            print(f"INFO[0000] Cluster '{name}' created successfully!")
        case ["cluster", "delete"]:
            names = made if "--all" in a else words[2:] or ["k3s-default"]
            for n in names:
                if n not in made:
                    print(f"ERRO[0000] error getting cluster '{n}': No nodes found for given cluster",
                          file=sys.stderr)
                    return 1
            ctx.set_clusters("k3d", [c for c in made if c not in names])
            for n in names:
                print(f"INFO[0000] Successfully deleted cluster {n}!")
        case ["cluster", "list"] | ["cluster", "ls"]:
            if opt(a, "-o", "--output") == "json":
                print(json.dumps([{"name": c, "serversRunning": 1} for c in made]))
            else:
                print("NAME   SERVERS   AGENTS   LOADBALANCER")
                for c in made:
                    print(f"{c}   1/1       0/0      true")
        case ["kubeconfig", "get"] | ["kubeconfig", "print"]:
            name = words[2] if len(words) > 2 else "k3s-default"
            if name not in made:
                return missing_cluster(ctx, "k3d", name,
                                       f"ERRO[0000] error starting/getting cluster '{name}': No nodes found for given cluster")
            print(kubeconfig_text("k3d", name), end="")
        case ["image", "import"]:
            name = opt(a, "--cluster", "-c", default="k3s-default")
            if name not in made:
                return missing_cluster(ctx, "k3d", name, f"ERRO[0000] Failed to get cluster {name}")
        case ["node", "list"] | ["node", "ls"]:
            for c in made:
                print(f"k3d-{c}-server-0   server   {c}   running")
        case _:
            return ctx.unknown()
    return 0


# -- kubectl ----------------------------------------------------------------
KUBECTL_VALUE_FLAGS = {"--kubeconfig", "--context", "-n", "--namespace", "-o", "--output", "-l",
                       "--selector", "--sort-by", "-f", "--filename", "-c", "--container",
                       "--timeout", "--for", "--field-selector", "--server", "--tail", "-k",
                       "--kustomize", "--field-manager", "--audience", "--duration"}
# `kubectl rollout status` / `wait` / `exec`: the kinds named TYPE/NAME.
KUBE_KINDS = {"deploy": "Deployment", "deployment": "Deployment", "deployments": "Deployment",
              "sts": "StatefulSet", "statefulset": "StatefulSet", "statefulsets": "StatefulSet",
              "ds": "DaemonSet", "daemonset": "DaemonSet", "daemonsets": "DaemonSet",
              "job": "Job", "jobs": "Job", "cronjob": "CronJob", "cronjobs": "CronJob",
              "pod": "Pod", "pods": "Pod", "po": "Pod", "svc": "Service", "service": "Service",
              "ns": "Namespace", "namespace": "Namespace", "pvc": "PersistentVolumeClaim",
              "serviceaccount": "ServiceAccount", "sa": "ServiceAccount",
              "crd": "CustomResourceDefinition", "crds": "CustomResourceDefinition",
              "customresourcedefinition": "CustomResourceDefinition",
              "customresourcedefinitions": "CustomResourceDefinition"}
CLUSTER_KINDS = ("Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                 "StorageClass")
BUILTIN_NAMESPACES = {"default", "kube-system", "kube-public", "kube-node-lease", "local-path-storage"}


def kubectl(ctx):
    a = ctx.args
    if "--" in a:  # exec's command: not kubectl's flags
        a = a[:a.index("--")]
    words = positionals(a, KUBECTL_VALUE_FLAGS)
    verb = words[0] if words else ""
    if verb == "version" or a == ["--version"]:
        version = os.environ.get("REHEARSE_VERSION", "v1.32.4")
        kustomize = "v5.5.0"
        print(f"Client Version: {version}\nKustomize Version: {kustomize}")
        if "--client" not in a:
            if _kubeconfig_cluster(ctx) is None:
                return 1
            print("Server Version: v1.32.2")
        return 0
    if verb == "kustomize":
        # Offline and harmless: the real one renders (the runner's dry run
        # and release-bundle.sh check what it renders).
        real = ctx.cfg["real"].get("kubectl")
        if not real:
            return ctx.error("`kubectl kustomize` needs a real kubectl on this machine (the "
                             "project's prerequisite, see the README)")
        os.execv(real, [real, *a])
    if verb in ("config", "completion", "plugin", "api-versions", "explain") or not verb:
        return 0 if verb else ctx.unknown()
    cluster_verbs = {"get", "describe", "apply", "delete", "wait", "rollout", "logs", "exec",
                     "port-forward", "create", "label", "annotate", "patch", "scale", "top",
                     "cluster-info", "events", "cp", "replace", "auth", "run"}
    if verb not in cluster_verbs:
        return ctx.unknown()
    cluster = _kubeconfig_cluster(ctx)
    if cluster is None:
        return 1
    node = f"{cluster}-control-plane"
    what = words[1] if len(words) > 1 else ""
    ns = opt(a, "-n", "--namespace") or "default"
    if verb == "apply":
        return kubectl_apply(ctx, cluster, ns)
    if verb in ("rollout", "wait"):
        return kubectl_wait(ctx, cluster, ns, verb, words)
    if verb == "exec":
        return kubectl_exec(ctx, cluster, ns)
    if verb == "get" and what in ("pods", "pod", "po") and opt(a, "-l", "--selector"):
        return kubectl_get_pods(ctx, cluster, ns, opt(a, "-l", "--selector"))
    if verb == "get" and what in ("nodes", "node", "no") and opt(a, "-l", "--selector"):
        out = opt(a, "-o", "--output")
        sel = opt(a, "-l", "--selector")
        names = [n for n, labels in sorted(node_labels(ctx, cluster).items()) if _selects(sel, labels)]
        if out == "name":
            print("".join(f"node/{n}\n" for n in names), end="")
        elif out and re.fullmatch(r'jsonpath=\{range \.items\[\*\]\}\{\.metadata\.name\}\{"?\\?\\n"?\}\{end\}', out):
            print("".join(n + "\n" for n in names), end="")
        elif out is None:
            print("NAME   STATUS   ROLES   AGE   VERSION")
            for n in names:
                print(f"{n}   Ready    <none>   2m    v1.32.2")
        else:
            return ctx.unknown()
        return 0
    if verb == "get" and what == "events" and opt(a, "--field-selector"):
        want = dict(t.split("=", 1) for t in opt(a, "--field-selector").split(",") if "=" in t)
        fields = {"involvedObject.kind": "kind", "involvedObject.name": "name", "type": "type",
                  "reason": "reason", "involvedObject.namespace": "namespace"}
        if any(k not in fields for k in want):
            return ctx.unknown()
        events = [e for e in ctx._load("events.json", {}).get(cluster, [])
                  if e["namespace"] == ns and all(e[fields[k]] == v for k, v in want.items())]
        out = opt(a, "-o", "--output")
        if out and re.fullmatch(r'jsonpath=\{range \.items\[\*\]\}\{\.reason\}\{": "\}\{\.message\}\{"?\\?\\n"?\}\{end\}', out):
            print("".join(f"{e['reason']}: {e['message']}\n" for e in events), end="")
            return 0
        if out is not None:
            return ctx.unknown()
        print("LAST SEEN   TYPE      REASON   OBJECT   MESSAGE")
        for e in events:
            print(f"10s   {e['type']}   {e['reason']}   {e['kind'].lower()}/{e['name']}   {e['message']}")
        return 0
    if verb == "create" and what == "secret":
        import base64
        words = positionals(a, KUBECTL_VALUE_FLAGS | {"--from-literal", "--from-file", "--type"})
        if len(words) != 4 or words[2] != "generic":
            return ctx.unknown()
        lits = [x.split("=", 1)[1] for x in a if x.startswith("--from-literal=")]
        lits += [a[i + 1] for i, x in enumerate(a[:-1]) if x == "--from-literal"]
        if any("=" not in x for x in lits):
            return ctx.error("create secret --from-literal needs KEY=VALUE")
        data = {k: base64.b64encode(v.encode()).decode() for k, v in (x.split("=", 1) for x in lits)}
        if opt(a, "--dry-run") == "client" and opt(a, "-o", "--output") == "yaml":
            print(f"apiVersion: v1\ndata:\n" + "".join(f"  {k}: {v}\n" for k, v in data.items()) +
                  f"kind: Secret\nmetadata:\n  name: {words[3]}\n  namespace: {ns}\n")
            return 0
        if opt(a, "--dry-run"):
            return ctx.unknown()
        state = k8s_state(ctx)
        mine = state.setdefault(cluster, {"objects": [], "pods": {}})
        mine["objects"] = [o for o in mine["objects"] if (o["kind"], o["name"], o["namespace"]) !=
                           ("Secret", words[3], ns)]
        mine["objects"].append({"kind": "Secret", "name": words[3], "namespace": ns, "labels": {},
                                "podLabels": {}, "replicas": 0, "containers": [], "data": data})
        ctx._save("k8s.json", state)
        print(f"secret/{words[3]} created")
        return 0
    if verb == "get" and "-o" in a and opt(a, "-o", "--output") == "name":
        print(f"{what.rstrip('s')}/rehearsal")
    elif verb == "get" and what == "events":
        print("NAMESPACE   LAST SEEN   TYPE     REASON    OBJECT              MESSAGE")
        print("kt-ci       10s         Normal   Started   pod/kt-store-0      Started container kt-store")
    elif verb == "get" and what in ("pods", "pod", "po"):
        print("NAMESPACE   NAME          READY   STATUS    RESTARTS   AGE   IP           NODE")
        print(f"kt-ci       kt-store-0    1/1     Running   0          1m    10.244.0.5   {node}")
    elif verb == "get" and what in ("nodes", "node", "no"):
        m = re.search(r":(v\d+\.\d+\.\d+)", ctx._load("kind-images.json", {}).get(cluster, ""))
        version = m.group(1) if m else "v1.32.2"
        print("NAME   STATUS   ROLES           AGE   VERSION")
        for n in cluster_nodes(ctx, cluster):
            print(f"{n}   Ready    {'control-plane' if 'control-plane' in n else '<none>'}   2m    {version}")
    elif verb == "describe":
        print(f"Name:               {node}\nRoles:              control-plane\nConditions:\n  Ready   True")
    elif verb == "create":
        print("rehearsal/object configured")
    elif verb == "delete":
        print("rehearsal/object deleted")
    return 0


# What was applied to each cluster (objects), and the pods `get pods` named.
def k8s_state(ctx):
    return ctx._load("k8s.json", {})


def k8s_objects(ctx, cluster):
    return k8s_state(ctx).get(cluster, {}).get("objects", [])


def _containers(spec):
    sc = spec or {}
    out = []
    for key in ("initContainers", "containers"):
        for c in sc.get(key) or []:
            out.append({"name": c.get("name"), "image": c.get("image", ""),
                        "init": key == "initContainers",
                        "readOnlyRoot": bool((c.get("securityContext") or {}).get("readOnlyRootFilesystem")),
                        "mounts": [{"path": m.get("mountPath"), "readOnly": bool(m.get("readOnly"))}
                                   for m in c.get("volumeMounts") or []]})
    return out


def _template(d):
    spec = d.get("spec") or {}
    if d.get("kind") == "CronJob":
        return ((spec.get("jobTemplate") or {}).get("spec") or {}).get("template") or {}
    if d.get("kind") == "Pod":
        return d
    return spec.get("template") or {}


def kubectl_apply(ctx, cluster, ns):
    """`kubectl apply [--server-side] -f FILE... | -k DIR`: the files exist
    (a kustomization renders, with the real kubectl); what they hold is
    remembered, and must go into a namespace that exists."""
    a = ctx.args
    texts = []
    for f in multi(a, "-f", "--filename"):
        if "://" in f:
            return no_network(ctx)
        if f == "-":
            texts.append((f, sys.stdin.read()))
        elif not Path(f).is_file():
            print(f'error: the path "{f}" does not exist', file=sys.stderr)
            return ctx.error(f"apply -f {f}: no such file")
        else:
            texts.append((f, Path(f).read_text()))
    for k in multi(a, "-k", "--kustomize"):
        real = ctx.cfg["real"].get("kubectl")
        if not real:
            return ctx.error("`kubectl apply -k` needs a real kubectl on this machine to render")
        r = subprocess.run([real, "kustomize", k], capture_output=True, text=True)
        if r.returncode:
            sys.stderr.write(r.stderr)
            return ctx.error(f"apply -k {k}: kustomize cannot render it: "
                             f"{(r.stderr.strip().splitlines() or ['?'])[-1]}")
        texts.append((k, r.stdout))
    if not texts:
        return ctx.error("apply: no -f or -k")
    state = k8s_state(ctx)
    mine = state.setdefault(cluster, {"objects": [], "pods": {}})
    known_ns = BUILTIN_NAMESPACES | {o["name"] for o in mine["objects"] if o["kind"] == "Namespace"}
    for src, text in texts:
        docs, why = yaml_docs(ctx, text)
        if docs is None:
            return ctx.error(f"apply {src}: not YAML: {why}")
        known_ns |= {d.get("metadata", {}).get("name") for d in docs if d.get("kind") == "Namespace"}
        for d in docs:
            md = d.get("metadata") or {}
            kind = d.get("kind")
            cluster_scoped = kind in CLUSTER_KINDS
            o_ns = None if cluster_scoped else (md.get("namespace") or ns)
            if o_ns and o_ns not in known_ns:
                print(f'Error from server (NotFound): namespaces "{o_ns}" not found', file=sys.stderr)
                return ctx.error(f"apply {src}: {kind}/{md.get('name')} goes into namespace {o_ns}, "
                                 "which does not exist (apply the install first?)")
            tpl = _template(d)
            obj = {"kind": kind, "name": md.get("name"), "namespace": o_ns,
                   "labels": md.get("labels") or {},
                   "podLabels": (tpl.get("metadata") or {}).get("labels") or {},
                   "replicas": (d.get("spec") or {}).get("replicas", 1),
                   "containers": _containers(tpl.get("spec"))}
            tspec = tpl.get("spec") or {}
            terms = ((((tspec.get("affinity") or {}).get("nodeAffinity") or {})
                      .get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or [])
            obj["affinityExists"] = [e["key"] for t in terms[:1] for e in t.get("matchExpressions") or []
                                     if e.get("operator") == "Exists"]
            obj["hostPaths"] = [v["hostPath"]["path"] for v in tspec.get("volumes") or [] if v.get("hostPath")]
            if kind == "Job":
                obj["podLabels"] = {**obj["podLabels"], "batch.kubernetes.io/job-name": obj["name"],
                                    "job-name": obj["name"]}
            if kind == "NetworkPolicy":
                obj["spec"] = d.get("spec") or {}
            if kind == "Secret":
                obj["data"], obj["stringData"] = d.get("data") or {}, d.get("stringData") or {}
            mine["objects"] = [x for x in mine["objects"]
                               if (x["kind"], x["name"], x["namespace"]) != (kind, obj["name"], o_ns)]
            mine["objects"].append(obj)
            print(f"{kind.lower()}/{obj['name']} serverside-applied")
    ctx._save("k8s.json", state)
    return 0


def _find(ctx, cluster, ns, kind, name):
    return next((o for o in k8s_objects(ctx, cluster)
                 if o["kind"] == kind and o["name"] == name and o["namespace"] == ns), None)


def kubectl_wait(ctx, cluster, ns, verb, words):
    """`kubectl rollout status TYPE/NAME` and `kubectl wait --for=... TYPE/NAME`
    (or `pods -l ...`): the object was applied."""
    a = ctx.args
    if verb == "rollout":
        if len(words) < 3 or words[1] not in ("status", "restart", "history", "undo"):
            return ctx.unknown()
        targets = words[2:]
    else:
        if not opt(a, "--for"):
            return ctx.error("wait: --for is required")
        targets = words[1:]
        if targets and targets[0] in ("pods", "pod", "po") and opt(a, "-l", "--selector"):
            print("pod condition met")
            return 0
    if not targets:
        return ctx.error(f"{verb}: no resource named")
    for t in targets:
        if "/" not in t:
            return ctx.unknown()
        typ, name = t.split("/", 1)
        kind = KUBE_KINDS.get(typ.lower().split(".")[0])
        if kind is None:
            return ctx.unknown()
        obj = _find(ctx, cluster, None if kind in CLUSTER_KINDS else ns, kind, name)
        if obj is None:
            print(f'Error from server (NotFound): {typ.lower()}s "{name}" not found', file=sys.stderr)
            return ctx.error(f"{verb} {t} -n {ns}: nothing of that kind and name was applied to "
                             f"namespace {ns} of cluster {cluster}")
        if kind == "Job" and obj.get("affinityExists") is not None:
            node = pod_node(ctx, cluster, obj)
            missing = [h for h in obj.get("hostPaths", [])
                       if node and not node_path(ctx, cluster, node, h).is_dir()]
            if node is None or missing:
                why = (f"no node carries {', '.join(obj['affinityExists'])} (the pod stays Pending)"
                       if node is None else f"hostPath {missing[0]} is no directory on {node}")
                print(f"error: timed out waiting for the condition on jobs/{name} ({why})", file=sys.stderr)
                return 1
        if verb == "rollout" and words[1] == "status":
            print(f'{kind.lower()} "{name}" successfully rolled out')
        else:
            print(f"{kind.lower()}/{name} condition met")
    return 0


def _selects(selector, labels):
    for term in [x.strip() for x in selector.split(",") if x.strip()]:
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k) == v:
                return False
        elif "=" in term:
            k, v = term.split("==" if "==" in term else "=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def kubectl_get_pods(ctx, cluster, ns, selector):
    """`kubectl get pods -l SELECTOR [-o name|jsonpath=...]`: the pods of the
    applied workloads whose pod template matches, named as their
    controllers name them (and remembered for exec)."""
    a = ctx.args
    state = k8s_state(ctx)
    mine = state.setdefault(cluster, {"objects": [], "pods": {}})
    pods = []
    for o in mine["objects"]:
        if o["namespace"] != ns or o["kind"] not in ("Deployment", "StatefulSet", "Job", "Pod",
                                                     "DaemonSet") or not _selects(selector, o["podLabels"]):
            continue
        h = hashlib.sha256(f"{cluster}/{ns}/{o['name']}".encode()).hexdigest()
        n = int(o.get("replicas") or 1)
        if o["kind"] == "DaemonSet":
            names = [f"{o['name']}-{h[5 * i:5 * i + 5]}" for i in range(len(schedulable_nodes(ctx, cluster)))]
        elif o["kind"] == "Deployment":
            names = [f"{o['name']}-{h[:10]}-{h[10 + 5 * i:15 + 5 * i]}" for i in range(n)]
        elif o["kind"] == "StatefulSet":
            names = [f"{o['name']}-{i}" for i in range(n)]
        elif o["kind"] == "Pod":
            names = [o["name"]]
        else:
            names = [f"{o['name']}-{h[:5]}"]
        for i, name in enumerate(names):
            mine["pods"][name] = {"namespace": ns, "owner": o["name"], "labels": o["podLabels"],
                                  "containers": o["containers"], "node": pod_node(ctx, cluster, o, i)}
        pods += names
    ctx._save("k8s.json", state)
    out = opt(a, "-o", "--output")
    if out is None or out == "wide":
        if not pods:
            print(f"No resources found in {ns} namespace.", file=sys.stderr)
            return 0
        print("NAME   READY   STATUS    RESTARTS   AGE")
        for n in pods:
            print(f"{n}   2/2     Running   0          1m")
    elif out == "name":
        for n in pods:
            print(f"pod/{n}")
    elif re.fullmatch(r"jsonpath=\{\.items\[\*\]\.metadata\.name\}", out):
        print(" ".join(pods), end="")
    elif re.fullmatch(r'jsonpath=\{range \.items\[\*\]\}\{\.metadata\.name\}\{"?\\?\\n"?\}\{end\}', out):
        print("".join(n + "\n" for n in pods), end="")
    elif re.fullmatch(r'jsonpath=\{range \.items\[\*\]\}\{\.spec\.nodeName\}\{"?\\?\\n"?\}\{end\}', out):
        print("".join((mine["pods"][n]["node"] or "") + "\n" for n in pods), end="")
    elif re.fullmatch(r"jsonpath=\{\.items\[0\]\.spec\.nodeName\}", out):
        if not pods:
            print("error: error executing jsonpath \"{.items[0].spec.nodeName}\": array index out of bounds",
                  file=sys.stderr)
            return 1
        print(mine["pods"][pods[0]]["node"] or "", end="")
    else:
        return ctx.unknown()
    return 0


class PodFs:
    """A pod's filesystem as one container sees it: its paths under a
    directory of the rehearsal; writable only below its writable mounts
    when its root filesystem is read-only."""

    def __init__(self, ctx, cluster, pod, container):
        self.root = ctx.state / "pods" / cluster / pod
        self.container = container
        for m in container["mounts"]:
            self.path(m["path"]).mkdir(parents=True, exist_ok=True)

    def path(self, p):
        return self.root / str(p).lstrip("/")

    def writable(self, p):
        p = "/" + str(p).strip("/")
        mounts = sorted(self.container["mounts"], key=lambda m: len(m["path"]), reverse=True)
        m = next((m for m in mounts
                  if p == m["path"].rstrip("/") or p.startswith(m["path"].rstrip("/") + "/")), None)
        if m is not None:
            return not m["readOnly"]
        return not self.container["readOnlyRoot"]


def kubectl_exec(ctx, cluster, ns):
    """`kubectl exec [-i] POD [-c CONTAINER] -- CMD...`: a pod `get pods`
    named, a container of it; CMD in an emulated filesystem of the pod:
    `mkdir -p`, `tar -C DIR -cf - ...` / `tar -C DIR -xf -` (the real tar,
    stdin/stdout passed through, a read-only root filesystem refusing
    writes), `sha256sum`, `cat`, and `kt` (the kt stand-in, in the pod: its
    namespace, its service's rights) where the image is kt's client."""
    a = ctx.args
    if "--" not in a:
        return ctx.error("exec without `--` before the command (kubectl refuses it)")
    cmd = a[a.index("--") + 1:]
    words = positionals(a[:a.index("--")], KUBECTL_VALUE_FLAGS)
    if len(words) < 2:
        return ctx.error("exec: no pod")
    pod_name = words[1]
    if "/" in pod_name:
        return ctx.unknown()
    pod = k8s_state(ctx).get(cluster, {}).get("pods", {}).get(pod_name)
    if pod is None or pod["namespace"] != ns:
        print(f'Error from server (NotFound): pods "{pod_name}" not found', file=sys.stderr)
        return ctx.error(f"exec {pod_name} -n {ns}: no such pod (pods are named by an earlier "
                         "`kubectl get pods -l ...`)")
    cname = opt(a[:a.index("--")], "-c", "--container")
    main = [c for c in pod["containers"] if not c["init"]]
    c = next((c for c in pod["containers"] if c["name"] == cname), None) if cname else (main or [None])[0]
    if c is None:
        print(f'error: container {cname} not found in pod {pod_name}', file=sys.stderr)
        return ctx.error(f"exec {pod_name} -c {cname}: the pod's containers are "
                         f"{', '.join(x['name'] for x in pod['containers'])}")
    fs = PodFs(ctx, cluster, pod_name, c)
    if not cmd:
        return ctx.error("exec: no command")
    prog = cmd[0]
    if prog == "mkdir":
        for d in [x for x in cmd[1:] if not x.startswith("-")]:
            if not fs.writable(d):
                print(f"mkdir: can't create directory '{d}': Read-only file system", file=sys.stderr)
                return 1
            fs.path(d).mkdir(parents=True, exist_ok=True)
        return 0
    if prog == "tar":
        d = opt(cmd, "-C", "--directory") or "/"
        if not fs.path(d).is_dir():
            print(f"tar: can't change directory to '{d}': No such file or directory", file=sys.stderr)
            return 1
        flags = "".join(x.lstrip("-") for x in cmd[1:] if x.startswith("-") and x not in ("-C",))
        if "x" in flags and not fs.writable(d):
            print(f"tar: can't open '{d}/...': Read-only file system", file=sys.stderr)
            return 1
        real = [x if i == 0 or cmd[i - 1] != "-C" else str(fs.path(x)) for i, x in enumerate(cmd)]
        r = subprocess.run(real, stdin=sys.stdin, stdout=sys.stdout, stderr=sys.stderr)
        return r.returncode
    if prog in ("sha256sum", "cat"):
        paths = [x for x in cmd[1:] if not x.startswith("-")]
        for x in paths:
            if not fs.path(x).is_file():
                print(f"{prog}: can't open '{x}': No such file or directory", file=sys.stderr)
                return 1
        r = subprocess.run([prog, *[str(fs.path(x)) for x in paths]], capture_output=True, text=True)
        out = r.stdout
        for x in paths:
            out = out.replace(str(fs.path(x)), x)
        sys.stdout.write(out)
        return r.returncode
    if prog == "kt":
        if "kt-client" not in c["image"]:
            print('error: exec: "kt": executable file not found in $PATH', file=sys.stderr)
            return ctx.error(f"exec {pod_name} -c {c['name']} -- kt: the container's image "
                             f"({c['image']}) is not kt's client image")
        return kt_main(ctx, cmd[1:], pod={"name": pod_name, "cluster": cluster, "namespace": ns,
                                          "service": pod["labels"].get("kt.dev/service"), "fs": fs})
    return ctx.unknown()


def _kubeconfig_cluster(ctx):
    """The cluster the kubeconfig kubectl would use points at, or None
    (after printing what the real kubectl says)."""
    path = opt(ctx.args, "--kubeconfig") or (os.environ.get("KUBECONFIG") or "").split(":")[0] \
        or str(Path.home() / ".kube" / "config")
    if not Path(path).is_file():
        print("E0101 memcache.go:265] couldn't get current server API group list: Get "
              "\"http://localhost:8080/api?timeout=32s\": dial tcp 127.0.0.1:8080: connect: connection refused\n"
              "The connection to the server localhost:8080 was refused - did you specify the right host or port?",
              file=sys.stderr)
        return None
    m = re.search(r"rehearsal stand-in: the kubeconfig of (\w+) cluster (\S+)", Path(path).read_text())
    if not m or m.group(2) not in ctx.clusters(m.group(1)):
        print(f"Unable to connect to the server: dial tcp 127.0.0.1:6443: connect: connection refused "
              f"(kubeconfig {path}: no such rehearsal cluster)", file=sys.stderr)
        return None
    return m.group(2)


# -- docker -----------------------------------------------------------------
# A docker image reference: [host[:port]/]path[:tag], lowercase path.
IMAGE_REF = re.compile(r"^(?:[a-zA-Z0-9.-]+(?::[0-9]+)?/)?[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
                       r"(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*(?::[\w][\w.-]{0,127})?$")
BUILD_VALUE_FLAGS = {"-f", "--file", "-t", "--tag", "--label", "--platform", "--build-arg",
                     "--metadata-file", "--cache-from", "--cache-to", "--target", "-o", "--output",
                     "--iidfile", "--secret", "--progress", "--builder", "--build-context",
                     "--provenance", "--sbom", "--network", "--ssh", "--annotation"}


def docker(ctx):
    a = ctx.args
    if opt(a, "-H", "--host") or any(x.startswith("--context") for x in a):
        return ctx.error("refusing a docker call aimed at another engine (-H/--context)")
    words = positionals(a, BUILD_VALUE_FLAGS | {"--filter", "--format", "-u", "--username",
                                                "-p", "--password", "--name", "-n", "--tail",
                                                "--network", "-e", "--env"})
    verb = words[0] if words else ""
    if a[:1] in (["--version"], ["-v"]):
        print("Docker version 28.0.4, build rehearsal")
    elif verb == "version":
        print("Client: Docker Engine - Community\n Version: 28.0.4\nServer: Docker Engine - Community\n Version: 28.0.4")
    elif verb == "info":
        print("Client:\n Context: default\nServer:\n Containers: 0\n Server Version: 28.0.4\n Storage Driver: overlay2")
    elif verb == "buildx":
        sub = words[1] if len(words) > 1 else ""
        if sub == "build":
            return docker_build(ctx, a[a.index("build") + 1:])
        if sub == "imagetools":
            return docker_imagetools(ctx, a[a.index("imagetools") + 1:])
        if sub in ("version",):
            print("github.com/docker/buildx v0.21.2 rehearsal")
        elif sub not in ("create", "use", "inspect", "ls", "rm", "install", "bake"):
            return ctx.unknown()
    elif verb == "build":
        return docker_build(ctx, a[a.index("build") + 1:])
    elif verb == "ps":
        return docker_ps(ctx)
    elif verb == "logs":
        name = words[1] if len(words) > 1 else ""
        if name not in _docker_nodes(ctx):
            print(f"Error response from daemon: No such container: {name}", file=sys.stderr)
            return 1
        print(f"rehearsal: the log of node container {name}")
    elif verb == "login":
        registry = words[1] if len(words) > 1 else "docker.io"
        with open(ctx.state / "docker-logins", "a") as f:
            f.write(registry + "\n")
        print("Login Succeeded")
    elif verb in ("push",):
        return _check_push(ctx, words[1:])
    elif verb == "create":
        return docker_create(ctx, a[a.index("create") + 1:])
    elif verb == "cp":
        return docker_cp(ctx, words[1:])
    elif verb == "rm":
        return docker_rm(ctx, a[a.index("rm") + 1:])
    elif verb == "exec":
        return docker_exec(ctx, a[a.index("exec") + 1:])
    elif verb == "run":
        return docker_run(ctx, a[a.index("run") + 1:])
    elif verb in ("inspect", "port", "logs") and len(words) > 1 and \
            (ctx._load("containers.json", {}).get(words[1]) or {}).get("run"):
        c = ctx._load("containers.json", {})[words[1]]
        if verb == "logs":
            print(f"rehearsal: the log of container {words[1]} ({c['image']})")
        elif verb == "port":
            if not c["port"] or (len(words) > 2 and words[2].split("/")[0] != str(c["port"])):
                print(f"Error: No public port '{words[2] if len(words) > 2 else ''}' published for "
                      f"{words[1]}", file=sys.stderr)
                return 1
            print(f"127.0.0.1:{c['host_port']}")
        else:
            fmt = opt(a, "-f", "--format") or ""
            m = re.search(r'\(index \.NetworkSettings\.Networks "([^"]+)"\)\.IPAddress', fmt)
            if not m:
                return ctx.unknown()
            print(c["ip"] if m.group(1) == c["network"] else "<no value>")
    elif verb in ("tag", "pull", "images", "image", "save", "load", "rmi", "network",
                  "volume", "inspect", "stop", "kill", "logout"):
        pass
    else:
        return ctx.unknown()
    return 0


def _docker_nodes(ctx):
    """Node containers of the clusters the job created, with their labels."""
    kind_nodes = ctx._load("kind-nodes.json", {})
    nodes = {n: f"io.x-k8s.kind.cluster={c}" for c in ctx.clusters("kind")
             for n in kind_nodes.get(c, [f"{c}-control-plane"])}
    k3d_nodes = ctx._load("k3d-nodes.json", {})
    nodes.update({n: f"k3d.cluster={c}" for c in ctx.clusters("k3d")
                  for n in k3d_nodes.get(c, [f"k3d-{c}-server-0"])})
    return nodes


def docker_ps(ctx):
    a = ctx.args
    filters = [a[i + 1] for i, x in enumerate(a[:-1]) if x in ("--filter", "-f")]
    filters += [x.split("=", 1)[1] for x in a if x.startswith("--filter=")]
    fmt = opt(a, "--format")
    names = [n for n, label in _docker_nodes(ctx).items()
             if all((f.startswith("label=") and f[6:] == label) or (f.startswith("name=") and f[5:] in n)
                    for f in filters)]
    if fmt is None:
        print("CONTAINER ID   IMAGE                  STATUS         NAMES")
    for n in names:
        print(n if fmt else f"0123456789ab   kindest/node:v1.32.2   Up 2 minutes   {n}")
    return 0


def _check_push(ctx, tags):
    logins = set((ctx.state / "docker-logins").read_text().split()) \
        if (ctx.state / "docker-logins").exists() else set()
    for t in tags:
        host = t.split("/")[0] if "/" in t and ("." in t.split("/")[0] or ":" in t.split("/")[0]) \
            else "docker.io"
        if host not in logins:
            return ctx.error(f"push of {t}: no earlier step logged in to {host} "
                             "(docker/login-action or docker login)")
    return 0


def docker_build(ctx, a):
    """`docker [buildx] build`: the Dockerfile exists, every COPY/ADD source is
    in the build context, every tag is a valid reference, and --push (or an
    --output that pushes) has a login; a binary copied into an image of one
    --platform is an ELF file for that platform; writes --metadata-file and
    --iidfile as buildx does, and what it pushes goes into the workflow's
    registry (later jobs pull only what was pushed)."""
    ctxs = positionals(a, BUILD_VALUE_FLAGS)
    if len(ctxs) != 1:
        return ctx.error(f"build needs exactly one context argument, got {ctxs}")
    context = Path(ctxs[0])
    if not context.is_dir():
        return ctx.error(f"build context {context} is not a directory")
    dockerfile = Path(opt(a, "-f", "--file") or context / "Dockerfile")
    if not dockerfile.is_file():
        return ctx.error(f"Dockerfile {dockerfile} does not exist")
    tags = [v for i, v in enumerate(a[1:], 1) if a[i - 1] in ("-t", "--tag")]
    tags += [x.split("=", 1)[1] for x in a if x.startswith("--tag=")]
    for t in tags:
        if not IMAGE_REF.match(t):
            return ctx.error(f"invalid tag {t!r}: repository names must be lowercase, "
                             "tags [A-Za-z0-9_.-] (docker reference format)")
    platforms = [x for v in multi(a, "--platform") for x in v.split(",") if x] or ["linux/amd64"]
    build_args = dict(v.split("=", 1) if "=" in v else (v, os.environ.get(v, ""))
                      for v in multi(a, "--build-arg"))
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    files, sources = [], hashlib.sha256()
    for line in text.splitlines():
        words = line.split()
        if words and words[0].upper() == "FROM" and len(words) > 1:
            image = next((w for w in words[1:] if not w.startswith("--")), "")
            base = re.sub(r"\$\{?(\w+)\}?", lambda m: build_args.get(m.group(1)) or
                          _arg_default(text, m.group(1)), image)
            found = resolve_image(ctx, base)
            if found is False:
                return ctx.error(f"{dockerfile}: FROM {base}: not found in the registry (no earlier "
                                 "step or job pushed it)")
            if found:
                missing = [pl for pl in platforms if pl not in found[2].get("platforms", [])]
                if missing:
                    return ctx.error(f"{dockerfile}: FROM {base} has no {', '.join(missing)} image "
                                     f"(it has {', '.join(found[2].get('platforms', []))})")
                files += found[2].get("files", [])
        if not words or words[0].upper() not in ("COPY", "ADD"):
            continue
        args = [w for w in words[1:] if not w.startswith("--")]
        if any(w.startswith("--from") for w in words[1:]) or args[:1] and args[0].startswith("["):
            continue
        for src in args[:-1]:
            if "$" in src or "://" in src:
                continue
            if not list(context.glob(src.rstrip("/"))) and not (context / src).exists():
                return ctx.error(f"{dockerfile}: `{line.strip()}`: {src} is not in the build "
                                 f"context {context}")
            dest = args[-1]
            files.append(dest.rstrip("/") + "/" + Path(src).name if dest.endswith("/") and
                         (context / src).is_file() else dest)
            for f in sorted([context / src] if (context / src).is_file()
                            else (context / src).rglob("*") if (context / src).is_dir() else []):
                if not f.is_file():
                    continue
                sources.update(f.read_bytes())
                got = elf_platform(f)
                wrong = [pl for pl in platforms if got and got != pl]
                if wrong:
                    return ctx.error(f"{dockerfile}: `{line.strip()}`: {f.relative_to(context)} is an "
                                     f"ELF file for {got}, but the image is for {', '.join(platforms)}: "
                                     "each platform's image needs its own binary")
    outputs = [dict(kv.split("=", 1) for kv in o.split(",") if "=" in kv)
               for o in multi(a, "-o", "--output")]
    pushed = []  # (repo, tag or None)
    if "--push" in a:
        outputs.append({"type": "registry"})
    for o in outputs:
        if o.get("type") in ("registry",) or (o.get("type") == "image" and
                                              o.get("push", "false").lower() == "true"):
            names = [n for n in o.get("name", "").split(";") if n] or tags
            if not names:
                return ctx.error("a build that pushes needs a name (-t, or name= in --output)")
            for n in names:
                if not IMAGE_REF.match(n):
                    return ctx.error(f"invalid name {n!r} in --output (docker reference format)")
                if o.get("push-by-digest", "false").lower() == "true":
                    pushed.append((ref_repo(n), None))
                else:
                    pushed.append((ref_repo(n), ref_tag(n)))
    if pushed and (code := _check_push(ctx, [r for r, _ in pushed])):
        return code
    digest = "sha256:" + hashlib.sha256("\n".join(tags + [str(dockerfile), ",".join(platforms),
                                                          json.dumps(build_args, sort_keys=True),
                                                          sources.hexdigest()]).encode()).hexdigest()
    if pushed:
        reg = ctx.registry()
        for repo, tag in pushed:
            r = reg["repos"].setdefault(repo, {"manifests": {}, "tags": {}})
            r["manifests"][digest] = {"platforms": platforms, "files": sorted(set(files)),
                                      "index": False}
            if tag:
                r["tags"][tag] = digest
        ctx.set_registry(reg)
    if mf := opt(a, "--metadata-file"):
        Path(mf).write_text(json.dumps({"containerimage.digest": digest,
                                        "image.name": ",".join(tags or [f"{r}" for r, _ in pushed])},
                                       indent=2))
    if iid := opt(a, "--iidfile"):
        Path(iid).write_text(digest)
    print(f"#1 rehearsal build of {dockerfile} ({', '.join(platforms)}) -> "
          f"{', '.join(tags) or ', '.join(r for r, _ in pushed) or '(untagged)'}\n#1 DONE")
    return 0


def multi(args, *names):
    """Every value of a repeatable flag (`--x V` or `--x=V`)."""
    out = []
    for i, x in enumerate(args):
        for n in names:
            if x == n and i + 1 < len(args):
                out.append(args[i + 1])
            elif x.startswith(n + "="):
                out.append(x.split("=", 1)[1])
    return out


def _arg_default(dockerfile_text, name):
    m = re.search(rf"^ARG\s+{name}=(\S+)", dockerfile_text, re.M)
    return m.group(1) if m else ""


def ref_repo(ref):
    """repo of repo[:tag][@digest]."""
    ref = ref.split("@", 1)[0]
    last = ref.rsplit("/", 1)[-1]
    return ref[: len(ref) - len(last)] + last.split(":", 1)[0]


def ref_tag(ref):
    base = ref.split("@", 1)[0]
    last = base.rsplit("/", 1)[-1]
    return last.split(":", 1)[1] if ":" in last else ("latest" if "@" not in ref else None)


def resolve_image(ctx, ref):
    """(repo, digest, manifest) of `ref` in the workflow's registry; None
    when the repository is not one the workflow pushed to (a public image:
    not rehearsed); False when it is, but nothing pushed this tag or digest."""
    repo = ref_repo(ref)
    r = ctx.registry()["repos"].get(repo)
    if r is None:
        return None
    if "@" in ref:
        d = ref.split("@", 1)[1]
    else:
        d = r["tags"].get(ref_tag(ref) or "latest")
    if not d or d not in r["manifests"]:
        return False
    return repo, d, r["manifests"][d]


def docker_imagetools(ctx, a):
    """`docker buildx imagetools create|inspect`: create joins images the
    workflow pushed into one index (one source that is an index already is
    copied as it is: the same digest) under the tags given, which need a
    login; inspect answers for what was pushed."""
    sub = a[0] if a else ""
    rest = a[1:]
    words = positionals(rest, {"-t", "--tag", "--annotation", "--metadata-file", "-f", "--file",
                               "--format", "--progress", "--platform", "-p", "--builder"})
    if sub == "create":
        tags = multi(rest, "-t", "--tag")
        ann = multi(rest, "--annotation")
        if not words:
            return ctx.error("imagetools create: no source image")
        found = []
        for src in words:
            f = resolve_image(ctx, src)
            if not f:
                print(f"ERROR: failed to resolve source {src}: not found", file=sys.stderr)
                return ctx.error(f"imagetools create: source {src} was not pushed by any step of this "
                                 "workflow (the digest of another image, or another repository?)")
            found.append(f)
        for t in tags:
            if not IMAGE_REF.match(t):
                return ctx.error(f"invalid tag {t!r}")
        if "--dry-run" not in rest and tags and (code := _check_push(ctx, tags)):
            return code
        prefer_index = next((x.split("=", 1)[1].lower() for x in reversed(rest)
                             if x.startswith("--prefer-index=")), "true")
        if len(found) == 1 and not ann and (found[0][2].get("index") or prefer_index == "false"):
            # One source: copied as it is (an index; or any with --prefer-index=false).
            digest, man = found[0][1], dict(found[0][2])
        else:
            digest = "sha256:" + hashlib.sha256(
                "\n".join(sorted(f[1] for f in found) + ann).encode()).hexdigest()
            man = {"platforms": sorted({pl for f in found for pl in f[2].get("platforms", [])}),
                   "files": sorted({x for f in found for x in f[2].get("files", [])}),
                   "index": True, "sources": [f[1] for f in found]}
        if "--dry-run" in rest:
            print(json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                              "manifests": [{"digest": f[1]} for f in found]}, indent=2))
            return 0
        reg = ctx.registry()
        for t in tags:
            r = reg["repos"].setdefault(ref_repo(t), {"manifests": {}, "tags": {}})
            for f in found:  # what the index names is copied into the repository
                r["manifests"].setdefault(f[1], f[2])
            r["manifests"][digest] = man
            r["tags"][ref_tag(t)] = digest
        ctx.set_registry(reg)
        if mf := opt(rest, "--metadata-file"):
            Path(mf).write_text(json.dumps({"containerimage.descriptor": {
                "mediaType": "application/vnd.oci.image.index.v1+json", "digest": digest, "size": 1024},
                "image.name": ",".join(tags)}, indent=2))
        for t in tags:
            print(f"#1 pushing {digest} to {t}\n#1 DONE", file=sys.stderr)
        return 0
    if sub == "inspect":
        if len(words) != 1:
            return ctx.error("imagetools inspect needs one image")
        f = resolve_image(ctx, words[0])
        if f is None:
            return ctx.error(f"imagetools inspect {words[0]}: not an image this workflow pushed "
                             "(the rehearsal has no network)")
        if f is False:
            print(f"ERROR: {words[0]}: not found", file=sys.stderr)
            return 1
        repo, digest, man = f
        mt = "application/vnd.oci.image.index.v1+json" if man.get("index") else \
            "application/vnd.oci.image.manifest.v1+json"
        desc = {"mediaType": mt, "digest": digest, "size": 1024}
        fmt = opt(rest, "--format")
        if fmt is None:
            if "--raw" in rest:
                print(json.dumps({"schemaVersion": 2, "mediaType": mt,
                                  "manifests": [{"digest": d} for d in man.get("sources", [])]}, indent=2))
            else:
                print(f"Name:      {words[0]}\nMediaType: {mt}\nDigest:    {digest}")
        elif re.fullmatch(r"\{\{\s*json \.Manifest\s*\}\}", fmt):
            print(json.dumps(desc))
        elif re.fullmatch(r"\{\{\s*\.Manifest\.Digest\s*\}\}", fmt):
            print(digest)
        else:
            return ctx.unknown()
        return 0
    return ctx.unknown()


def docker_create(ctx, a):
    """`docker create [--name N] [--platform P] IMAGE [CMD]`: an image the
    workflow pushed (pulled as docker would), remembered for `docker cp`."""
    flags = {"--name", "--platform", "--pull", "-e", "--env", "--entrypoint", "-v", "--volume",
             "-u", "--user", "--network", "-w", "--workdir", "-l", "--label"}
    words = positionals(a, flags)
    if not words:
        return ctx.error("docker create: no image")
    image = words[0]
    f = resolve_image(ctx, image)
    if f is False:
        print(f"Unable to find image '{image}' locally\nError response from daemon: manifest unknown",
              file=sys.stderr)
        return ctx.error(f"docker create {image}: not pushed by any step of this workflow")
    platform = opt(a, "--platform") or "linux/amd64"
    if f and platform not in f[2].get("platforms", []):
        print(f"Error response from daemon: no matching manifest for {platform} in the manifest list "
              "entries", file=sys.stderr)
        return 1
    if f is None:
        ctx.warn(f"docker create {image}: an image this workflow did not push (not rehearsed)")
    name = opt(a, "--name") or "rehearsal_" + hashlib.sha256(image.encode()).hexdigest()[:8]
    containers = ctx._load("containers.json", {})
    if name in containers:
        print(f'Error response from daemon: Conflict. The container name "/{name}" is already in use',
              file=sys.stderr)
        return 1
    containers[name] = {"image": image, "platform": platform, "files": f[2].get("files", []) if f else None}
    ctx._save("containers.json", containers)
    print(hashlib.sha256(name.encode()).hexdigest())
    return 0


def docker_cp(ctx, words):
    """`docker cp CONTAINER:PATH DEST`: PATH must be a file the image's
    Dockerfile put there; the copy of `kt` is a kt stand-in, anything else
    an ELF stub for the container's platform."""
    if len(words) != 2 or ":" not in words[0]:
        return ctx.unknown()
    name, path = words[0].split(":", 1)
    c = ctx._load("containers.json", {}).get(name)
    if c is None:
        print(f"Error response from daemon: No such container: {name}", file=sys.stderr)
        return 1
    files = c["files"]
    if files is not None and path not in files:
        print(f"Error response from daemon: Could not find the file {path} in container {name}",
              file=sys.stderr)
        return ctx.error(f"docker cp {name}:{path}: the image ({c['image']}) has no {path} "
                         f"(its Dockerfiles put {', '.join(files) or 'nothing'})")
    dest = Path(words[1])
    if dest.is_dir():
        dest = dest / Path(path).name
    if not dest.parent.is_dir():
        print(f"Error response: invalid output path: directory {dest.parent} does not exist",
              file=sys.stderr)
        return 1
    if Path(path).name == "kt":
        write_shim(ctx, dest, "kt")
    else:
        elf_stub(ctx, dest, c["platform"])
    return 0


def docker_rm(ctx, a):
    containers = ctx._load("containers.json", {})
    code = 0
    for n in positionals(a, set()):
        if n in containers:
            del containers[n]
            print(n)
        elif "-f" not in a and "--force" not in a:
            print(f"Error response from daemon: No such container: {n}", file=sys.stderr)
            code = 1
    ctx._save("containers.json", containers)
    return code


def _expand_sh(script, args, env):
    """The argv of a one-command `sh -c SCRIPT ARG0 ARGS...`: $0.. and $VAR
    (quoted or not) replaced; None when it is more than one plain command."""
    if re.search(r"[;&|<>`]|\$\(", script):
        return None

    def sub(m):
        name = m.group(1) or m.group(2)
        if name.isdigit():
            return shlex.quote(args[int(name)]) if int(name) < len(args) else "''"
        return shlex.quote(env.get(name, ""))
    text = re.sub(r'"\$\{?(\w+)\}?"|\$\{?(\w+)\}?', sub, script)
    try:
        return shlex.split(text)
    except ValueError:
        return None


def docker_exec(ctx, a):
    """`docker exec [-i] [-e VAR] NODE CMD...` into a kind/k3d node:
    `crictl pull` of an image (one the workflow pushed must be there, by the
    digest named, for the node's platform), `crictl images`, and a one-command
    `sh -c` around them."""
    i, env = 0, {}
    while i < len(a) and a[i].startswith("-"):
        x = a[i]
        if x in ("-e", "--env"):
            kv = a[i + 1]
            k, _, v = kv.partition("=")
            env[k] = v if "=" in kv else os.environ.get(k, "")
            i += 2
        elif x in ("-u", "--user", "-w", "--workdir", "--env-file"):
            i += 2
        else:
            i += 1
    if i >= len(a):
        return ctx.error("docker exec: no container")
    node, cmd = a[i], a[i + 1:]
    if node not in _docker_nodes(ctx):
        print(f"Error response from daemon: No such container: {node}", file=sys.stderr)
        return ctx.error(f"docker exec {node}: no such node container (the job's clusters: "
                         f"{', '.join(_docker_nodes(ctx)) or 'none'})")
    if cmd[:2] in (["sh", "-c"], ["bash", "-c"]) and len(cmd) > 2:
        inner = _expand_sh(cmd[2], cmd[3:], env)
        if inner is None:
            return ctx.unknown()
        cmd = inner
    if cmd[:1] == ["test"] and len(cmd) in (3, 4):
        # `test [!] -e|-d PATH` in the node's filesystem (what the
        # node-cache agents leave there).
        neg = cmd[1] == "!"
        flag, path = cmd[-2], cmd[-1]
        if flag not in ("-e", "-d", "-f"):
            return ctx.unknown()
        cluster = next((c for c in ctx.clusters("kind") + ctx.clusters("k3d")
                        if node in cluster_nodes(ctx, c)), None)
        p = node_path(ctx, cluster, node, path)
        ok = {"-e": p.exists(), "-d": p.is_dir(), "-f": p.is_file()}[flag]
        return 0 if ok != neg else 1
    if cmd[:2] == ["crictl", "pull"]:
        words = positionals(cmd[2:], {"--creds", "--auth", "-u", "--username", "-p", "--pod-config",
                                      "-a", "--annotation"})
        if len(words) != 1:
            return ctx.error(f"crictl pull needs one image, got {words}")
        creds = opt(cmd, "--creds")
        if creds is not None and ":" not in creds:
            print("crictl: invalid --creds: expected USERNAME[:PASSWORD]", file=sys.stderr)
            return ctx.error("crictl pull --creds is empty or has no ':' (is the variable passed "
                             "into the node with docker exec -e?)")
        f = resolve_image(ctx, words[0])
        if f is False:
            print(f'E0101 failed to pull image "{words[0]}": not found', file=sys.stderr)
            return ctx.error(f"crictl pull {words[0]}: not pushed by any job of this workflow "
                             "(does the bundle pin the digests the build pushed?)")
        if f and "linux/amd64" not in f[2].get("platforms", []):
            print(f'E0101 failed to pull image "{words[0]}": no match for platform in manifest',
                  file=sys.stderr)
            return 1
        if f is None:
            ctx.warn(f"crictl pull {words[0]}: an image this workflow did not push (not rehearsed)")
        pulled = ctx._load("node-images.json", {})
        pulled.setdefault(node, []).append(words[0])
        ctx._save("node-images.json", pulled)
        print(f"Image is up to date for sha256:{hashlib.sha256(words[0].encode()).hexdigest()}")
        return 0
    if cmd[:2] == ["crictl", "images"]:
        for ref in ctx._load("node-images.json", {}).get(node, []):
            print(ref)
        return 0
    return ctx.unknown()


# -- make -------------------------------------------------------------------
def make(ctx):
    """Checks the call with the real make (`make -n`, CARGO=true: nothing is
    compiled or run), then acts out the recipe lines make would run:
    cargo builds leave stub binaries under target/, `kt-scenario run`
    and `kt-scenario chaos` lines run against the stub runner (which checks
    them with the real one, see kt_scenario below), and scripts that need
    a tool require it on PATH."""
    a = ctx.args
    real = ctx.cfg["real"]["make"]
    cwd = Path(opt(a, "-C", "--directory") or ".")
    dry = subprocess.run([real, "-n", *a, "CARGO=true"], cwd=None, capture_output=True, text=True)
    if dry.returncode != 0:
        sys.stderr.write(dry.stderr)
        m = re.search(r"No rule to make target '([^']+)'", dry.stderr)
        why = f"no target {m.group(1)!r} in {cwd / 'Makefile'}" if m else dry.stderr.strip().splitlines()[-1]
        return ctx.error(f"{why} (`make {shlex.join(a)}`)", 2)
    # A goal that is no rule but an existing path (`make scenarios`: the
    # directory) makes make do nothing, successfully: never what a step means.
    idle = re.findall(r"Nothing to be done for '([^']+)'|'([^']+)' is up to date", dry.stdout + dry.stderr)
    if idle:
        goal = next(x for x in idle[0] if x)
        return ctx.error(f"{goal!r} is no target of {cwd / 'Makefile'}: make would do nothing "
                         f"(`make {shlex.join(a)}`)", 2)
    target_dir = cwd / os.environ.get("CARGO_TARGET_DIR", "target")
    lines = dry.stdout.replace("\\\n", " ").splitlines()
    for line in lines:
        code = make_recipe_line(ctx, cwd, target_dir, line)
        if code:
            return code
    print(f"make (rehearsal): {shlex.join(a)}: {len(lines)} recipe line(s) checked")
    return 0


# Scripts make recipes run, and the tools they need on PATH.
RECIPE_TOOLS = [
    (re.compile(r"testbed/images/build\.sh"), ["docker"]),
    (re.compile(r"testbed/k8s/(check|render|check-plans)\.sh"), ["kubectl"]),
    (re.compile(r"components/kt-python/build\.sh"), ["python3"]),
]


def make_recipe_line(ctx, cwd, target_dir, line):
    try:
        words = shlex.split(line)
    except ValueError:
        return 0
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words = words[1:]
    if not words:
        return 0
    if words[0] == "true":  # $(CARGO) with CARGO=true
        return cargo_check(ctx, words[1:], cwd, quiet=True)
    for pat, tools in RECIPE_TOOLS:
        if pat.search(line):
            for t in tools:
                if not shutil.which(t):
                    return ctx.error(f"tool {t} used by `{line.strip()}` (make) but never installed")
            if "kt-python/build.sh" in line:
                make_python_venv(ctx, target_dir)
            if "testbed/k8s/check" in line:
                make_k8s_pyenv(ctx, target_dir)
    exe = Path(cwd, words[0])
    if exe.is_file() and target_dir.resolve() in exe.resolve().parents:
        # A binary the recipe built: our stub, which checks the call.
        r = subprocess.run(["bash", "-c", line], cwd=cwd)
        if r.returncode:
            return ctx.error(f"the recipe `{line.strip()}` failed ({r.returncode})", r.returncode)
    return 0


def make_python_venv(ctx, target_dir):
    """What components/kt-python/build.sh leaves: target/python/bin/python."""
    bin_ = target_dir / "python" / "bin"
    bin_.mkdir(parents=True, exist_ok=True)
    write_shim(ctx, bin_ / "python", "venv-python")


def make_k8s_pyenv(ctx, target_dir):
    """What testbed/k8s/pyenv.sh (run by check.sh) leaves: target/pyenv, whose
    python has the pinned tools (PyYAML, jsonschema, kubernetes-validate):
    the rehearsal's own interpreter, which lint-workflows.sh runs from that
    venv."""
    bin_ = target_dir / "pyenv" / "bin"
    bin_.mkdir(parents=True, exist_ok=True)
    write_shim(ctx, bin_ / "python", "pyenv-python")


def pyenv_python(ctx):
    real = ctx.cfg["python"]
    os.execv(real, [real, *ctx.args])


def write_shim(ctx, path, tool, extra_env=""):
    path.write_text(f"#!/bin/bash\n# rehearsal stand-in ({tool}), written by testbed/ci/standins.py\n"
                    f"{extra_env}exec {shlex.quote(ctx.cfg['python'])} -I -S {shlex.quote(ctx.cfg['standins'])} "
                    f"{shlex.quote(str(ctx.state))} {tool} \"$@\"\n")
    path.chmod(0o755)


def venv_python(ctx):
    """target/python/bin/python, the venv `make python` builds: pip succeeds
    offline; pytest checks its paths and KT_BIN_DIR, then passes."""
    a = ctx.args
    if a[:2] == ["-m", "pip"]:
        return 0
    if a[:2] == ["-m", "pytest"]:
        paths = positionals(a[2:], {"-k", "-m", "-p", "--rootdir", "-c", "--junitxml"})
        for p in paths:
            if not Path(p.split("::")[0]).exists():
                return ctx.error(f"pytest: {p} does not exist")
        if bd := os.environ.get("KT_BIN_DIR"):
            for b in ("kt-metadata", "kt-store", "kt-agent"):
                if not (Path(bd) / b).exists():
                    return ctx.error(f"pytest: KT_BIN_DIR={bd} has no {b} (was it built?)")
        print("rehearsal stand-in pytest\n3 passed in 0.01s")
        return 0
    real = ctx.cfg["real"]["python3"]
    os.execv(real, [real, *a])


# -- the scenario runner ----------------------------------------------------
def kt_scenario(ctx):
    """A stub of a built kt-scenario (target/*/kt-scenario, left by a cargo
    build the rehearsal acted out). `run` and `chaos` are checked with the
    real runner, KT_REHEARSE_BIN_DIR/kt-scenario, given this call's
    arguments and environment, stopping before anything starts:
    `run --dry-run` (kind/k3d: the plan; other targets: refused once the
    flags and env are parsed) and `chaos --work-dir NON_EMPTY_DIR`. Then it
    writes what the real run leaves: the report directory."""
    a = ctx.args
    # None: rehearse.py has said loudly that nothing is checked.
    real = ctx.cfg.get("bin_dir") and Path(ctx.cfg["bin_dir"]) / "kt-scenario"
    cmd = a[0] if a else ""
    if cmd == "run":
        return kt_scenario_run(ctx, real, a[1:])
    if cmd == "chaos":
        return kt_scenario_chaos(ctx, real, a[1:])
    if real and cmd in ("validate", "list", "--help", "--version", "help"):
        os.execv(real, [str(real), *a])
    return 0 if not real else ctx.unknown()


def _value_flags(ctx, real, sub):
    """The flags of `kt-scenario SUB` that take a value, from its --help."""
    cache = ctx.state / f"kt-scenario-{sub}-flags.json"
    if cache.exists():
        return set(json.loads(cache.read_text()))
    out = subprocess.run([str(real), sub, "--help"], capture_output=True, text=True).stdout
    flags = set()
    for m in re.finditer(r"^\s+(?:(-\w), )?(--[\w-]+) <", out, re.M):
        flags.update(f for f in m.groups() if f)
    cache.write_text(json.dumps(sorted(flags)))
    return flags


def _run_real(ctx, argv, timeout=60):
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        ctx.error(f"`{shlex.join(argv)}` did not stop within {timeout}s: the rehearsal's "
                  "check of the runner needs updating (standins.py)")
        return None


def kt_scenario_run(ctx, real, a):
    report = opt(a, "--report") or os.environ.get("KT_SCENARIO_REPORT") or "target/scenario-report"
    target = opt(a, "--target") or os.environ.get("KT_SCENARIO_TARGET") or "local"
    if real:
        vf = _value_flags(ctx, real, "run")
        cluster = target in ("kind", "k3d")
        # On a cluster target the plan is of one scenario (make cluster-plans
        # plans them all); the paths given must exist all the same.
        args, it, replaced = [], iter(a), False
        for x in it:
            if x.startswith("-"):
                args.append(x)
                if x in vf:
                    args.append(next(it, ""))
            elif not Path(x).exists():
                return ctx.error(f"kt-scenario run: {x}: no such file or directory", 2)
            elif not cluster:
                args.append(x)
            elif not replaced:
                args.append(PLAN_SCENARIO)
                replaced = True
        if cluster and not replaced:
            args.insert(0, PLAN_SCENARIO)
        argv = [str(real), "run", *args] + ([] if "--dry-run" in args else ["--dry-run"])
        r = _run_real(ctx, argv)
        if r is None:
            return 1
        out = r.stdout + r.stderr
        if cluster:
            if r.returncode != 0 or re.search(r"^# failed", r.stdout, re.M):
                sys.stderr.write(out[-3000:])
                return ctx.error(f"the runner refused `kt-scenario run {shlex.join(a)}` "
                                 f"(checked as `{shlex.join(argv[1:])}`): "
                                 f"{_why(r.stderr or r.stdout)}", 2)
            plan_tools(ctx, target, r.stdout)
        elif r.returncode == 0 or NOT_PLANNABLE not in out:
            sys.stderr.write(out[-3000:])
            return ctx.error(f"the runner refused `kt-scenario run {shlex.join(a)}`: "
                             f"{_why(r.stderr or r.stdout)}", 2)
    elif target in ("kind", "k3d"):
        # Unchecked: the cluster the real run would make, for later steps.
        name = os.environ.get("KT_CLUSTER") or "kt-scenario"
        remember_testbed_cluster(ctx, target, name)
    d = Path(report)
    d.mkdir(parents=True, exist_ok=True)
    content = {
        "report.json": json.dumps({"rehearsal": True, "target": target, "scenarios": []}),
        "junit.xml": f'<?xml version="1.0" encoding="UTF-8"?>\n<testsuites name="kt-scenario '
                     f'{target} (rehearsal)" tests="0" failures="0"/>\n',
        "report.html": "<!doctype html><title>rehearsal</title>\n",
    }
    for name in REPORT_FILES:
        (d / name).write_text(content[name])
    print(f"kt-scenario (rehearsal): run on {target}: arguments and environment accepted by the runner"
          if real else f"kt-scenario (rehearsal): run on {target}: NOT checked (no runner binary)")
    print(f"reports: {d / 'report.html'}", file=sys.stderr)
    return 0


def plan_tools(ctx, flavor, plan):
    """The clusters a plan creates are remembered (later steps' kind/k3d/
    kubectl calls find them), and the tools its commands run must be on
    PATH, as the real run needs them."""
    created = re.findall(r"\bkind create cluster\b.*?--name[= ](\S+)", plan) + \
        re.findall(r"\bk3d cluster create (\S+)", plan)
    for name in created:
        remember_testbed_cluster(ctx, flavor, name)
    if not created:
        # An existing cluster is used (and kept): a later dump finds it.
        name = os.environ.get("KT_CLUSTER") or "kt-scenario"
        remember_testbed_cluster(ctx, flavor, name)
    # The cluster targets create clusters with kind/k3d, load the images
    # from the Docker engine and deploy with kubectl.
    for tool in (flavor, "kubectl", "docker"):
        if not shutil.which(tool):
            ctx.error(f"tool {tool} used by the runner's {flavor} target but never installed")


def kt_scenario_chaos(ctx, real, a):
    if not real:
        return 0
    full = tempfile.mkdtemp(dir=ctx.scratch())
    Path(full, "not-empty").write_text("the rehearsal's check: chaos stops here\n")
    args, skip = [], False
    for x in a:  # our --work-dir replaces any given one
        if skip:
            skip = False
        elif x == "--work-dir":
            skip = True
        elif not x.startswith("--work-dir="):
            args.append(x)
    argv = [str(real), "chaos", *args, "--work-dir", full]
    r = _run_real(ctx, argv, timeout=30)
    if r is None:
        return 1
    if CHAOS_WORK_DIR_NOT_EMPTY not in r.stderr:
        sys.stderr.write((r.stdout + r.stderr)[-3000:])
        return ctx.error(f"the runner refused `kt-scenario chaos {shlex.join(a)}`: "
                         f"{_why(r.stderr or r.stdout)}", 2)
    print("kt-scenario (rehearsal): chaos: arguments and environment accepted by the runner")
    return 0


def _why(text):
    """The line of the runner's output that says what it refused: its first
    `error` line (clap's `error: invalid value ...`), else the last one."""
    lines = [x.strip() for x in text.strip().splitlines() if x.strip()]
    return next((x for x in lines if re.search(r"\berror\b", x, re.I)), lines[-1] if lines else "(no output)")


# -- kt ---------------------------------------------------------------------
# kt's CLI (components/kt-client/src/cli.rs): global flags with a value, and
# each subcommand's.
KT_GLOBAL_VALUE = {"--metadata-url", "--token", "--token-file", "--streams", "--deadline",
                   "--stall-timeout", "--progress", "--kubeconfig", "--context", "--namespace"}
KT_GLOBAL_BOOL = {"--kube"}
KT_SUB = {
    "put": ({"--src", "--locale", "--lifespan", "--ttl", "--service", "-o", "--output"}, set()),
    "get": ({"--dest", "--group", "--fanout", "--timeout", "-o", "--output"},
            {"--delete", "--no-serve", "--broadcast"}),
    "ls": ({"-o", "--output"}, set()),
    "teardown": (set(), set()),
    "rm": (set(), {"-r", "--recursive"}),
}
KT_CHOICES = {("put", "--locale"): ("store", "local"), ("put", "--lifespan"): ("cluster", "resource"),
              ("put", "-o"): ("text", "json"), ("get", "-o"): ("text", "json"),
              ("ls", "-o"): ("table", "wide", "json", "yaml")}
BOOLISH = {"1", "0", "true", "false", "t", "f", "yes", "no", "y", "n", "on", "off"}


def kt_usage(ctx, msg):
    """What clap says (exit 2): a call kt refuses is a glue error."""
    print(f"error: {msg}\n\nFor more information, try '--help'.", file=sys.stderr)
    return ctx.error(f"kt refuses `kt {shlex.join(ctx.args)}`: {msg}", 2)


def kt_parse(ctx, args):
    """(subcommand, {flag: value}, [positionals]) or an exit status."""
    flags, pos, sub, i = {}, [], None, 0
    while i < len(args):
        x = args[i]
        name, eq, val = x.partition("=") if x.startswith("--") else (x, "", "")
        if x == "--version" and sub is None:
            print("kt 0.1.0 (rehearsal stand-in)")
            return 0
        if x in ("-h", "--help"):
            print("kt (rehearsal stand-in)")
            return 0
        takes, bools = KT_SUB.get(sub, (set(), set()))
        if name in KT_GLOBAL_VALUE or name in takes:
            if not eq:
                if i + 1 >= len(args):
                    return kt_usage(ctx, f"a value is required for '{name} <VALUE>' but none was supplied")
                val = args[i + 1]
                i += 1
            flags["-o" if name == "--output" else name] = val
        elif name in KT_GLOBAL_BOOL or name in bools:
            flags["-r" if name == "--recursive" else name] = True
        elif x.startswith("-") and x != "-":
            return kt_usage(ctx, f"unexpected argument '{x}' found")
        elif sub is None:
            if x not in KT_SUB:
                if x == "tensor":
                    return ctx.unknown()
                return kt_usage(ctx, f"unrecognized subcommand '{x}'")
            sub = x
        else:
            pos.append(x)
        i += 1
    if sub is None:
        return kt_usage(ctx, "'kt' requires a subcommand but one was not provided")
    for (s_, f), choices in KT_CHOICES.items():
        if s_ == sub and f in flags and flags[f] not in choices:
            return kt_usage(ctx, f"invalid value '{flags[f]}' for '{f}' "
                                 f"[possible values: {', '.join(choices)}]")
    if sub == "get" and not flags.get("--broadcast"):
        for f in ("--group", "--fanout", "--timeout"):
            if f in flags:
                return kt_usage(ctx, f"the following required arguments were not provided: --broadcast "
                                     f"(needed by {f})")
    need = {"put": ["--src"], "get": ["--dest"]}.get(sub, [])
    for f in need:
        if f not in flags:
            return kt_usage(ctx, f"the following required arguments were not provided: {f} <"
                                 f"{f.strip('-').upper()}>")
    want = 0 if sub == "ls" else 1
    if (sub == "ls" and len(pos) > 1) or (sub != "ls" and len(pos) != want):
        return kt_usage(ctx, f"kt {sub} takes {'at most one' if sub == 'ls' else 'one'} "
                             f"positional argument, got {pos}")
    kube_env = os.environ.get("KT_KUBE")
    if kube_env is not None and kube_env.lower() not in BOOLISH:
        return kt_usage(ctx, f"invalid value '{kube_env}' for '--kube' (KT_KUBE)")
    return sub, flags, pos


def _key_ok(key, prefix=False):
    k = key.strip("/")
    if not k:
        return prefix
    return all(seg and seg not in (".", "..") for seg in k.split("/")) and len(k) <= 1024


def kt_main(ctx, args, pod=None):
    """The kt CLI against a store kept in the rehearsal (per cluster and
    namespace): in a pod (kubectl exec) with the pod's service rights and
    filesystem, or outside with --kube (the kubeconfig's live cluster, a
    namespace where kt is installed). put/get/ls/rm/teardown, broadcast
    gets with ranks handed out as getters join; `kt dataset ...` is
    kt_dataset's."""
    words = positionals(args, KT_GLOBAL_VALUE)
    if words[:1] == ["dataset"]:
        if pod is not None:
            return ctx.unknown()
        return kt_dataset(ctx, args)
    got = kt_parse(ctx, args)
    if isinstance(got, int):
        return got
    sub, flags, pos = got
    kube = bool(flags.get("--kube")) or (os.environ.get("KT_KUBE", "").lower() in
                                         ("1", "true", "t", "yes", "y", "on"))
    if pod is not None:
        cluster, ns = pod["cluster"], pod["namespace"]
        if kube:
            print("kt: --kube: no kubeconfig in the pod", file=sys.stderr)
            return 1
    else:
        if not kube:
            url = flags.get("--metadata-url") or os.environ.get("KT_METADATA_URL") or "http://127.0.0.1:8081"
            print(f"kt: cannot reach the metadata server at {url}: connection refused "
                  "(outside a cluster: --kube)", file=sys.stderr)
            return 1
        if flags.get("--kubeconfig"):
            os.environ["KUBECONFIG"] = flags["--kubeconfig"]
        saved, ctx.args = ctx.args, []
        cluster = _kubeconfig_cluster(ctx)
        ctx.args = saved
        if cluster is None:
            return 1
        ns = flags.get("--namespace") or os.environ.get("KT_NAMESPACE") or "default"
        if sub == "put" and flags.get("--locale") == "local":
            print("kt: --kube: a --locale local put is served by the pod's node agent; run it in a pod",
                  file=sys.stderr)
            return 1
        if sub == "get" and flags.get("--broadcast"):
            print("kt: --kube: a broadcast getter serves its children from its pod; run it in a pod",
                  file=sys.stderr)
            return 1
    if _find(ctx, cluster, ns, "Deployment", "kt-metadata") is None:
        where = f"namespace {ns!r} of cluster {cluster}"
        print(f"kt: no kt-metadata in {where} (is kt installed there?"
              f"{' --namespace?' if pod is None else ''})", file=sys.stderr)
        return 1
    store = ctx.state / "kt-store" / cluster / ns
    store.mkdir(parents=True, exist_ok=True)

    def local(p):
        return pod["fs"].path(p) if pod else Path(p)

    def may_write(service):
        if pod and service != pod["service"]:
            print(f"kt: forbidden: this token may not write service {service!r} (its pod's service is "
                  f"{pod['service']!r})", file=sys.stderr)
            return False
        return True

    def summary(op, key, files, size, extra=None):
        if flags.get("-o") == "json":
            d = {"op": op, "key": key, "files": files, "files_sent": files, "bytes_sent": size,
                 "bytes_skipped": 0, "unchanged": False, "seconds": 0.01, **(extra or {})}
            print(json.dumps(d))
        else:
            print(f"{op} {key}: {files} of {files} files sent ({size} B), 0 B skipped as unchanged, in 0.01s")

    with ctx.locked("kt", store):
        index_path = store / "keys.json"
        index = json.loads(index_path.read_text()) if index_path.exists() else {}
        if sub == "put":
            key = pos[0].strip("/")
            if not _key_ok(key):
                print(f"kt: invalid key {pos[0]!r}", file=sys.stderr)
                return 1
            service = flags.get("--service") or key.split("/")[0]
            if not may_write(service):
                return 1
            src = local(flags["--src"])
            if not src.exists():
                print(f"kt: {flags['--src']}: No such file or directory", file=sys.stderr)
                return 1
            data = store / "data" / key
            shutil.rmtree(data, ignore_errors=True)
            data.parent.mkdir(parents=True, exist_ok=True)
            if src.is_dir():
                shutil.copytree(src, data)
                files = [f for f in data.rglob("*") if f.is_file()]
            else:
                shutil.copy2(src, data)
                files = [data]
            # kt's lifespan rule: left out, `resource` under a known
            # service's base path (here: the calling pod's service) and for
            # zero-copy data, else `cluster`.
            locale = flags.get("--locale", "store")
            by_rule = "--lifespan" not in flags
            under_own = pod is not None and key.split("/", 1)[0] == pod["service"]
            lifespan = flags.get("--lifespan") or (
                "resource" if locale == "local" or under_own else "cluster")
            index[key] = {"service": service, "lifespan": lifespan, "by_rule": by_rule,
                          "locale": locale, "is_dir": src.is_dir(),
                          "files": len(files), "size": sum(f.stat().st_size for f in files)}
            index_path.write_text(json.dumps(index, indent=1))
            summary("put", key, len(files), index[key]["size"])
            return 0
        if sub == "get":
            key = pos[0]
            keys = [k for k in index if k.startswith(key.strip("/") + "/")] if key.endswith("/") \
                else ([key.strip("/")] if key.strip("/") in index else [])
            if not keys:
                print(f"kt: not_found: no key {key!r}", file=sys.stderr)
                return 1
            dest = local(flags["--dest"])
            if pod and not pod["fs"].writable(flags["--dest"]):
                print(f"kt: {flags['--dest']}: Read-only file system", file=sys.stderr)
                return 1
            extra = {"dest": flags["--dest"]}
            if flags.get("--broadcast"):
                bc_path = store / "broadcasts.json"
                bcs = json.loads(bc_path.read_text()) if bc_path.exists() else {}
                group = flags.get("--group") or f"{key}-open"
                g = bcs.setdefault(group, {"fanout": int(flags.get("--fanout") or 50), "ranks": 0,
                                           "key": key})
                if g["key"] != key:
                    print(f"kt: conflict: broadcast group {group!r} is of key {g['key']!r}", file=sys.stderr)
                    return 1
                g["ranks"] += 1
                rank = g["ranks"]
                bc_path.write_text(json.dumps(bcs, indent=1))
                extra["broadcast"] = {"group": group, "rank": rank,
                                      "parents": [(rank - 1) // g["fanout"]], "relayed": 0}
            total_files, total_size = 0, 0
            for k in keys:
                src = store / "data" / k
                below = k[len(key.strip("/")) + 1:] if key.endswith("/") else ""
                if index[k]["is_dir"]:
                    target = dest / below if below else dest
                    if flags.get("--delete"):
                        shutil.rmtree(target, ignore_errors=True)
                    shutil.copytree(src, target, dirs_exist_ok=True)
                else:
                    target = dest / below if below else (dest / Path(k).name if dest.is_dir() else dest)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, target)
                total_files += index[k]["files"]
                total_size += index[k]["size"]
            summary("get", key, total_files, total_size, extra)
            return 0
        if sub == "ls":
            prefix = (pos[0] if pos else "").strip("/")
            below = {}
            for k in sorted(index):
                if prefix and not k.startswith(prefix + "/"):
                    continue
                rest = k[len(prefix) + 1:] if prefix else k
                seg = rest.split("/")[0]
                full = f"{prefix}/{seg}" if prefix else seg
                e = below.setdefault(seg, {"name": seg, "key": full, "has_children": False})
                if rest == seg:
                    r = index[k]
                    e["record"] = {"key": k, "locale": r["locale"], "lifespan": r["lifespan"],
                                   "size": r["size"], "files": r["files"], "is_dir": r["is_dir"]}
                else:
                    e["has_children"] = True
            entries = list(below.values())
            if flags.get("-o") == "json":
                print(json.dumps(entries))
            elif flags.get("-o") == "yaml":
                for e in entries:
                    print(f"- name: {e['name']}\n  key: {e['key']}")
            else:
                print("NAME  TYPE  LOCALE  SIZE  LIFESPAN")
                for e in entries:
                    r = e.get("record")
                    if r:
                        print(f"{e['name']}  {'dir' if r['is_dir'] else 'file'}  {r['locale']}  "
                              f"{r['size']} B  {r['lifespan']}")
                    if e["has_children"]:
                        print(f"{e['name']}/  prefix")
            return 0
        if sub == "rm":
            key = pos[0].strip("/")
            if not may_write(key.split("/")[0]):
                return 1
            gone = [k for k in index if k == key or (flags.get("-r") and k.startswith(key + "/"))]
            if not gone:
                print(f"kt: not_found: no key {key!r}", file=sys.stderr)
                return 1
            for k in gone:
                del index[k]
                shutil.rmtree(store / "data" / k, ignore_errors=True)
                (store / "data" / k).unlink(missing_ok=True)
            index_path.write_text(json.dumps(index, indent=1))
            print(f"deleted {len(gone)} key(s)")
            return 0
        if sub == "teardown":
            service = pos[0]
            if not may_write(service):
                return 1
            # Its resource keys, and its base path but keys put with an
            # explicit lifespan=cluster.
            gone = [k for k, r in index.items()
                    if (r["service"] == service and r["lifespan"] == "resource")
                    or (k.split("/", 1)[0] == service
                        and not (r["lifespan"] == "cluster" and not r.get("by_rule", False)))]
            for k in gone:
                del index[k]
                shutil.rmtree(store / "data" / k, ignore_errors=True)
                (store / "data" / k).unlink(missing_ok=True)
            index_path.write_text(json.dumps(index, indent=1))
            print(f"teardown {service}: {len(gone)} key(s) deleted")
            return 0
    return ctx.unknown()


# -- datasets: the Dataset controller and node-cache agents, acted out -------
# testbed/datasets/on-cluster.sh drives them with `kt dataset`, kubectl and
# docker; the stand-ins below settle a Dataset at once, as the controller
# would in the end (components/kt-dataset/src/reconcile.rs): a key source
# that exists (in the store of the namespace running kt-dataset-controller)
# is placed on `replicas` nodes with a node-cache pod, which get the label
# data.kt.dev/<ns>.<name>=<version> and a copy under the node's
# /var/lib/kt/datasets; a missing key is Failed (KeyNotFound, one Warning
# event); an S3 source is read from a MinIO container of `docker run`, only
# when a NetworkPolicy lets the controller reach it and the credentials
# Secret matches the server's.
DATASET_ROOT = "/var/lib/kt/datasets"
CRD_NAME = "datasets.kt.dev"


def cluster_nodes(ctx, cluster):
    """The cluster's node names: kind's containers, or k3d's."""
    kind_nodes = ctx._load("kind-nodes.json", {})
    if cluster in kind_nodes:
        return kind_nodes[cluster]
    k3d_nodes = ctx._load("k3d-nodes.json", {})
    return k3d_nodes.get(cluster) or [f"{cluster}-control-plane"]


def schedulable_nodes(ctx, cluster):
    """Where an untolerating pod may run: kind taints its control plane
    when it has workers; k3s taints none."""
    names = cluster_nodes(ctx, cluster)
    workers = [n for n in names if "control-plane" not in n]
    return sorted(workers or names)


def node_labels(ctx, cluster):
    labels = ctx._load("node-labels.json", {}).get(cluster, {})
    return {n: {"kubernetes.io/hostname": n, **labels.get(n, {})} for n in cluster_nodes(ctx, cluster)}


def set_node_label(ctx, cluster, node, key, value):
    all_ = ctx._load("node-labels.json", {})
    mine = all_.setdefault(cluster, {}).setdefault(node, {})
    if value is None:
        mine.pop(key, None)
    else:
        mine[key] = value
    ctx._save("node-labels.json", all_)


def node_path(ctx, cluster, node, p):
    return ctx.state / "nodes" / cluster / node / str(p).lstrip("/")


def pod_node(ctx, cluster, obj, index=0):
    """The node a pod of `obj` runs on: a DaemonSet's i-th schedulable
    node; else the first node meeting its required node affinity (None:
    none does, the pod stays Pending)."""
    nodes = schedulable_nodes(ctx, cluster)
    if obj["kind"] == "DaemonSet":
        return nodes[index] if index < len(nodes) else None
    labels = node_labels(ctx, cluster)
    fits = [n for n in nodes if all(k in labels[n] for k in obj.get("affinityExists", []))]
    return fits[0] if fits else None


def dataset_state(ctx):
    return ctx._load("datasets.json", {})


def record_event(ctx, cluster, ns, kind, name, type_, reason, message):
    events = ctx._load("events.json", {})
    events.setdefault(cluster, []).append({"namespace": ns, "kind": kind, "name": name, "type": type_,
                                           "reason": reason, "message": message})
    ctx._save("events.json", events)


def controller_namespace(ctx, cluster):
    c = next((o for o in k8s_objects(ctx, cluster)
              if o["kind"] == "Deployment" and o["name"] == "kt-dataset-controller"), None)
    return c["namespace"] if c else None


def _ip_in(ip, cidr):
    import ipaddress
    try:
        return ipaddress.ip_address(ip) in ipaddress.ip_network(cidr, strict=False)
    except ValueError:
        return False


def controller_may_reach(ctx, cluster, ns, ip, port):
    """Whether a NetworkPolicy of the controller's namespace that selects
    its pods allows egress to ip:port (its own policy allows 443 and 6443
    only)."""
    ctrl = _find(ctx, cluster, ns, "Deployment", "kt-dataset-controller")
    for o in k8s_objects(ctx, cluster):
        if o["kind"] != "NetworkPolicy" or o["namespace"] != ns:
            continue
        spec = o.get("spec") or {}
        want = (spec.get("podSelector") or {}).get("matchLabels") or {}
        if any(ctrl["podLabels"].get(k) != v for k, v in want.items()):
            continue
        for rule in spec.get("egress") or []:
            ports = [p.get("port") for p in rule.get("ports") or []]
            if ports and port not in ports:
                continue
            for peer in rule.get("to") or []:
                cidr = (peer.get("ipBlock") or {}).get("cidr")
                if cidr and _ip_in(ip, cidr):
                    return True
    return False


def secret_data(ctx, cluster, ns, name):
    import base64
    s = _find(ctx, cluster, ns, "Secret", name)
    if s is None:
        return None
    out = {k: base64.b64decode(v).decode() for k, v in (s.get("data") or {}).items()}
    out.update(s.get("stringData") or {})
    return out


def minio_at(ctx, network=None, ip=None, host_port=None):
    for name, c in ctx._load("containers.json", {}).items():
        if not c.get("run") or "minio" not in c["image"]:
            continue
        if (ip is None or (c["ip"] == ip and c["network"] == network)) and \
                (host_port is None or c.get("host_port") == host_port):
            return name, c
    return None, None


def settle_dataset(ctx, cluster, ns, ds):
    """The controller's end state for `ds` (its spec; status set here)."""
    name, spec = ds["metadata"]["name"], ds["spec"]
    ctrl_ns = controller_namespace(ctx, cluster)
    status = {"phase": "Pending", "reason": "ControllerNotRunning", "readyNodes": 0,
              "observedGeneration": ds["metadata"]["generation"]}
    ds["status"] = status
    if ctrl_ns is None:
        return
    store = ctx.state / "kt-store" / cluster / ctrl_ns
    store.mkdir(parents=True, exist_ok=True)
    index_path = store / "keys.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else {}
    src = spec["source"]

    def fail(reason, message):
        status.update(phase="Failed", reason=reason, message=message)
        record_event(ctx, cluster, ns, "Dataset", name, "Warning", reason, message)

    if "key" in src:
        key = src["key"].strip("/")
        if key not in index:
            return fail("KeyNotFound", f"key {key!r} not found")
    elif "s3" in src:
        s3 = src["s3"]
        m = re.fullmatch(r"https?://([0-9.]+):(\d+)/?", s3.get("endpoint") or "")
        if not m:
            return fail("S3Unavailable", f"endpoint {s3.get('endpoint')!r}: the rehearsal knows "
                                         "MinIO containers by IP only")
        ip, port = m.group(1), int(m.group(2))
        network = "kind" if cluster in ctx.clusters("kind") else f"k3d-{cluster}"
        mname, minio = minio_at(ctx, network=network, ip=ip)
        if minio is None or port != 9000:
            status.update(phase="Ingesting", reason="S3Unavailable",
                          message=f"{ip}:{port}: connection refused")
            return
        if not controller_may_reach(ctx, cluster, ctrl_ns, ip, port):
            status.update(phase="Ingesting", reason="S3Unavailable",
                          message=f"{ip}:{port}: timed out (no NetworkPolicy lets the controller reach it)")
            return
        creds = secret_data(ctx, cluster, ns, s3.get("credentialsSecret") or "")
        env = minio["env"]
        if not creds or creds.get("AWS_ACCESS_KEY_ID") != env.get("MINIO_ROOT_USER") or \
                creds.get("AWS_SECRET_ACCESS_KEY") != env.get("MINIO_ROOT_PASSWORD"):
            return fail("S3AccessDenied", "InvalidAccessKeyId (the credentials Secret is not MinIO's)")
        bucket = ctx.state / "s3" / mname / s3["bucket"]
        prefix = (s3.get("prefix") or "").strip("/")
        base = bucket / prefix if prefix else bucket
        if not base.is_dir() or not any(base.rglob("*")):
            return fail("S3Empty", f"no object under s3://{s3['bucket']}/{prefix}")
        key = f"datasets/{ns}/{name}"
        data = store / "data" / key
        shutil.rmtree(data, ignore_errors=True)
        data.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(base, data)
        files = [f for f in data.rglob("*") if f.is_file()]
        index[key] = {"service": "datasets", "lifespan": "cluster", "by_rule": False, "locale": "store",
                      "is_dir": True, "files": len(files), "size": sum(f.stat().st_size for f in files)}
        index_path.write_text(json.dumps(index, indent=1))
    else:
        return fail("Unsupported", "the rehearsal acts out key and S3 sources")
    rec = index[key]
    version = hashlib.sha256(json.dumps(rec, sort_keys=True).encode()).hexdigest()[:26].upper()
    cache = next((o for o in k8s_objects(ctx, cluster)
                  if o["kind"] == "DaemonSet" and o["namespace"] == ctrl_ns
                  and o["podLabels"].get("app.kubernetes.io/component") == "node-cache"), None)
    nodes = schedulable_nodes(ctx, cluster) if cache else []
    want = int((spec.get("placement") or {}).get("replicas") or 1)
    if len(nodes) < want:
        status.update(phase="Pending", reason="InsufficientNodes",
                      message=f"{len(nodes)} node(s) with a node-cache agent, {want} wanted")
        record_event(ctx, cluster, ns, "Dataset", name, "Warning", "InsufficientNodes", status["message"])
        return
    label = f"data.kt.dev/{ns}.{name}"
    chosen = nodes[:want]
    for n in chosen:
        dest = node_path(ctx, cluster, n, f"{DATASET_ROOT}/{ns}/{name}")
        shutil.rmtree(dest, ignore_errors=True)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(store / "data" / key, dest)
        set_node_label(ctx, cluster, n, label, version)
    status.update(phase="Ready", reason="Ready", message=f"held by {want} node(s)", version=version,
                  bytes=rec["size"], readyNodes=want,
                  nodes=[{"name": n, "state": "Ready", "version": version, "bytes": rec["size"],
                          "path": f"{DATASET_ROOT}/{ns}/{name}"} for n in chosen])


def unplace_dataset(ctx, cluster, ns, name):
    label = f"data.kt.dev/{ns}.{name}"
    for n in cluster_nodes(ctx, cluster):
        set_node_label(ctx, cluster, n, label, None)
        shutil.rmtree(node_path(ctx, cluster, n, f"{DATASET_ROOT}/{ns}/{name}"), ignore_errors=True)


KT_DATASET_SUB = {
    "apply": ({"--key", "--s3", "--endpoint", "--region", "--credentials-secret", "--pvc", "--replicas",
               "--node-selector", "--path", "--version", "--interval", "--wait", "--timeout", "-f",
               "--filename"}, {"--retain"}),
    "get": ({"-o", "--output", "--wait", "--timeout"}, set()),
    "ls": ({"-o", "--output"}, set()),
    "rm": ({"--timeout"}, {"--wait"}),
}
PHASES = ("Pending", "Ingesting", "Seeding", "Ready", "Failed")


def kt_dataset(ctx, args):
    """`kt [--kubeconfig K] [--namespace NS] dataset apply|get|ls|rm ...`
    (components/kt-client/src/dataset_cli.rs) against the kubeconfig's
    rehearsal cluster, the controller acted out (settle_dataset)."""
    flags, pos, sub, i, seen = {}, [], None, 0, False
    while i < len(args):
        x = args[i]
        name, eq, val = x.partition("=") if x.startswith("--") else (x, "", "")
        takes, bools = KT_DATASET_SUB.get(sub, (set(), set()))
        if name in KT_GLOBAL_VALUE or name in takes:
            if not eq:
                if i + 1 >= len(args):
                    return kt_usage(ctx, f"a value is required for '{name} <VALUE>' but none was supplied")
                val = args[i + 1]
                i += 1
            flags[{"--output": "-o", "--filename": "-f"}.get(name, name)] = val
        elif name in KT_GLOBAL_BOOL or name in bools:
            flags[name] = True
        elif x.startswith("-"):
            return kt_usage(ctx, f"unexpected argument '{x}' found")
        elif not seen:
            seen = True  # `dataset`
        elif sub is None:
            if x not in KT_DATASET_SUB:
                return kt_usage(ctx, f"unrecognized subcommand '{x}'")
            sub = x
        else:
            pos.append(x)
        i += 1
    if sub is None:
        return kt_usage(ctx, "'kt dataset' requires a subcommand but one was not provided")
    if "--wait" in flags and sub in ("apply", "get") and flags["--wait"] not in PHASES:
        return kt_usage(ctx, f"invalid value '{flags['--wait']}' for '--wait <WAIT>': "
                             f"{flags['--wait']!r} is not a phase")
    if "--timeout" in flags and not re.fullmatch(r"(\d+(ms|s|m|h)\s*)+", flags["--timeout"]):
        return kt_usage(ctx, f"invalid value '{flags['--timeout']}' for '--timeout <TIMEOUT>'")
    if "-o" in flags and flags["-o"] not in ("text", "json", "yaml"):
        return kt_usage(ctx, f"invalid value '{flags['-o']}' for '--output <OUTPUT>'")
    if sub in ("get", "rm") and len(pos) != 1 or sub == "ls" and pos or sub == "apply" and len(pos) > 1:
        return kt_usage(ctx, f"kt dataset {sub}: unexpected arguments {pos}")
    if flags.get("--kubeconfig"):
        os.environ["KUBECONFIG"] = flags["--kubeconfig"]
    saved, ctx.args = ctx.args, []
    cluster = _kubeconfig_cluster(ctx)
    ctx.args = saved
    if cluster is None:
        return 1
    ns = flags.get("--namespace") or os.environ.get("KT_NAMESPACE") or "default"
    crd = _find(ctx, cluster, None, "CustomResourceDefinition", CRD_NAME)
    if crd is None:
        print("Error: list datasets: ApiError: 404 page not found (the CRD datasets.kt.dev is not "
              "installed)", file=sys.stderr)
        return 1
    with ctx.locked("datasets"):
        state = dataset_state(ctx)
        mine = state.setdefault(cluster, {})
        key = lambda n: f"{ns}/{n}"  # noqa: E731
        if sub == "apply":
            if "-f" in flags:
                return ctx.unknown()
            if not pos:
                return kt_usage(ctx, "name a dataset, or give its manifests with -f")
            name = pos[0]
            sources = [s for s in ("--key", "--s3", "--pvc") if s in flags]
            if len(sources) != 1:
                print("Error: a dataset has one source: give one of --key, --s3, --pvc", file=sys.stderr)
                return 1
            if sources[0] != "--s3" and any(f in flags for f in ("--endpoint", "--region",
                                                                  "--credentials-secret")):
                print("Error: --endpoint, --region and --credentials-secret are for --s3 sources",
                      file=sys.stderr)
                return 1
            if "--s3" in flags:
                m = re.fullmatch(r"s3://([^/]+)/?(.*)", flags["--s3"])
                if not m:
                    print(f"Error: {flags['--s3']!r}: an S3 source is s3://BUCKET[/PREFIX]", file=sys.stderr)
                    return 1
                source = {"s3": {"bucket": m.group(1), "prefix": m.group(2), "endpoint": flags.get("--endpoint"),
                                 "region": flags.get("--region"),
                                 "credentialsSecret": flags.get("--credentials-secret")}}
            elif "--key" in flags:
                source = {"key": flags["--key"]}
            else:
                source = {"pvc": {"claimName": flags["--pvc"]}}
            old = mine.get(key(name))
            gen = (old["metadata"]["generation"] + 1) if old else 1
            ds = {"apiVersion": "kt.dev/v1alpha1", "kind": "Dataset",
                  "metadata": {"name": name, "namespace": ns, "generation": gen},
                  "spec": {"source": source, "placement": {"replicas": int(flags.get("--replicas") or 1)}}}
            if old:
                unplace_dataset(ctx, cluster, ns, name)
            settle_dataset(ctx, cluster, ns, ds)
            mine[key(name)] = ds
            ctx._save("datasets.json", state)
            print(f"dataset {name} applied (generation {gen})")
        else:
            name = pos[0] if pos else None
            ds = mine.get(key(name)) if name else None
            if sub in ("get", "rm") and ds is None:
                print(f"Error: dataset {name!r} not found in namespace {ns!r}", file=sys.stderr)
                return 1
            if sub == "ls":
                print("NAME  PHASE  VERSION  READY  BYTES  REASON")
                for k, d in sorted(mine.items()):
                    if k.startswith(ns + "/"):
                        st = d["status"]
                        print(f"{d['metadata']['name']}  {st['phase']}  {st.get('version', '-')}  "
                              f"{st['readyNodes']}  {st.get('bytes', '-')}  {st.get('reason', '')}")
                return 0
            if sub == "rm":
                unplace_dataset(ctx, cluster, ns, name)
                del mine[key(name)]
                ctx._save("datasets.json", state)
                print(f"dataset {name} {'deleted' if flags.get('--wait') else 'deleting'}")
                return 0
        # apply/get: --wait, then the dataset.
        st = ds["status"]
        want = flags.get("--wait")
        if want and st["phase"] != want:
            if st["phase"] == "Failed":
                print(f"Error: dataset {name!r} failed: {st['reason']}", file=sys.stderr)
            else:
                print(f"Error: dataset {name!r} is {st['phase']} ({st['reason']}) after "
                      f"{flags.get('--timeout', '10m')}, not {want}", file=sys.stderr)
            return 1
        if sub == "get" and flags.get("-o") == "json":
            print(json.dumps(ds, indent=2))
        elif sub == "get" and flags.get("-o") == "yaml":
            return ctx.unknown()
        elif sub == "get" or want:
            print(f"{name}: {st['phase']} ({st['reason']}) — {st['readyNodes']}/"
                  f"{ds['spec']['placement']['replicas']} nodes, version {st.get('version', '-')}")
    return 0


def curl(ctx):
    """curl to a MinIO container `docker run` published on 127.0.0.1 (its
    health, and S3 calls signed with --aws-sigv4 by the server's root
    credentials: a bucket's PUT, an object's upload with -T); anything else
    needs the network."""
    a = ctx.args
    urls = [x for x in positionals(a, {"-o", "--output", "-X", "--request", "-T", "--upload-file",
                                       "--user", "-u", "--aws-sigv4", "-H", "--header", "-w",
                                       "--max-time", "--retry", "-d", "--data", "--connect-timeout"})
            if re.match(r"https?://", x)]
    m = re.fullmatch(r"http://127\.0\.0\.1:(\d+)(/.*)?", urls[0]) if len(urls) == 1 else None
    name, c = minio_at(ctx, host_port=int(m.group(1))) if m else (None, None)
    if c is None:
        return no_network(ctx)
    path = (m.group(2) or "/").split("?")[0]
    if path in ("/minio/health/ready", "/minio/health/live"):
        return 0
    if "--aws-sigv4" not in a:
        print("curl: (22) The requested URL returned error: 403", file=sys.stderr)
        return 22
    sig = opt(a, "--aws-sigv4")
    if not re.fullmatch(r"aws:amz:[a-z0-9-]+:s3", sig or ""):
        return ctx.error(f"curl --aws-sigv4 {sig!r}: S3 needs aws:amz:REGION:s3")
    if opt(a, "--user", "-u") != f"{c['env'].get('MINIO_ROOT_USER')}:{c['env'].get('MINIO_ROOT_PASSWORD')}":
        print("curl: (22) The requested URL returned error: 403", file=sys.stderr)
        return 22
    parts = [p for p in path.split("/") if p]
    buckets = ctx.state / "s3" / name
    upload = opt(a, "-T", "--upload-file")
    if upload:
        if len(parts) < 2 or not (buckets / parts[0]).is_dir():
            print("curl: (22) The requested URL returned error: 404", file=sys.stderr)
            return 22
        if not Path(upload).is_file():
            print(f"curl: Can't open '{upload}'!", file=sys.stderr)
            return 26
        dest = buckets.joinpath(*parts)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(upload, dest)
        return 0
    if opt(a, "-X", "--request") == "PUT" and len(parts) == 1:
        (buckets / parts[0]).mkdir(parents=True, exist_ok=True)
        return 0
    return ctx.unknown()


def docker_run(ctx, a):
    """`docker run -d --name N --network NET -p [127.0.0.1:][HOST]:PORT -e K=V IMAGE ARGS`:
    a container on a cluster's Docker network (kind's `kind`, k3d's
    `k3d-NAME`), remembered for inspect, port, logs, rm and curl."""
    flags = {"--name", "--network", "-p", "--publish", "-e", "--env", "-v", "--volume", "--platform",
             "-u", "--user", "-w", "--workdir", "--entrypoint", "-l", "--label", "--pull"}
    words = positionals(a, flags)
    if not words:
        return ctx.error("docker run: no image")
    if "-d" not in a and "--detach" not in a:
        return ctx.unknown()
    networks = ["bridge"] + (["kind"] if ctx.clusters("kind") else []) + \
        [f"k3d-{c}" for c in ctx.clusters("k3d")]
    network = opt(a, "--network") or "bridge"
    if network not in networks:
        print(f"docker: Error response from daemon: network {network} not found.", file=sys.stderr)
        return ctx.error(f"docker run --network {network}: no such network (the job's: {', '.join(networks)})")
    name = opt(a, "--name") or "rehearsal_" + hashlib.sha256(words[0].encode()).hexdigest()[:8]
    containers = ctx._load("containers.json", {})
    if name in containers:
        print(f'docker: Error response from daemon: Conflict. The container name "/{name}" is already in use',
              file=sys.stderr)
        return 125
    env = {}
    for i, x in enumerate(a[:-1]):
        if x in ("-e", "--env"):
            k, _, v = a[i + 1].partition("=")
            env[k] = v
    publish = [a[i + 1] for i, x in enumerate(a[:-1]) if x in ("-p", "--publish")]
    h = int(hashlib.sha256(name.encode()).hexdigest(), 16)
    port = None
    if publish:
        m = re.fullmatch(r"(?:([0-9.]+):)?(\d*):?(\d+)(?:/tcp)?", publish[0])
        if not m:
            return ctx.error(f"docker run -p {publish[0]}: not a port mapping")
        port = {"container": int(m.group(3)), "host": int(m.group(2) or 32768 + h % 20000)}
    containers[name] = {"image": words[0], "run": True, "network": network, "env": env,
                        "ip": f"172.18.{h % 200 + 10}.{h % 250 + 2}",
                        "host_port": port["host"] if port else None,
                        "port": port["container"] if port else None}
    ctx._save("containers.json", containers)
    print(hashlib.sha256(name.encode()).hexdigest())
    return 0


# -- cargo, rustup ----------------------------------------------------------
CARGO_VALUE_FLAGS = {"-p", "--package", "--bin", "--test", "--example", "--bench", "-j", "--jobs",
                     "--features", "-F", "--target", "--target-dir", "--manifest-path", "--profile",
                     "--color", "--message-format", "--exclude", "-Z", "--config"}


def cargo_sub(a):
    """cargo's subcommand in argv (after +toolchain and global flags)."""
    words = [x for x in positionals(a, CARGO_VALUE_FLAGS) if not x.startswith("+")]
    return words[0] if words else ""


def cargo(ctx):
    a = ctx.args
    sub = cargo_sub(a)
    if a[:1] in (["--version"], ["-V"]):
        print("cargo 1.91.0 (rehearsal stand-in)")
        return 0
    if sub in ("fmt", "clippy") and "--version" in a:
        print(f"{'rustfmt' if sub == 'fmt' else 'clippy'} 1.91.0 (rehearsal stand-in)")
        return 0
    if sub == "nextest":
        if not shutil.which("cargo-nextest"):
            print("error: no such command: `nextest`", file=sys.stderr)
            return 101
        print("cargo-nextest 0.9.100 (rehearsal stand-in)")
        return 0
    if sub == "install":
        names = positionals(a[a.index("install") + 1:], {"--version", "--root", "--git", "--tag",
                                                         "--locked", "-j", "--target"})
        bindir = Path(opt(a, "--root") or os.environ.get("CARGO_HOME") or Path.home() / ".cargo") / "bin"
        bindir.mkdir(parents=True, exist_ok=True)
        for n in names:
            write_shim(ctx, bindir / n, "cargo-installed", f"export REHEARSE_TOOL={shlex.quote(n)}\n")
        print(f"  Installed package(s) {' '.join(names)} (rehearsal stand-in) into {bindir}")
        return 0
    return cargo_check(ctx, a, Path("."), quiet=False)


def cargo_check(ctx, a, cwd, quiet):
    """cargo build/test/run/clippy/fmt/bench/check: the -p packages and
    --bin binaries exist in the workspace; a build leaves stub binaries
    (see kt_scenario) where cargo would put the real ones."""
    sub = cargo_sub(a)
    if sub not in ("build", "b", "test", "t", "run", "r", "clippy", "fmt", "bench", "check", "c",
                   "doc", "metadata", "nextest", "install", "clean", "tree", "update", "fetch"):
        return ctx.error(f"cargo {sub}: not a cargo command the stand-in knows")
    pkgs = ctx.cfg["packages"]
    cli = a[:a.index("--")] if "--" in a else a
    chosen = [v for i, v in enumerate(cli[1:], 1) if cli[i - 1] in ("-p", "--package")]
    chosen += [x.split("=", 1)[1] for x in cli if x.startswith("--package=")]
    for p in chosen:
        if p not in pkgs:
            return ctx.error(f"cargo {shlex.join(a)}: package {p!r} is not in the workspace "
                             f"(packages: {', '.join(sorted(pkgs))})", 101)
    scope = chosen or sorted(pkgs)
    bins = [v for i, v in enumerate(cli[1:], 1) if cli[i - 1] == "--bin"]
    for b in bins:
        if not any(b in pkgs[p]["bins"] for p in scope):
            return ctx.error(f"cargo {shlex.join(a)}: no binary {b!r} in "
                             f"{', '.join(chosen) or 'the workspace'}", 101)
    target = opt(cli, "--target") or os.environ.get("CARGO_BUILD_TARGET")
    if target and target != HOST_TRIPLE and sub not in ("fmt", "metadata", "tree", "update", "fetch",
                                                        "clean"):
        if (code := cross_check(ctx, target)):
            return code
    if sub in ("build", "b", "test", "t", "run", "r"):
        profile = "release" if "--release" in cli else "debug"
        out = cwd / os.environ.get("CARGO_TARGET_DIR", "target")
        out = (out / target if target else out) / profile
        out.mkdir(parents=True, exist_ok=True)
        for p in scope:
            for b in (bins if bins else pkgs[p]["bins"]):
                if b in pkgs[p]["bins"]:
                    stub_binary(ctx, out / b, target)
    if not quiet and sub in ("test", "t"):
        print("running 1 test\ntest rehearsal ... ok\n\n"
              "test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out")
    return 0


def stub_binary(ctx, path, target=None):
    """A stand-in for a binary cargo would build: kt-scenario checks its
    calls (kt_scenario above); the others are copies of `true` (real ELF
    files, so that strip and ldd work on them), marked in their ELF header
    for the --target's machine (aarch64: the host's strip refuses them, as
    it refuses a real one)."""
    if path.name == "kt-scenario" and not target:
        write_shim(ctx, path, "kt-scenario")
    elif path.name == "kt" and not target:
        kt_elf(ctx, path)
    elif target and target.startswith("aarch64-"):
        elf_stub(ctx, path, "linux/arm64")
    else:
        shutil.copy(ctx.cfg["real"]["true"], path)


# kt as cargo would leave it: an x86-64 ELF (strip and the release's checks
# of the ELF header work on it) that runs the kt stand-in, so that the
# scripts calling target/*/kt (testbed/datasets/on-cluster.sh) are checked.
KT_ELF_C = r"""
#include <unistd.h>
int main(int argc, char **argv) {
    char *args[argc + 2];
    args[0] = "bash";
    args[1] = SHIM;
    for (int i = 1; i < argc; i++) args[i + 1] = argv[i];
    args[argc + 1] = 0;
    execv("/bin/bash", args);
    return 127;
}
"""


def kt_elf(ctx, path):
    shim = path.with_name(".kt-standin")
    write_shim(ctx, shim, "kt")
    src = ctx.scratch() / "kt.c"
    src.write_text(KT_ELF_C)
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        ctx.warn(f"no C compiler here: {path} is a shell shim, which strip refuses")
        shutil.copy(shim, path)
        return
    r = subprocess.run([gcc, "-O1", f"-DSHIM={json.dumps(str(shim))}", "-o", str(path), str(src)],
                       capture_output=True, text=True)
    if r.returncode:
        ctx.error(f"building the kt stand-in's ELF failed: {r.stderr.strip()}")


HOST_TRIPLE = "x86_64-unknown-linux-gnu"
# What `rustup target add` accepts (a subset of `rustup target list`).
RUST_TARGETS = {HOST_TRIPLE, "aarch64-unknown-linux-gnu", "aarch64-unknown-linux-musl",
                "x86_64-unknown-linux-musl", "armv7-unknown-linux-gnueabihf",
                "x86_64-apple-darwin", "aarch64-apple-darwin", "x86_64-pc-windows-msvc",
                "wasm32-unknown-unknown"}


def rust_targets(ctx):
    p = ctx.state / "rust-targets"
    return {HOST_TRIPLE} | (set(p.read_text().split()) if p.exists() else set())


def cross_check(ctx, target):
    """A cross build needs the target's standard library (rustup target add,
    or the toolchain action's `targets:`), a linker for it
    (CARGO_TARGET_<TRIPLE>_LINKER, on PATH: cargo links with the host's
    `cc` otherwise, which fails), and a C compiler for it (the workspace's
    ring and blake3 compile C: CC_<triple>, else cc-rs's default
    <gnu-triple>-gcc)."""
    if target not in rust_targets(ctx):
        print(f"error[E0463]: can't find crate for `core`\n  = note: the `{target}` target may not be "
              "installed", file=sys.stderr)
        return ctx.error(f"cargo --target {target}: the target is not installed (`rustup target add "
                         f"{target}`, or the toolchain action's `targets:`)", 101)
    var = "CARGO_TARGET_" + target.upper().replace("-", "_") + "_LINKER"
    linker = os.environ.get(var)
    if not linker:
        print("error: linking with `cc` failed: exit status: 1\n  = note: /usr/bin/ld: file in wrong "
              "format", file=sys.stderr)
        return ctx.error(f"cargo --target {target}: no {var}: cargo would link with the host's cc", 101)
    if not shutil.which(linker):
        return ctx.error(f"cargo --target {target}: {var}={linker} is not on PATH (is the cross "
                         "toolchain installed?)", 101)
    gnu = target.replace("-unknown-", "-")
    cc = os.environ.get("CC_" + target.replace("-", "_")) or os.environ.get("CC_" + target) or f"{gnu}-gcc"
    if not shutil.which(cc):
        print(f"error: failed to run custom build command for `ring v0.17`\n  failed to find tool "
              f"\"{cc}\": No such file or directory", file=sys.stderr)
        return ctx.error(f"cargo --target {target}: no C compiler {cc} for it on PATH (ring and "
                         "blake3 compile C)", 101)
    return 0


def rustup(ctx):
    a = ctx.args
    sub = a[0] if a else ""
    if sub in ("--version", "-V"):
        print("rustup 1.28.2 (rehearsal stand-in)")
    elif a[:2] == ["target", "add"]:
        for t in positionals(a[2:], {"--toolchain"}):
            if t not in RUST_TARGETS:
                print(f"error: toolchain 'stable-{HOST_TRIPLE}' does not support target '{t}'",
                      file=sys.stderr)
                return ctx.error(f"rustup target add {t}: no such target", 1)
            with open(ctx.state / "rust-targets", "a") as f:
                f.write(t + "\n")
            print(f"info: downloading component 'rust-std' for '{t}'")
    elif a[:2] == ["target", "list"]:
        for t in sorted(rust_targets(ctx) if "--installed" in a else RUST_TARGETS):
            print(t)
    elif sub not in ("component", "toolchain", "default", "target", "show", "override", "which",
                     "update", "run", "set"):
        return ctx.unknown()
    return 0


def cross_gcc(ctx):
    """aarch64-linux-gnu-gcc/-ar (apt-get install gcc-aarch64-linux-gnu)."""
    return 0


def cross_strip(ctx):
    """aarch64-linux-gnu-strip: an aarch64 ELF file in, a copy out (`-o OUT
    IN`, or in place); anything else is a format it does not recognise."""
    a = ctx.args
    ins = positionals(a, {"-o", "-R", "-K", "-N", "--remove-section", "--keep-symbol"})
    out = opt(a, "-o")
    if len(ins) != 1 or (not out and not ins):
        return ctx.unknown()
    src = Path(ins[0])
    if not src.is_file():
        print(f"aarch64-linux-gnu-strip: '{src}': No such file", file=sys.stderr)
        return 1
    if elf_platform(src) != "linux/arm64":
        print(f"aarch64-linux-gnu-strip: Unable to recognise the format of the input file `{src}'",
              file=sys.stderr)
        return 1
    if out:
        shutil.copy(src, out)
    return 0


# -- the network, the host, the package manager ----------------------------
def no_network(ctx):
    url = next((x for x in ctx.args if "://" in x), "?")
    print(f"{ctx.tool}: (6) Could not resolve host: {url} (the rehearsal has no network)", file=sys.stderr)
    return ctx.error(f"download of {url}: the rehearsal has no network (pinned tools come from "
                     "testbed/ci/install-tools.sh, which the rehearsal stands in for)", 6)


def python3(ctx):
    """The real python3, except pip's downloads and installs (network)."""
    a = ctx.args
    if a[:3] == ["-m", "pip", "download"]:
        dest = Path(opt(a, "-d", "--dest") or ".")
        dest.mkdir(parents=True, exist_ok=True)
        reqs = positionals(a[3:], {"-d", "--dest", "--platform", "--python-version", "--only-binary",
                                   "--no-binary", "--implementation", "--abi", "-r", "-i", "--index-url"})
        for req in reqs:
            name = re.split(r"[=<>!~ ]", req)[0].replace("-", "_")
            whl = dest / f"{name}-0.0.0-py3-none-manylinux2014_x86_64.whl"
            import zipfile
            with zipfile.ZipFile(whl, "w") as z:
                # What the release's NCCL wheel holds that release.yml takes.
                z.writestr("nvidia/nccl/lib/libnccl.so.2", b"\x7fELF rehearsal")
                z.writestr(f"{name}-0.0.0.dist-info/METADATA", f"Name: {name}\n")
        return 0
    if a[:3] == ["-m", "pip", "install"]:
        return 0
    real = ctx.cfg["real"]["python3"]
    os.execv(real, [real, *a])


def sudo(ctx):
    """Runs the command as `root` (id -u says 0 below it) with sudo's
    environment: env_reset keeps only the --preserve-env list (all with -E).
    Real sudo may also replace PATH with sudoers' secure_path."""
    a = list(ctx.args)
    keep, keep_all = set(), False
    while a and a[0].startswith("-"):
        x = a.pop(0)
        if x == "--":
            break
        if x in ("-E", "--preserve-env"):
            keep_all = True
        elif x.startswith("--preserve-env="):
            keep |= set(x.split("=", 1)[1].split(","))
        elif x in ("-u", "-g", "-C", "-D", "-h", "-p", "-U", "-r", "-t", "-T"):
            a.pop(0)
    if not a:
        return ctx.unknown()
    env = dict(os.environ) if keep_all else {
        k: v for k, v in os.environ.items()
        if k in keep or k in ("TERM", "LANG", "DISPLAY") or k.startswith("REHEARSE_")
        or k.startswith("BASH_FUNC_")}
    env.setdefault("PATH", os.environ["REHEARSE_SECURE_PATH"])
    env.setdefault("HOME", os.environ.get("HOME", "/root"))
    env.update({"USER": "root", "LOGNAME": "root", "SUDO_USER": "runner", "SUDO_UID": "1001",
                "REHEARSE_ROOT": "1"})
    exe = shutil.which(a[0], path=env["PATH"])
    if not exe:
        print(f"sudo: {a[0]}: command not found", file=sys.stderr)
        return ctx.error(f"sudo {a[0]}: not found on sudo's PATH")
    os.execve(exe, a, env)


# Packages whose tools the workflows use: apt-get install puts stand-ins
# for them on PATH (the rehearsal's stand-in directory, as /usr/bin).
APT_TOOLS = {
    "gcc-aarch64-linux-gnu": {"aarch64-linux-gnu-gcc": "cross-gcc", "aarch64-linux-gnu-ar": "cross-gcc",
                              "aarch64-linux-gnu-strip": "cross-strip"},
    "binutils-aarch64-linux-gnu": {"aarch64-linux-gnu-ar": "cross-gcc",
                                   "aarch64-linux-gnu-strip": "cross-strip"},
}


def apt_get(ctx):
    a = ctx.args
    if os.environ.get("REHEARSE_ROOT") != "1" and any(x in a for x in ("install", "update", "remove")):
        print("E: Could not open lock file /var/lib/dpkg/lock-frontend - open (13: Permission denied)",
              file=sys.stderr)
        return ctx.error(f"apt-get {shlex.join(a)} as the runner user: it needs sudo", 100)
    if "install" in a:
        standins = ctx.state.parent / "standins"
        for pkg in positionals(a[a.index("install") + 1:], {"-o", "-t", "--target-release"}):
            for tool, standin in APT_TOOLS.get(pkg.split("=")[0], {}).items():
                write_shim(ctx, standins / tool, standin)
    return 0


def id_(ctx):
    if ctx.args in (["-u"], ["-ru"], ["-ur"]):
        print(0 if os.environ.get("REHEARSE_ROOT") == "1" else 1001)
    elif ctx.args in (["-un"], ["-nu"]):
        print("root" if os.environ.get("REHEARSE_ROOT") == "1" else "runner")
    elif ctx.args in (["-g"],):
        print(0 if os.environ.get("REHEARSE_ROOT") == "1" else 118)
    else:
        print("uid=1001(runner) gid=118(docker) groups=118(docker),4(adm),100(users)")
    return 0


def ip(ctx):
    """ip netns add/del (root only, as the real one); nothing else."""
    a = ctx.args
    if a[:1] in (["-V"], ["-Version"]):
        print("ip utility, iproute2-6.1.0 (rehearsal stand-in)")
    elif a[:2] in (["netns", "add"], ["netns", "del"], ["netns", "delete"]):
        if os.environ.get("REHEARSE_ROOT") != "1":
            print("mount --make-shared /run/netns failed: Operation not permitted", file=sys.stderr)
            return 1
    elif a[:2] in (["netns", "list"], ["netns"]):
        pass
    else:
        return ctx.unknown()
    return 0


def nvidia_smi(ctx):
    if "-L" in ctx.args:
        print("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-rehearsal)")
    elif any(x.startswith("--query-gpu") for x in ctx.args):
        print("NVIDIA H100 80GB HBM3, 570.124.06, 81559 MiB")
    else:
        print("+-----------------------------------------------------------------------------+\n"
              "| NVIDIA-SMI 570.124.06   Driver Version: 570.124.06   CUDA Version: 12.8      |\n"
              "|   0  NVIDIA H100 80GB HBM3   On  | 00000000:00:00.0 Off |                    0 |\n"
              "+-----------------------------------------------------------------------------+")
    return 0


def gh(ctx):
    a = ctx.args
    if not (os.environ.get("GH_TOKEN") or os.environ.get("GITHUB_TOKEN")):
        return ctx.error("gh needs GH_TOKEN (or GITHUB_TOKEN) in the step's env")
    if a[:2] == ["release", "create"]:
        files = positionals(a[3:], {"--title", "-t", "--notes", "-n", "--notes-file", "-F",
                                    "--target", "--repo", "-R", "--discussion-category"})
        if not files:
            return ctx.error("gh release create: no assets")
        for f in files:
            if not Path(f.split("#")[0]).is_file():
                return ctx.error(f"gh release create: asset {f} does not exist")
        notes = opt(a, "--notes-file", "-F")
        if notes and not Path(notes).is_file():
            return ctx.error(f"gh release create: notes file {notes} does not exist")
        print(f"https://github.com/{os.environ.get('GITHUB_REPOSITORY', '?')}/releases/tag/{a[2]}")
        return 0
    return ctx.unknown()


def cargo_installed(ctx):
    """A tool `cargo install` put into ~/.cargo/bin (cargo-nextest, ...)."""
    print(f"{os.environ.get('REHEARSE_TOOL', '?')} 0.0.0 (rehearsal stand-in, cargo-installed)")
    return 0


# -- testbed/ci/install-tools.sh -------------------------------------------
def install_tools(ctx):
    """The stand-in for `bash testbed/ci/install-tools.sh DIR TOOL...`:
    checks the call as the real script would (known tools, a directory),
    and puts stand-ins for the tools into DIR, each answering with the
    version the real script would fetch (its *_VERSION variables)."""
    if not ctx.args:
        return ctx.error("usage: install-tools.sh DIR TOOL...")
    d = Path(ctx.args[0])
    known = ctx.cfg["install_tools"]
    d.mkdir(parents=True, exist_ok=True)
    for tool in ctx.args[1:]:
        if tool not in known:
            print(f"install-tools.sh: unknown tool {tool}", file=sys.stderr)
            return ctx.error(f"install-tools.sh does not install {tool} (it knows {', '.join(known)})")
        version = os.environ.get(f"{tool.upper()}_VERSION") or known[tool]
        write_shim(ctx, d / tool, tool, f"export REHEARSE_VERSION={shlex.quote(version)}\n")
        print(f"{tool}: OK (rehearsal stand-in {version})")
    return 0


def not_found(ctx):
    """bash's command_not_found_handle in every rehearsed shell."""
    name = ctx.args[0] if ctx.args else "?"
    print(f"bash: {name}: command not found", file=sys.stderr)
    if name in ctx.cfg["installable"] or name in ctx.cfg["standin_tools"]:
        return ctx.error(f"tool {name} used but never installed (the {ctx.cfg['runner']} runner does "
                         "not ship it and no earlier step installed it)", 127, prefix=False)
    if name in ctx.cfg["ships"]:
        return ctx.error(f"{name} ships with the {ctx.cfg['runner']} runner but is missing on this "
                         "machine: install it here to rehearse", 127, prefix=False)
    return ctx.error(f"command {name} not found", 127, prefix=False)


TOOLS = {
    "kind": kind, "k3d": k3d, "kubectl": kubectl, "docker": docker, "make": make,
    "cargo": cargo, "rustup": rustup, "curl": curl, "wget": no_network,
    "python3": python3, "venv-python": venv_python, "sudo": sudo, "apt-get": apt_get,
    "id": id_, "ip": ip, "nvidia-smi": nvidia_smi, "gh": gh, "kt-scenario": kt_scenario,
    "install-tools": install_tools, "cargo-installed": cargo_installed, "not-found": not_found,
    "kt": lambda ctx: kt_main(ctx, ctx.args), "cross-strip": cross_strip, "cross-gcc": cross_gcc,
    "pyenv-python": pyenv_python,
}


def main(argv):
    state, tool, args = argv[1], argv[2], argv[3:]
    ctx = Ctx(state, tool, args)
    if tool != "not-found":
        ctx.log_call()
    sys.stdout.flush()
    return TOOLS[tool](ctx) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

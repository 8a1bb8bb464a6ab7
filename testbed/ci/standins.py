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
            ctx.set_clusters("kind", ctx.clusters("kind") + [name])
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
                print(f"{name}-control-plane")
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
                       "--timeout", "--for", "--field-selector", "--server", "--tail", "-k"}


def kubectl(ctx):
    a = ctx.args
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
    if verb == "get" and "-o" in a and opt(a, "-o", "--output") == "name":
        print(f"{what.rstrip('s')}/rehearsal")
    elif verb == "get" and what == "events":
        print("NAMESPACE   LAST SEEN   TYPE     REASON    OBJECT              MESSAGE")
        print("kt-ci       10s         Normal   Started   pod/kt-store-0      Started container kt-store")
    elif verb == "get" and what in ("pods", "pod", "po"):
        print("NAMESPACE   NAME          READY   STATUS    RESTARTS   AGE   IP           NODE")
        print(f"kt-ci       kt-store-0    1/1     Running   0          1m    10.244.0.5   {node}")
    elif verb == "get" and what in ("nodes", "node", "no"):
        print(f"NAME   STATUS   ROLES           AGE   VERSION\n{node}   Ready    control-plane   2m    v1.32.2")
    elif verb == "describe":
        print(f"Name:               {node}\nRoles:              control-plane\nConditions:\n  Ready   True")
    elif verb in ("apply", "create"):
        print("rehearsal/object configured")
    elif verb == "delete":
        print("rehearsal/object deleted")
    return 0


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
                                                "-p", "--password", "--name", "-n", "--tail"})
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
    elif verb in ("tag", "pull", "images", "image", "save", "load", "rm", "rmi", "network",
                  "volume", "inspect", "run", "exec", "stop", "kill", "cp", "logout"):
        pass
    else:
        return ctx.unknown()
    return 0


def _docker_nodes(ctx):
    """Node containers of the clusters the job created, with their labels."""
    nodes = {f"{c}-control-plane": f"io.x-k8s.kind.cluster={c}" for c in ctx.clusters("kind")}
    nodes.update({f"k3d-{c}-server-0": f"k3d.cluster={c}" for c in ctx.clusters("k3d")})
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
    in the build context, every tag is a valid reference, and --push has a
    login; writes --metadata-file and --iidfile as buildx does."""
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
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    for line in text.splitlines():
        words = line.split()
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
    if "--push" in a and (code := _check_push(ctx, tags)):
        return code
    digest = "sha256:" + hashlib.sha256("\n".join(tags + [str(dockerfile)]).encode()).hexdigest()
    if mf := opt(a, "--metadata-file"):
        Path(mf).write_text(json.dumps({"containerimage.digest": digest,
                                        "image.name": ",".join(tags)}, indent=2))
    if iid := opt(a, "--iidfile"):
        Path(iid).write_text(digest)
    print(f"#1 rehearsal build of {dockerfile} -> {', '.join(tags) or '(untagged)'}\n#1 DONE")
    return 0


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
        ctx.set_clusters(target, ctx.clusters(target) + [name])
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
        ctx.set_clusters(flavor, ctx.clusters(flavor) + [name])
    if not created:
        # An existing cluster is used (and kept): a later dump finds it.
        name = os.environ.get("KT_CLUSTER") or "kt-scenario"
        ctx.set_clusters(flavor, ctx.clusters(flavor) + [name])
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
    if sub in ("build", "b", "test", "t", "run", "r"):
        profile = "release" if "--release" in cli else "debug"
        out = cwd / os.environ.get("CARGO_TARGET_DIR", "target") / profile
        out.mkdir(parents=True, exist_ok=True)
        for p in scope:
            for b in (bins if bins else pkgs[p]["bins"]):
                if b in pkgs[p]["bins"]:
                    stub_binary(ctx, out / b)
    if not quiet and sub in ("test", "t"):
        print("running 1 test\ntest rehearsal ... ok\n\n"
              "test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out")
    return 0


def stub_binary(ctx, path):
    """A stand-in for a binary cargo would build: kt-scenario checks its
    calls (kt_scenario above); the others are copies of `true` (real ELF
    files, so that strip and ldd work on them)."""
    if path.name == "kt-scenario":
        write_shim(ctx, path, "kt-scenario")
    else:
        shutil.copy(ctx.cfg["real"]["true"], path)


def rustup(ctx):
    sub = ctx.args[0] if ctx.args else ""
    if sub in ("--version", "-V"):
        print("rustup 1.28.2 (rehearsal stand-in)")
    elif sub not in ("component", "toolchain", "default", "target", "show", "override", "which",
                     "update", "run", "set"):
        return ctx.unknown()
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


def apt_get(ctx):
    a = ctx.args
    if os.environ.get("REHEARSE_ROOT") != "1" and any(x in a for x in ("install", "update", "remove")):
        print("E: Could not open lock file /var/lib/dpkg/lock-frontend - open (13: Permission denied)",
              file=sys.stderr)
        return ctx.error(f"apt-get {shlex.join(a)} as the runner user: it needs sudo", 100)
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
    "cargo": cargo, "rustup": rustup, "curl": no_network, "wget": no_network,
    "python3": python3, "venv-python": venv_python, "sudo": sudo, "apt-get": apt_get,
    "id": id_, "ip": ip, "nvidia-smi": nvidia_smi, "gh": gh, "kt-scenario": kt_scenario,
    "install-tools": install_tools, "cargo-installed": cargo_installed, "not-found": not_found,
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

"""A rehearsal of .github/workflows on this machine, without GitHub, the
network, Docker or a cluster (`make lint-workflows` runs it after
actionlint and workflows.py).

It catches glue errors: a workflow that passes the runner an environment
value it refuses, names a make target that does not exist, uploads a report
path nothing writes, uses a tool no step installed, or filters on a path
that is gone. Such a workflow breaks at its first step on GitHub while
everything here stays green.

What is rehearsed, for every job of every workflow (every matrix entry):

- Each `run:` step's script, in order, with GitHub's shell (`bash -e {0}`
  when `shell:` is unset, `bash --noprofile --norc -eo pipefail {0}` for
  `shell: bash`, or the step's own), in a throwaway clone of HEAD plus the
  working tree's uncommitted changes (so what would be committed is
  rehearsed), removed afterwards.
- Their environment as GitHub builds it: the workflow's, job's and step's
  `env:` merged, `${{ }}` expressions resolved (github.*, runner.*, env.*,
  matrix.*, steps.*.outputs; secrets.* and the token become placeholders;
  one that cannot be resolved is said loudly), GitHub's variables
  (GITHUB_*, RUNNER_TEMP, CI=true, ...) and the GITHUB_ENV / GITHUB_PATH /
  GITHUB_OUTPUT / GITHUB_STEP_SUMMARY files honoured between steps. The
  environment is built from scratch: nothing of this machine's leaks in.
  The event played is a push (to the tag v<workspace version> when the
  workflow runs on tags, else to its branch), else a pull request, else
  the workflow's first trigger.
- `if:` conditions: success() steps in a first pass; when a job has
  failure() steps, a second pass fails the step before the first of them
  and runs what GitHub would run then (failure() and always() steps).
- PATH starts with a directory of stand-ins (testbed/ci/standins.py: kind,
  k3d, kubectl, docker, nvidia-smi, make, cargo, rustup, curl, sudo,
  apt-get, gh, ...), then this machine's tool directories less every tool
  the runner image would not have. A stand-in records each call
  (with the KT_* environment it saw) and answers like the real tool, and
  checks what the real one would refuse. `make` asks the real make
  (`make -n`, nothing compiled) and acts out the recipes; a recipe's
  `kt-scenario run`/`chaos` is checked by the real runner binary
  (KT_REHEARSE_BIN_DIR/kt-scenario, `--dry-run`, nothing started) with the
  step's arguments and environment, and leaves the report directory the
  real run writes. kubectl remembers what was applied to each cluster
  (`apply -k` rendered by the real kubectl): `rollout status`/`wait` need
  the object, `get pods -l` names the pods of matching workloads, and
  `exec` runs mkdir/tar/kt in an emulated filesystem of such a pod
  (read-only root, its volume mounts); `kt` (in a pod, or copied out of a
  pushed client image with `docker cp`) keeps keys in a store per cluster
  and namespace, with the pod's service's write rights.
  testbed/ci/install-tools.sh is replaced in the clone by a stand-in that
  puts stand-ins of the tools it is asked for into its directory; a tool
  the runner image does not ship (RUNNER_TOOLS) that no earlier step
  installed fails the step.
- `uses:` steps: actions/upload-artifact's `path:` and
  mikepenz/action-junit-report's `report_paths` must match files the
  rehearsed steps left; docker/login-action is remembered (a push needs
  it); dtolnay/rust-toolchain's `targets` are installed (cargo --target
  needs them); the others (checkout, caches, buildx) are recorded and
  skipped.
- Jobs that `needs:` others: a workflow with any runs its jobs in the
  order of their needs (a job's matrix entries side by side), each
  with the `needs` context of what it needs (`result`, and `outputs` from
  the job's `outputs:`); a job whose needs failed is not rehearsed.
  What a job uploads with actions/upload-artifact is kept (rooted at the
  paths' common directory, as the action does) and
  actions/download-artifact restores it where a later job asks; one that
  no earlier job uploaded fails. What the stand-ins push to a registry
  (docker buildx) is kept across the workflow's jobs too: a later job
  pulls only what was pushed.
- `on.<event>.paths` / `paths-ignore` filters: a plain path must be a file
  in the repository (a directory needs `dir/**`), a glob must match one.

What is not rehearsed: a real cluster, real images, real builds and tests
(make test's own job), the actions' code, GitHub's scheduling beyond the
order of needs (concurrency, timeouts, parallel jobs), containers and
services.

usage: python rehearse.py [--self-test] [--keep] [-v] [-j N] [WORKFLOW...]
(default: every .github/workflows/*.yml; lint-workflows.sh runs it with
--self-test, which also rehearses small workflows with planted errors,
PLANTS, each of which must be caught; --keep keeps the clones, the
stand-ins' calls.log and every step's output; -v times the steps).
KT_REHEARSE_BIN_DIR: the directory of a built kt-scenario (`make
lint-workflows` builds it); without one the runner's acceptance is not
checked, which is said loudly, and with CI=true that fails.
"""

import argparse
import concurrent.futures
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
STANDINS_PY = HERE / "standins.py"
INSTALL_TOOLS = "testbed/ci/install-tools.sh"

# ---------------------------------------------------------------------------
# What the runners have. The tools each runner image has on PATH, among
# those the workflows (and the scripts they run) call. Everything else this
# machine has in its system directories is taken as it is (coreutils, git,
# strip, unzip, jq, ...), except INSTALLABLE (tools that exist on a runner
# only once a step installs them) and the STANDINS a runner lacks.
#
# ubuntu-latest (GitHub's hosted image) ships docker, kubectl, python3, git,
# curl, make, bash, jq, gcc, the Rust toolchain (rustup, cargo), gh, sudo and
# apt-get. It also carries some cluster tools at versions of its own choosing
# (see the runner-images README); the rehearsal treats kind, k3d and helm as
# absent, so a step relying on an unpinned one fails here: the workflows
# install pinned ones with testbed/ci/install-tools.sh.
BASE_TOOLS = {"bash", "sh", "git", "curl", "wget", "make", "python3", "sudo", "id", "ip", "jq",
              "gcc", "unzip", "strip"}
RUNNER_TOOLS = {
    "ubuntu": BASE_TOOLS | {"docker", "kubectl", "cargo", "rustup", "gh", "apt-get"},
    # gpu.yml's self-hosted runner [self-hosted, linux, x64, gpu]: what its
    # header assumes on the host (an NVIDIA driver, a Rust toolchain through
    # rustup, kubectl, python3-venv, make). No Docker, no gh.
    "self-hosted-gpu": BASE_TOOLS | {"nvidia-smi", "cargo", "rustup", "kubectl", "apt-get"},
}
INSTALLABLE = {"kind", "k3d", "helm", "kustomize", "cargo-nextest", "minikube",
               # gcc-aarch64-linux-gnu (apt-get: the arm64 cross toolchain)
               "aarch64-linux-gnu-gcc", "aarch64-linux-gnu-strip", "aarch64-linux-gnu-ar"}
# Stand-ins (standins.py) put first on PATH, where the runner has the tool.
STANDINS = {"kubectl", "docker", "make", "cargo", "rustup", "curl", "wget", "python3", "sudo",
            "apt-get", "id", "ip", "nvidia-smi", "gh"}
# This machine's tool directories (the runners' PATH is made of them).
SYSTEM_PATH = ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"]

STEP_TIMEOUT_S = 120
# Placeholder for secrets.* and github.token.
SECRET = "rehearsal-secret-{}"


class Failure(Exception):
    """A rehearsal failure of one step: what went wrong and its output."""

    def __init__(self, what, output=""):
        super().__init__(what)
        self.what = what
        self.output = output


class Unresolvable(Exception):
    pass


# ---------------------------------------------------------------------------
# ${{ }} expressions: a small evaluator of GitHub's expression syntax.
TOKEN = re.compile(r"\s*(?:(?P<num>-?\d+(?:\.\d+)?)|'(?P<str>(?:[^']|'')*)'|(?P<op>==|!=|<=|>=|&&|\|\||[!<>()\[\].,*])"
                   r"|(?P<id>[A-Za-z_][A-Za-z0-9_-]*))")
STATUS_FUNCS = ("always", "success", "failure", "cancelled")


def tokenize(src):
    pos, out = 0, []
    while pos < len(src):
        if src[pos:].strip() == "":
            break
        m = TOKEN.match(src, pos)
        if not m:
            raise Unresolvable(f"cannot parse {src[pos:]!r}")
        pos = m.end()
        kind = m.lastgroup
        val = m.group(kind)
        out.append((kind, val.replace("''", "'") if kind == "str" else val))
    return out


class Expr:
    """Evaluates one expression against `contexts` (a dict of dicts);
    `status` is the job's status for the status functions."""

    def __init__(self, src, contexts, status="success"):
        self.toks, self.i = tokenize(src), 0
        self.ctx, self.status, self.src = contexts, status, src

    def eval(self):
        v = self.or_()
        if self.i != len(self.toks):
            raise Unresolvable(f"unexpected {self.toks[self.i][1]!r}")
        return v

    def peek(self):
        return self.toks[self.i][1] if self.i < len(self.toks) and self.toks[self.i][0] == "op" else None

    def take(self, op=None):
        t = self.toks[self.i]
        if op and t[1] != op:
            raise Unresolvable(f"expected {op!r}, got {t[1]!r}")
        self.i += 1
        return t

    def or_(self):
        v = self.and_()
        while self.peek() == "||":
            self.take()
            r = self.and_()
            v = v if truthy(v) else r
        return v

    def and_(self):
        v = self.eq()
        while self.peek() == "&&":
            self.take()
            r = self.eq()
            v = r if truthy(v) else v
        return v

    def eq(self):
        v = self.cmp()
        while self.peek() in ("==", "!="):
            op = self.take()[1]
            r = self.cmp()
            same = loose_eq(v, r)
            v = same if op == "==" else not same
        return v

    def cmp(self):
        v = self.unary()
        while self.peek() in ("<", ">", "<=", ">="):
            op = self.take()[1]
            r = self.unary()
            try:
                a, b = float(v), float(r)
            except (TypeError, ValueError):
                a, b = str(v), str(r)
            v = {"<": a < b, ">": a > b, "<=": a <= b, ">=": a >= b}[op]
        return v

    def unary(self):
        if self.peek() == "!":
            self.take()
            return not truthy(self.unary())
        return self.postfix()

    def postfix(self):
        v = self.primary()
        while self.peek() in (".", "["):
            if self.take()[1] == ".":
                name = self.take()[1]
                v = prop(v, name)
            else:
                key = self.or_()
                self.take("]")
                v = prop(v, key)
        return v

    def primary(self):
        kind, val = self.take()
        if kind == "num":
            return float(val) if "." in val else int(val)
        if kind == "str":
            return val
        if kind == "op" and val == "(":
            v = self.or_()
            self.take(")")
            return v
        if kind != "id":
            raise Unresolvable(f"unexpected {val!r}")
        if val in ("true", "false"):
            return val == "true"
        if val == "null":
            return None
        if self.peek() == "(":
            self.take()
            args = []
            while self.peek() != ")":
                args.append(self.or_())
                if self.peek() == ",":
                    self.take()
            self.take(")")
            return self.call(val, args)
        if val not in self.ctx:
            raise Unresolvable(f"unknown context {val!r}")
        return self.ctx[val]

    def call(self, name, args):
        low = name.lower()
        if low == "always":
            return True
        if low == "success":
            return self.status == "success"
        if low == "failure":
            return self.status == "failure"
        if low == "cancelled":
            return False
        s = [to_str(a) for a in args]
        if low == "contains":
            return any(loose_eq(x, args[1]) for x in args[0]) if isinstance(args[0], list) \
                else s[1].lower() in s[0].lower()
        if low == "startswith":
            return s[0].lower().startswith(s[1].lower())
        if low == "endswith":
            return s[0].lower().endswith(s[1].lower())
        if low == "format":
            return re.sub(r"\{(\d+)\}", lambda m: s[int(m.group(1)) + 1], s[0])
        if low == "join":
            return (s[1] if len(s) > 1 else ",").join(to_str(x) for x in args[0]) \
                if isinstance(args[0], list) else s[0]
        if low == "tojson":
            return json.dumps(plain(args[0]), indent=2)
        if low == "fromjson":
            return json.loads(s[0])
        if low == "hashfiles":
            return "rehearsal0hash"
        raise Unresolvable(f"unknown function {name}()")


def prop(v, name):
    if isinstance(v, _Secrets):
        return SECRET.format(name)
    if isinstance(v, dict):
        if isinstance(name, str):
            for k in v:
                if k.lower() == name.lower():
                    return v[k]
        if v.get("__strict__"):
            raise Unresolvable(f"{v['__strict__']}.{name} is not known to the rehearsal")
        return None
    if isinstance(v, list) and isinstance(name, (int, float)):
        return v[int(name)] if 0 <= int(name) < len(v) else None
    return None


def truthy(v):
    return v not in (None, False, 0, "") and v == v


def loose_eq(a, b):
    if isinstance(a, str) and isinstance(b, str):
        return a.lower() == b.lower()
    if isinstance(a, bool) or isinstance(b, bool) or isinstance(a, (int, float)) or isinstance(b, (int, float)):
        try:
            return float(a if not isinstance(a, str) or a else 0) == float(b if not isinstance(b, str) or b else 0)
        except (TypeError, ValueError):
            return False
    return a == b


def to_str(v):
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    if isinstance(v, (dict, list)):
        return json.dumps(plain(v))
    return str(v)


def plain(v):
    """A context's value less the rehearsal's own markers."""
    if isinstance(v, dict):
        return {k: plain(x) for k, x in v.items() if k != "__strict__"}
    if isinstance(v, list):
        return [plain(x) for x in v]
    return v


EXPR = re.compile(r"\$\{\{(.*?)\}\}", re.S)


def interpolate(text, contexts, warn, status="success"):
    """`text` with every ${{ }} replaced; an unresolvable one is said (warn)
    and becomes the empty string."""
    if not isinstance(text, str):
        return to_str(text)

    def one(m):
        try:
            return to_str(Expr(m.group(1), contexts, status).eval())
        except (Unresolvable, IndexError) as e:
            warn(f"cannot resolve ${{{{{m.group(1)}}}}}: {e}; using ''")
            return ""
    return EXPR.sub(one, text)


def condition(cond, contexts, status, warn):
    """Whether a step (or job) with `if: cond` runs when the job's status is
    `status`: GitHub adds success() unless a status function is used."""
    if cond is None or cond == "":
        return status == "success"
    if isinstance(cond, bool):
        return cond and status == "success"
    src = str(cond).strip()
    m = re.fullmatch(r"\$\{\{(.*)\}\}", src, re.S)
    if m:
        src = m.group(1)
    if not re.search(r"\b(" + "|".join(STATUS_FUNCS) + r")\s*\(", src):
        src = f"success() && ({src})"
    try:
        return truthy(Expr(src, contexts, status).eval())
    except (Unresolvable, IndexError) as e:
        warn(f"cannot evaluate `if: {cond}`: {e}; the step is rehearsed as if it were true")
        return True


def status_kind(cond):
    """'failure' when `if:` is about failure() (not merely always())."""
    return "failure" if cond and re.search(r"\bfailure\s*\(", str(cond)) else None


# ---------------------------------------------------------------------------
# Workflow files.
def load_workflow(path):
    doc = yaml.safe_load(path.read_text())
    # YAML 1.1 reads the key `on` as True.
    on = doc.get("on", doc.get(True)) or {}
    if isinstance(on, str):
        on = {on: {}}
    elif isinstance(on, list):
        on = {e: {} for e in on}
    return doc, {k: (v or {}) for k, v in on.items()}


def github_context(path, doc, on, sha, version):
    """The github context of the event the rehearsal plays: a push (to a
    tag matching the workflow's tag filter, else to its first branch),
    else a pull request, else a manual run."""
    branch, ref_type = "main", "branch"
    if "push" in on:
        event = "push"
        tags = on["push"].get("tags") or []
        branches = on["push"].get("branches") or []
        if tags and not branches:
            ref_name = f"v{version}"
            if not any(glob_regex(t).fullmatch(ref_name) for t in tags):
                raise Failure(f"no tag to rehearse: v{version} (the workspace version) does not match "
                              f"the tag filter {tags}")
            ref, ref_type = f"refs/tags/{ref_name}", "tag"
        else:
            ref_name = next((b for b in branches if not re.search(r"[*?\[!]", b)), branch)
            ref = f"refs/heads/{ref_name}"
    elif "pull_request" in on or "pull_request_target" in on:
        event, ref, ref_name = "pull_request", "refs/pull/1/merge", "1/merge"
    else:
        event = next(iter(on), "workflow_dispatch")
        ref, ref_name = f"refs/heads/{branch}", branch
    return {
        "event_name": event, "ref": ref, "ref_name": ref_name, "ref_type": ref_type,
        "sha": sha, "repository": "Kt-Dev/kt", "repository_owner": "Kt-Dev", "actor": "rehearsal",
        "workflow": doc.get("name", path.name), "run_id": "1", "run_number": "1", "run_attempt": "1",
        "server_url": "https://github.com", "api_url": "https://api.github.com",
        "graphql_url": "https://api.github.com/graphql", "token": SECRET.format("GITHUB_TOKEN"),
        "head_ref": "rehearsal" if event == "pull_request" else "",
        "base_ref": "main" if event == "pull_request" else "",
        "event": {"repository": {"default_branch": "main"}},
        "__strict__": "github",
    }


def matrix_entries(job, warn):
    """Every combination of the job's strategy.matrix ([{}] without one)."""
    m = (job.get("strategy") or {}).get("matrix")
    if m is None:
        return [{}]
    if isinstance(m, str):
        warn(f"matrix {m!r} is an expression: rehearsed without a matrix")
        return [{}]
    keys = [k for k in m if k not in ("include", "exclude")]
    combos = [dict(zip(keys, vals)) for vals in itertools.product(*(m[k] for k in keys))] if keys else []
    for ex in m.get("exclude") or []:
        combos = [c for c in combos if not all(c.get(k) == v for k, v in ex.items())]
    # An include extends the combinations of the matrix's own keys it
    # agrees with; one that extends none is a combination of its own (and
    # later includes never extend those: an include-only matrix is one job
    # per entry).
    extra = []
    for inc in m.get("include") or []:
        matched = False
        for c in combos:
            if all(c.get(k) == v for k, v in inc.items() if k in keys):
                c.update({k: v for k, v in inc.items() if k not in keys})
                matched = True
        if not matched:
            extra.append(dict(inc))
    return combos + extra or [{}]


def runner_kind(runs_on):
    labels = runs_on if isinstance(runs_on, list) else [runs_on]
    labels = [str(x).lower() for x in labels]
    if "self-hosted" in labels and "gpu" in labels:
        return "self-hosted-gpu"
    if any(x.startswith("ubuntu") for x in labels):
        return "ubuntu"
    return None


# ---------------------------------------------------------------------------
# Path filters.
def glob_regex(pat):
    """GitHub's filter pattern syntax: * (not /), ** (anything), ? and +
    (zero-or-one / one-or-more of the preceding character), [...]."""
    out, i = "", 0
    while i < len(pat):
        if pat.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pat.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pat[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pat[i] in "?+":
            out, i = out + pat[i], i + 1
        elif pat[i] == "[":
            j = pat.index("]", i)
            out, i = out + pat[i:j + 1], j + 1
        else:
            out, i = out + re.escape(pat[i]), i + 1
    return re.compile(out)


def check_path_filters(rel, on, files):
    errors = []
    dirs = {str(Path(f).parent) for f in files}
    dirs |= {p for d in list(dirs) for p in (str(x) for x in Path(d).parents)}
    for event, spec in on.items():
        if not isinstance(spec, dict):
            continue
        for key in ("paths", "paths-ignore"):
            for entry in spec.get(key) or []:
                pat = entry[1:] if entry.startswith("!") else entry
                where = f"on.{event}.{key} entry {entry!r}"
                if re.search(r"[*?+\[]", pat):
                    rx = glob_regex(pat)
                    if not any(rx.fullmatch(f) for f in files):
                        errors.append(f"{where} matches no file in the repository")
                elif pat.rstrip("/") in dirs:
                    errors.append(f"{where} is a directory: path filters match files, "
                                  f"use {pat.rstrip('/')}/**")
                elif pat not in files:
                    errors.append(f"{where}: no such file in the repository")
    return [f"rehearse: {rel}: {e}" for e in errors]


def repo_files():
    def ls(*a):
        return set(subprocess.run(["git", "ls-files", *a], cwd=ROOT, capture_output=True, text=True,
                                  check=True).stdout.splitlines())
    return (ls("-c") - ls("-d")) | ls("-o", "--exclude-standard")


# ---------------------------------------------------------------------------
# The rehearsal's machine: the runners' PATH, the workspace.
def runner_path(dest, exclude):
    """PATH entries with this machine's tools less `exclude`: each system
    directory as it is, or, where it holds an excluded tool, a directory of
    links to the rest of it."""
    out = []
    for d in SYSTEM_PATH:
        if not os.path.isdir(d):
            continue
        if not exclude & set(os.listdir(d)):
            out.append(d)
            continue
        farm = dest / d.strip("/").replace("/", "-")
        farm.mkdir(parents=True)
        for e in os.scandir(d):
            if e.name not in exclude and not e.is_dir():
                os.symlink(e.path, farm / e.name)
        out.append(str(farm))
    return out


def workspace_packages():
    """name -> {"dir", "bins"} of every workspace member (for the cargo stand-in)."""
    ws = __import__("tomllib").loads((ROOT / "Cargo.toml").read_text())
    out = {}
    for member in ws["workspace"]["members"]:
        d = ROOT / member
        if not (d / "Cargo.toml").exists():
            continue
        t = __import__("tomllib").loads((d / "Cargo.toml").read_text())
        name = t["package"]["name"]
        declared = t.get("bin") or []
        bins = [b["name"] for b in declared]
        paths = {b.get("path") for b in declared}
        if (d / "src/main.rs").exists() and "src/main.rs" not in paths and t["package"].get("autobins", True):
            bins.append(name)
        if (d / "src/bin").is_dir() and t["package"].get("autobins", True):
            for f in sorted((d / "src/bin").iterdir()):
                if f.suffix == ".rs" and f"src/bin/{f.name}" not in paths:
                    bins.append(f.stem)
        out[name] = {"dir": member, "bins": sorted(set(bins))}
    return out


def install_tools_known():
    """Tools testbed/ci/install-tools.sh knows, with its default versions."""
    text = (ROOT / INSTALL_TOOLS).read_text()
    tools = re.findall(r"^\s{4}([a-z0-9-]+)\)\s*$", text, re.M)
    versions = dict(re.findall(r"^([A-Z0-9]+)_VERSION=\$\{\w+:-([^}]+)\}", text, re.M))
    return {t: versions.get(t.upper().replace("-", "_"), "?") for t in tools}


def shim(path, state, tool, python):
    path.write_text(f"#!/bin/bash\n# rehearsal stand-in for {tool}: testbed/ci/standins.py\n"
                    f"exec {shlex.quote(python)} -I -S {shlex.quote(str(STANDINS_PY))} "
                    f"{shlex.quote(str(state))} {tool} \"$@\"\n")
    path.chmod(0o755)


class Machine:
    """What every job's rehearsal shares: the runners' PATH, the overlay of the
    working tree, the config."""

    def __init__(self, tmp, bin_dir):
        self.tmp = tmp
        self.bin_dir = bin_dir
        # Per kind of runner: what it lacks is hidden (stand-ins shadow the
        # rest of what they stand in for, being first on PATH).
        self.path = {kind: runner_path(tmp / f"path-{kind}", INSTALLABLE | (STANDINS - ships))
                     for kind, ships in RUNNER_TOOLS.items()}
        self.real = {
            "make": shutil.which("make", path=":".join(SYSTEM_PATH)),
            "kubectl": shutil.which("kubectl", path=":".join(SYSTEM_PATH)) or shutil.which("kubectl"),
            "python3": shutil.which("python3", path=":".join(SYSTEM_PATH)) or sys.executable,
            "true": shutil.which("true", path=":".join(SYSTEM_PATH)),
        }
        if not self.real["make"]:
            raise SystemExit("rehearse: no make on this machine (the rehearsal asks the real make)")
        self.packages = workspace_packages()
        self.install_tools = install_tools_known()
        self.sha = git("rev-parse", "HEAD")
        # The working tree's changes, laid over each clone of HEAD.
        self.changed = [f for f in git("ls-files", "-m", "-o", "--exclude-standard").splitlines()]
        self.deleted = git("ls-files", "-d").splitlines()
        self.version = re.search(r'^version = "(.*)"', (ROOT / "Cargo.toml").read_text(), re.M).group(1)


def git(*args, cwd=ROOT):
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


# ---------------------------------------------------------------------------
# One job (one matrix entry, one pass).
class JobRun:
    def __init__(self, machine, rel, doc, gh, job_id, job, matrix, fail_before=None, wf_state=None):
        self.m, self.rel, self.doc, self.gh = machine, rel, doc, gh
        self.job_id, self.job, self.matrix = job_id, job, matrix
        self.fail_before = fail_before  # pass 2: the step index to fail
        # What the workflow's jobs share: artifacts, the registry's images.
        self.wf_state = wf_state
        self.needs = {}  # the needs context (set before run() by the chain)
        self.upstream = set()  # every job this one needs, directly or not
        self.outputs = {}  # the job's outputs: after a successful run
        self.skipped = None  # why the job was not rehearsed (its needs failed)
        self.failed_step = None  # the index of the step that failed the rehearsal
        self.timings = []  # (seconds, step) of the run: steps (-v)
        self.warnings = []
        self.rehearsed = 0
        label = f"job {job_id}"
        if matrix:
            label += " (" + ", ".join(f"{k}={to_str(v)}" for k, v in matrix.items()) + ")"
        if fail_before is not None:
            label += f" [failure pass: step {fail_before + 1} fails]"
        self.label = label

    def warn(self, where, msg):
        self.warnings.append(f"rehearse: WARNING: {self.rel} / {self.label} / {where}: {msg}")

    # -- set-up ------------------------------------------------------------
    def setup(self):
        self.tmp = Path(tempfile.mkdtemp(prefix=f"job-{self.job_id}-", dir=self.m.tmp))
        self.work = self.tmp / "work" / ROOT.name
        # --shared: the throwaway clone borrows the repository's objects
        # (read-only) rather than copying them; it is removed with the job.
        subprocess.run(["git", "clone", "--quiet", "--shared", str(ROOT), str(self.work)], check=True)
        for f in self.m.changed:
            if (ROOT / f).is_file():
                (self.work / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / f, self.work / f)
        for f in self.m.deleted:
            (self.work / f).unlink(missing_ok=True)
        self.state = self.tmp / "state"
        self.standins = self.tmp / "standins"
        self.home = self.tmp / "home"
        self.runner_temp = self.tmp / "runner-temp"
        for d in (self.state, self.standins, self.home / ".cargo" / "bin", self.runner_temp,
                  self.tmp / "tmp", self.tmp / "files"):
            d.mkdir(parents=True)
        runs_on = self.job.get("runs-on")
        ctxs = {"matrix": {**self.matrix, "__strict__": "matrix"}, "github": self.gh}
        runs_on = [interpolate(x, ctxs, lambda msg: self.warn("runs-on", msg)) for x in runs_on] \
            if isinstance(runs_on, list) else interpolate(runs_on or "", ctxs, lambda msg: self.warn("runs-on", msg))
        kind = runner_kind(runs_on)
        if kind is None:
            self.warn("runs-on", f"unknown runner {self.job.get('runs-on')!r}: rehearsed as ubuntu")
            kind = "ubuntu"
        self.runner = kind
        ships = RUNNER_TOOLS[kind]
        py = sys.executable
        for tool in sorted(STANDINS & ships):
            shim(self.standins / tool, self.state, tool, py)
        # testbed/ci/install-tools.sh: installs stand-ins instead (network).
        tools_shim = self.work / INSTALL_TOOLS
        if tools_shim.exists():
            shim(tools_shim, self.state, "install-tools", py)
        (self.state / "config.json").write_text(json.dumps({
            "python": py, "standins": str(STANDINS_PY), "real": self.m.real,
            "bin_dir": str(self.m.bin_dir) if self.m.bin_dir else None,
            "packages": self.m.packages, "install_tools": self.m.install_tools,
            "runner": kind, "ships": sorted(ships), "installable": sorted(INSTALLABLE),
            "standin_tools": sorted(STANDINS),
            "workflow_state": str(self.wf_state) if self.wf_state else str(self.tmp / "workflow"),
        }, indent=1))
        self.path_dirs = []  # GITHUB_PATH additions, newest first
        self.github_env = {}
        self.steps_ctx = {}
        self.status = "success"
        not_found = (f"() {{ {shlex.quote(py)} -I -S {shlex.quote(str(STANDINS_PY))} "
                     f"{shlex.quote(str(self.state))} not-found \"$@\"; return 127; }}")
        secure = ":".join([str(self.standins), *self.m.path[kind]])
        # The runner's environment, which a workflow's env: may override...
        self.default_env = {
            "HOME": str(self.home), "USER": "runner", "LOGNAME": "runner", "SHELL": "/bin/bash",
            "LANG": "C.UTF-8", "TERM": "dumb", "TMPDIR": str(self.tmp / "tmp"), "CI": "true",
        }
        # ... and GitHub's variables and the rehearsal's own, which it may not.
        self.base_env = {
            # Belt and braces: even a real docker would reach nothing.
            "DOCKER_HOST": "unix:///nonexistent/rehearsal-docker.sock",
            "GITHUB_ACTIONS": "true",
            "GITHUB_WORKSPACE": str(self.work), "GITHUB_JOB": self.job_id,
            "GITHUB_WORKFLOW": to_str(self.gh["workflow"]), "GITHUB_EVENT_NAME": self.gh["event_name"],
            "GITHUB_REF": self.gh["ref"], "GITHUB_REF_NAME": self.gh["ref_name"],
            "GITHUB_REF_TYPE": self.gh["ref_type"], "GITHUB_SHA": self.gh["sha"],
            "GITHUB_REPOSITORY": self.gh["repository"], "GITHUB_REPOSITORY_OWNER": self.gh["repository_owner"],
            "GITHUB_ACTOR": self.gh["actor"], "GITHUB_RUN_ID": "1", "GITHUB_RUN_NUMBER": "1",
            "GITHUB_RUN_ATTEMPT": "1", "GITHUB_SERVER_URL": self.gh["server_url"],
            "GITHUB_API_URL": self.gh["api_url"], "GITHUB_GRAPHQL_URL": self.gh["graphql_url"],
            "GITHUB_HEAD_REF": self.gh["head_ref"], "GITHUB_BASE_REF": self.gh["base_ref"],
            "GITHUB_EVENT_PATH": str(self.tmp / "files" / "event.json"),
            "RUNNER_TEMP": str(self.runner_temp), "RUNNER_TOOL_CACHE": str(self.tmp / "toolcache"),
            "RUNNER_OS": "Linux", "RUNNER_ARCH": "X64", "RUNNER_NAME": "rehearsal",
            "RUNNER_WORKSPACE": str(self.work.parent),
            "REHEARSE_SECURE_PATH": secure,
            "BASH_FUNC_command_not_found_handle%%": not_found,
        }
        (self.tmp / "files" / "event.json").write_text(json.dumps(self.gh["event"]))

    def collect_warnings(self):
        """The stand-ins' warnings (once each)."""
        w = self.state / "warnings" if hasattr(self, "state") else None
        if w and w.exists():
            for line in dict.fromkeys(w.read_text().splitlines()):
                where, _, msg = line.partition("] ")
                self.warn(where.lstrip("[").split(f"{self.job_id} ", 1)[-1], msg)

    def cleanup(self, keep):
        if keep:
            print(f"rehearse: kept {self.tmp}", file=sys.stderr)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)

    # -- contexts ----------------------------------------------------------
    def contexts(self, env):
        return {
            "github": self.gh, "env": {**env, "__strict__": "env"},
            "matrix": {**self.matrix, "__strict__": "matrix"},
            "secrets": _Secrets(), "runner": {"os": "Linux", "arch": "X64", "name": "rehearsal",
                                              "temp": str(self.runner_temp),
                                              "tool_cache": str(self.tmp / "toolcache"),
                                              "__strict__": "runner"},
            "steps": {**self.steps_ctx, "__strict__": "steps"}, "job": {"status": self.status},
            "needs": {**self.needs, "__strict__": "needs"},
            "vars": {"__strict__": "vars"}, "inputs": {"__strict__": "inputs"},
            "strategy": {"fail-fast": True, "job-index": 0, "job-total": 1},
        }

    def env_layer(self, raw, below, where):
        out = dict(below)
        for k, v in (raw or {}).items():
            out[str(k)] = interpolate(v, self.contexts(out), lambda msg: self.warn(where, msg))
        return out

    # -- the job -----------------------------------------------------------
    def run(self):
        wf_env = self.env_layer(self.doc.get("env"), {}, "env")
        job_env = self.env_layer(self.job.get("env"), wf_env, "jobs env")
        defaults = {**((self.doc.get("defaults") or {}).get("run") or {}),
                    **((self.job.get("defaults") or {}).get("run") or {})}
        for name in ("container", "services"):
            if self.job.get(name):
                self.warn(name, f"job {name} are not rehearsed")
        steps = self.job.get("steps") or []
        for i, step in enumerate(steps):
            where = f"step {i + 1} ({step_name(step)})"
            env = self.env_layer(step.get("env"), {**job_env, **self.github_env}, where)
            ctxs = self.contexts(env)
            if not condition(step.get("if"), ctxs, self.status, lambda msg: self.warn(where, msg)):
                continue
            self.rehearsed += 1
            (self.state / "step").write_text(f"{self.rel} {self.job_id} step {i + 1}")
            (self.state / "errors").write_text("")
            try:
                if "run" in step:
                    self.run_step(i, step, env, defaults, where)
                elif "uses" in step:
                    self.uses_step(i, step, ctxs, where)
            except Failure as f:
                if step.get("continue-on-error") is True:
                    self.warn(where, f"failed, continue-on-error: {f.what}")
                    continue
                self.failed_step = i
                raise Failure(f"{where}: {f.what}", f.output) from None
            if self.fail_before is not None and i == self.fail_before:
                self.status = "failure"  # the simulated failure
                if step.get("id"):
                    self.steps_ctx.setdefault(step["id"], {"outputs": {}}).update(
                        outcome="failure", conclusion="failure")
        # The job's outputs, for the jobs that need it.
        ctxs = self.contexts({**job_env, **self.github_env})
        for name, expr in (self.job.get("outputs") or {}).items():
            self.outputs[str(name)] = interpolate(expr, ctxs, lambda msg: self.warn(f"outputs.{name}", msg))
            if self.status == "success" and self.outputs[str(name)] == "":
                self.warn(f"outputs.{name}", f"`{expr}` is empty after the job's steps "
                          "(does a step with that id write it to $GITHUB_OUTPUT?)")

    def run_step(self, i, step, env, defaults, where):
        files = self.tmp / "files"
        gh_files = {}
        for var, name in (("GITHUB_ENV", "env"), ("GITHUB_PATH", "path"), ("GITHUB_OUTPUT", "output"),
                          ("GITHUB_STEP_SUMMARY", "summary"), ("GITHUB_STATE", "state")):
            p = files / f"{name}-{i + 1}"
            p.write_text("")
            gh_files[var] = p
        full = {**self.default_env, **env, **self.base_env, **{k: str(v) for k, v in gh_files.items()}}
        full["PATH"] = ":".join(self.path_dirs + [str(self.standins), str(self.home / ".cargo" / "bin"),
                                                  *self.m.path[self.runner]])
        script = interpolate(step["run"], self.contexts(env), lambda msg: self.warn(where, msg))
        shell = step.get("shell") or defaults.get("shell")
        argv, ext = shell_argv(shell, files / f"step-{i + 1}")
        (files / f"step-{i + 1}{ext}").write_text(script)
        cwd = self.work / (step.get("working-directory") or defaults.get("working-directory") or ".")
        log = files / f"out-{i + 1}.log"
        started = time.monotonic()
        with open(log, "w") as out:
            p = subprocess.Popen(argv, cwd=cwd, env=full, stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                rc = p.wait(timeout=STEP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                raise Failure(f"did not finish within {STEP_TIMEOUT_S}s (a stand-in waiting on "
                              "something?)", tail(log)) from None
        self.timings.append((time.monotonic() - started, where))
        errors = (self.state / "errors").read_text().strip()
        if errors:
            raise Failure(errors.splitlines()[0] + (f" (and {len(errors.splitlines()) - 1} more)"
                                                    if len(errors.splitlines()) > 1 else ""),
                          tail(log) + self.calls_tail(i))
        if rc != 0:
            raise Failure(f"exited {rc}", tail(log) + self.calls_tail(i))
        # What the step asked for the later ones.
        self.github_env.update(parse_env_file(gh_files["GITHUB_ENV"].read_text()))
        for line in gh_files["GITHUB_PATH"].read_text().splitlines():
            if line.strip():
                self.path_dirs.insert(0, line.strip())
        if step.get("id"):
            self.steps_ctx[step["id"]] = {"outputs": parse_env_file(gh_files["GITHUB_OUTPUT"].read_text()),
                                          "outcome": "success", "conclusion": "success"}

    def calls_tail(self, i, n=12):
        log = self.state / "calls.log"
        if not log.exists():
            return ""
        mine = [x for x in log.read_text().splitlines() if x.startswith(f"[{self.rel} {self.job_id} step {i + 1}]")]
        return ("\n  stand-in calls of the step:\n" + "\n".join("    " + x.split("] ", 1)[1] for x in mine[-n:])) \
            if mine else ""

    def uses_step(self, i, step, ctxs, where):
        action = step["uses"].split("@")[0]
        with_ = {k: interpolate(v, ctxs, lambda msg: self.warn(where, msg))
                 for k, v in (step.get("with") or {}).items()}
        strict = self.status == "success"
        if action == "actions/upload-artifact":
            found = match_upload(self.work, with_.get("path", ""))
            mode = with_.get("if-no-files-found", "warn")
            if not found and (strict or mode == "error"):
                raise Failure(f"upload-artifact path {with_.get('path')!r} matches no file after the "
                              "rehearsed steps (is the directory what the step before writes?)")
            if found and self.wf_state and self.fail_before is None:
                self.keep_artifact(with_.get("name") or "artifact", found)
        elif action == "mikepenz/action-junit-report":
            if strict or str(with_.get("require_tests", "")).lower() == "true":
                for pat in re.split(r"[,\n]", with_.get("report_paths", "**/junit-reports/TEST-*.xml")):
                    pat = pat.strip()
                    if pat and not match_glob(self.work, pat):
                        raise Failure(f"action-junit-report report_paths {pat!r} matches no file after "
                                      "the rehearsed steps")
        elif action == "docker/login-action":
            with open(self.state / "docker-logins", "a") as f:
                f.write((with_.get("registry") or "docker.io") + "\n")
        elif action == "actions/download-artifact":
            self.download_artifact(with_)
        elif action == "dtolnay/rust-toolchain":
            targets = [t for t in re.split(r"[,\s]+", with_.get("targets", "")) if t]
            with open(self.state / "rust-targets", "a") as f:
                f.write("".join(t + "\n" for t in targets))
        elif action == "actions/checkout":
            if with_.get("path") or with_.get("repository"):
                self.warn(where, "checkout of another path or repository is not rehearsed")
        # Anything else (toolchains, caches, buildx) is recorded and skipped.
        with open(self.state / "calls.log", "a") as f:
            f.write(f"[{self.rel} {self.job_id} step {i + 1}] uses {step['uses']} {json.dumps(with_)}\n")

    # -- artifacts between jobs ---------------------------------------------
    def keep_artifact(self, name, files):
        """What actions/upload-artifact stores: the files, rooted at their
        common directory (the action's least common ancestor)."""
        paths = [str(self.work / f) for f in files]  # absolute ones stay as they are
        root = os.path.commonpath([str(Path(f).parent) for f in paths])
        dest = self.wf_state / "artifacts" / name
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        (self.wf_state / "artifacts" / f"{name}.job").write_text(self.job_id)
        for f in paths:
            rel = os.path.relpath(f, root)
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dest / rel)

    def download_artifact(self, with_):
        """actions/download-artifact: `name` into `path` (the workspace by
        default), or every artifact into path/<name>/ without a name."""
        if not self.wf_state:
            if with_.get("run-id") or with_.get("github-token"):
                return  # another run's artifacts: not rehearsed
            raise Failure(f"download-artifact {with_.get('name') or '(all)'}: no job of this workflow "
                          "runs before this one (none has `needs:`): on GitHub they all run at once")
        store = self.wf_state / "artifacts"
        path = self.work / (with_.get("path") or ".")
        by = {p.stem: p.read_text() for p in store.glob("*.job")} if store.is_dir() else {}
        if with_.get("pattern") or with_.get("artifact-ids"):
            self.warn("download-artifact", "pattern/artifact-ids are not rehearsed: nothing restored")
            return
        name = with_.get("name")
        have = sorted(p.name for p in store.iterdir() if p.is_dir()) if store.is_dir() else []
        if name and name not in have:
            raise Failure(f"download-artifact: no artifact {name!r}: no job this one needs uploaded "
                          f"one (uploaded: {', '.join(have) or 'none'}; is the job in `needs:`?)")
        if name and by.get(name) not in self.upstream:
            raise Failure(f"download-artifact: artifact {name!r} comes from job {by.get(name)}, which "
                          "this job does not need (directly or through its needs): on GitHub both "
                          "run at once, and the artifact may not be there yet")
        have = [n for n in have if by.get(n) in self.upstream]
        for n in [name] if name else have:
            shutil.copytree(store / n, path if name else path / n, dirs_exist_ok=True)


class _Secrets(dict):
    """secrets.NAME: a placeholder for every NAME (see prop)."""


def step_name(step):
    if step.get("name"):
        return str(step["name"])
    if "run" in step:
        return "run: " + str(step["run"]).strip().splitlines()[0][:60]
    return "uses: " + str(step.get("uses", "?")).split("@")[0]


def shell_argv(shell, base):
    """GitHub's command for a `shell:` (None: bash's default form) and the
    script file's extension."""
    f = str(base)
    if shell in (None, ""):
        return ["bash", "-e", f + ".sh"], ".sh"
    if shell == "bash":
        return ["bash", "--noprofile", "--norc", "-eo", "pipefail", f + ".sh"], ".sh"
    if shell == "sh":
        return ["sh", "-e", f + ".sh"], ".sh"
    if shell == "python":
        return ["python3", f + ".py"], ".py"
    if "{0}" in shell:
        return [x.replace("{0}", f + ".sh") for x in shlex.split(shell)], ".sh"
    raise Failure(f"unknown shell {shell!r}")


def parse_env_file(text):
    """GITHUB_ENV / GITHUB_OUTPUT: NAME=value lines and NAME<<DELIM blocks."""
    out, lines, i = {}, text.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if "<<" in line and ("=" not in line or line.index("<<") < line.index("=")):
            name, delim = line.split("<<", 1)
            j = lines.index(delim, i + 1)
            out[name] = "\n".join(lines[i + 1:j])
            i = j + 1
            continue
        if "=" in line:
            k, v = line.split("=", 1)
            out[k] = v
        i += 1
    return out


def match_glob(root, pat):
    import glob
    return [p for p in glob.glob(pat, root_dir=root, recursive=True) if (root / p).is_file()]


def match_upload(root, spec):
    """Files actions/upload-artifact's `path:` takes (lines; `!` excludes;
    a directory is everything below it)."""
    found = set()
    for line in [x.strip() for x in str(spec).splitlines() if x.strip()]:
        neg = line.startswith("!")
        pat = line[1:] if neg else line
        hits = set()
        for p in __import__("glob").glob(pat, root_dir=root, recursive=True):
            q = root / p  # an absolute path (${{ runner.temp }}/...) stays one
            name = (lambda x: str(x) if os.path.isabs(pat) else str(x.relative_to(root)))
            hits |= {name(x) for x in q.rglob("*") if x.is_file()} if q.is_dir() else {p}
        found = found - hits if neg else found | hits
    return found


def tail(path, n=25):
    lines = Path(path).read_text(errors="replace").splitlines()
    return "\n".join("  | " + x for x in lines[-n:])


# ---------------------------------------------------------------------------
def rehearse_workflow(machine, path, files):
    """(rel, the JobRuns to execute, failures found without running,
    warnings) of one workflow file."""
    rel = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    doc, on = load_workflow(path)
    failures = check_path_filters(rel, on, files)
    try:
        gh = github_context(path, doc, on, machine.sha, machine.version)
    except Failure as f:
        return rel, [], failures + [f"rehearse: {rel}: {f.what}"], []
    runs, warnings = [], []
    jobs = doc.get("jobs") or {}
    chained = any(j.get("needs") for j in jobs.values())
    wf_state = None
    if chained:
        wf_state = Path(tempfile.mkdtemp(prefix="workflow-", dir=machine.tmp))
    for job_id, job in jobs.items():
        w = []
        if "if" in job and not chained:  # chained: decided when its needs have run
            ctxs = {"github": gh, "needs": {}, "vars": {"__strict__": "vars"}, "inputs": {}}
            if not condition(job["if"], ctxs, "success", w.append):
                w.append(f"skipped: `if: {job['if']}` is false for a {gh['event_name']} event")
                warnings += [f"rehearse: WARNING: {rel} / job {job_id}: {x}" for x in w]
                continue
        for matrix in matrix_entries(job, w.append):
            runs.append(JobRun(machine, rel, doc, gh, job_id, job, matrix, wf_state=wf_state))
            # The failure path: the step before the first failure() step fails.
            steps = job.get("steps") or []
            fails = [i for i, s in enumerate(steps) if status_kind(s.get("if"))]
            if fails and fails[0] > 0:
                runs.append(JobRun(machine, rel, doc, gh, job_id, job, matrix, fail_before=fails[0] - 1,
                                   wf_state=wf_state))
        warnings += [f"rehearse: WARNING: {rel} / job {job_id}: {x}" for x in w]
    return rel, runs, failures, warnings


def needs_of(job):
    n = job.get("needs") or []
    return [n] if isinstance(n, str) else list(n)


def job_order(jobs):
    """The jobs' ids in an order that runs each after what it needs."""
    order, seen = [], set()

    def visit(j, path):
        if j in seen:
            return
        if j in path:
            raise Failure(f"jobs need each other in a cycle: {' -> '.join(path + [j])}")
        if j not in jobs:
            raise Failure(f"job {path[-1]} needs {j!r}, which is not a job of the workflow")
        for n in needs_of(jobs[j]):
            visit(n, path + [j])
        seen.add(j)
        order.append(j)
    for j in jobs:
        visit(j, [])
    return order


def execute_chain(runs, keep):
    """The runs of one workflow whose jobs need others, in the order of
    their needs: {run: failure or None}."""
    results = {}
    if not runs:
        return results
    jobs = runs[0].doc.get("jobs") or {}
    try:
        order = job_order(jobs)
    except Failure as f:
        return {r: f"rehearse: {r.rel}: {f.what}" for r in runs}
    outcome = {}  # job id -> (result, outputs)
    for job_id in order:
        mine = [r for r in runs if r.job_id == job_id]
        failed_needs = [n for n in needs_of(jobs[job_id]) if outcome.get(n, ("skipped",))[0] != "success"]
        if failed_needs:
            for r in mine:
                r.skipped = f"not rehearsed: it needs {', '.join(failed_needs)}, which did not succeed"
                results[r] = None
            outcome[job_id] = ("skipped", {})
            continue
        needs = {n: {"result": outcome[n][0], "outputs": outcome[n][1]} for n in needs_of(jobs[job_id])}
        job = jobs[job_id]
        if "if" in job and mine:
            ctxs = {"github": mine[0].gh, "needs": needs, "vars": {"__strict__": "vars"}, "inputs": {}}
            w = []
            if not condition(job["if"], ctxs, "success", w.append):
                for r in mine:
                    r.skipped = f"skipped: `if: {job['if']}` is false"
                    results[r] = None
                outcome[job_id] = ("skipped", {})
                continue
        ok, outputs = True, {}
        upstream, todo = set(), list(needs_of(job))
        while todo:
            n = todo.pop()
            if n not in upstream:
                upstream.add(n)
                todo += needs_of(jobs[n])
        for r in mine:
            r.needs = needs
            r.upstream = upstream
        # A job's matrix entries and passes are independent of each other.
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(4, len(mine)))) as pool:
            results.update(zip(mine, pool.map(lambda r: execute(r, keep), mine)))
        for r in mine:
            if r.fail_before is None:
                ok = ok and results[r] is None
                outputs.update(r.outputs)
        outcome[job_id] = ("success" if ok else "failure", outputs)
    return results


def execute(run, keep):
    try:
        run.setup()
        run.run()
        return None
    except Failure as f:
        return f"rehearse: {run.rel} / {run.label} / {f.what}" + (f"\n{f.output}" if f.output else "")
    finally:
        run.collect_warnings()
        if hasattr(run, "tmp"):
            run.cleanup(keep)


def repeats(run, runs):
    """Whether `run`, a failure pass, failed where its job's first pass did
    already (reported once)."""
    if run.fail_before is None:
        return False
    first = next(r for r in runs if r.job_id == run.job_id and r.matrix == run.matrix
                 and r.fail_before is None)
    return first.failed_step is not None and first.failed_step <= run.fail_before


# Errors planted in small workflows (--self-test, which lint-workflows.sh
# runs): each must fail the rehearsal with the message given, so the
# rehearsal goes on catching the class of bug it was made for.
PLANTS = {
    "make-target": ("steps: [{run: make no-such-target}]", "no target 'no-such-target'"),
    "uninstalled-tool": ("steps: [{run: kind version}]", "tool kind used but never installed"),
    "report-path": ("steps: [{run: make scenario}, {uses: actions/upload-artifact@v4, "
                    "with: {path: target/scenario-reports/}}]", "matches no file"),
    "path-filter": ("steps: [{run: 'true'}]", "no such file in the repository"),
    "failure-path": ("env: {KT_CLUSTER: kt-ci}\n    steps:\n"
                     "      - run: bash testbed/ci/install-tools.sh $RUNNER_TEMP/bin kind kubectl "
                     "&& echo $RUNNER_TEMP/bin >> $GITHUB_PATH\n"
                     "      - run: make scenario TARGET=kind\n"
                     "      - {if: failure(), run: 'kind get kubeconfig --name kt-other || exit 0'}",
                     "no kind cluster named 'kt-other'"),
    "artifact-needs": ("steps:\n      - run: mkdir -p out && echo x > out/f\n"
                       "      - {uses: actions/upload-artifact@v4, with: {name: out, path: out/}}\n"
                       "  use:\n    runs-on: ubuntu-latest\n"
                       "    steps: [{uses: actions/download-artifact@v4, with: {name: out}}]",
                       "none has `needs:`"),
    "cross-linker": ("steps: [{run: 'rustup target add aarch64-unknown-linux-gnu && cargo build "
                     "--release --target aarch64-unknown-linux-gnu -p kt-store'}]",
                     "cargo would link with the host's cc"),
    # A later job pulls a digest the earlier one did not push.
    "unpushed-digest": ("steps:\n      - {uses: docker/login-action@v3, with: {registry: ghcr.io}}\n"
                        "      - run: mkdir c && touch c/kt-store && docker buildx build --push -t "
                        "ghcr.io/kt-dev/kt-store:x -f components/kt-store/Dockerfile c\n"
                        "  pull:\n    needs: plant\n    runs-on: ubuntu-latest\n    steps:\n"
                        "      - run: bash testbed/ci/install-tools.sh $RUNNER_TEMP/bin kind "
                        "&& echo $RUNNER_TEMP/bin >> $GITHUB_PATH\n"
                        "      - run: kind create cluster --name c && docker exec c-control-plane crictl pull "
                        "ghcr.io/kt-dev/kt-store@sha256:" + "0" * 64,
                        "not pushed by any job"),
    # The datasets script (testbed/datasets/on-cluster.sh) with no kt on
    # PATH: the release build's target/release is not added.
    "datasets-kt": ("steps:\n"
                    "      - run: bash testbed/ci/install-tools.sh $RUNNER_TEMP/bin kind kubectl "
                    "&& echo $RUNNER_TEMP/bin >> $GITHUB_PATH\n"
                    "      - run: bash testbed/datasets/on-cluster.sh --flavor kind --cluster kt-ci",
                    "kt is not on PATH"),
    # Needs the runner binary: the bug this rehearsal was made for.
    "runner-env": ("env: {KT_KEEP_CLUSTER: maybe}\n    steps:\n"
                   "      - run: bash testbed/ci/install-tools.sh $RUNNER_TEMP/bin kind kubectl "
                   "&& echo $RUNNER_TEMP/bin >> $GITHUB_PATH\n"
                   "      - run: make scenario TARGET=kind", "the runner refused"),
}


def plant_files(d, with_runner):
    d.mkdir()
    out = {}
    for name, (job, expect) in PLANTS.items():
        if name == "runner-env" and not with_runner:
            continue
        paths = "\n    paths: [no/such/file.rs]" if name == "path-filter" else ""
        p = d / f"plant-{name}.yml"
        p.write_text(f"name: plant-{name}\non:\n  push:\n    branches: [main]{paths}\n"
                     f"jobs:\n  plant:\n    runs-on: ubuntu-latest\n    {job}\n")
        out[p] = expect
    return out


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workflows", nargs="*", type=Path)
    ap.add_argument("--keep", action="store_true", help="keep the rehearsal's directories")
    ap.add_argument("--self-test", action="store_true",
                    help="also rehearse planted errors (PLANTS), each of which must be caught")
    # Mostly waiting on small processes: one more than the cores.
    ap.add_argument("-j", "--jobs", type=int, default=min(4, (os.cpu_count() or 1) + 1),
                    help="jobs rehearsed at once")
    ap.add_argument("-v", "--verbose", action="store_true", help="say how long each run: step took")
    args = ap.parse_args(argv)
    started = time.monotonic()
    workflows = [p if p.is_absolute() else (Path.cwd() / p) for p in args.workflows] or \
        sorted((ROOT / ".github" / "workflows").glob("*.y*ml"))

    bin_dir = os.environ.get("KT_REHEARSE_BIN_DIR")
    runner = Path(bin_dir).resolve() / "kt-scenario" if bin_dir else None
    if not runner or not runner.is_file():
        print("rehearse: " + "!" * 70, file=sys.stderr)
        print(f"rehearse: no kt-scenario binary (KT_REHEARSE_BIN_DIR={bin_dir or '(unset)'}): the "
              "runner's acceptance of the\nrehearse: workflows' arguments and environment is NOT "
              "checked. `make lint-workflows` builds it.", file=sys.stderr)
        print("rehearse: " + "!" * 70, file=sys.stderr)
        if os.environ.get("CI") == "true":
            print("rehearse: CI=true: the runner binary is required", file=sys.stderr)
            return 1
        runner = None

    files = repo_files()
    if runner:
        newest = max((ROOT / f).stat().st_mtime for f in files
                     if f.startswith("components/") and f.endswith(".rs") and (ROOT / f).exists())
        if runner.stat().st_mtime < newest:
            print(f"rehearse: warning: {runner} is older than the sources under components/ "
                  "(rebuild it: cargo build -p kt-scenario)", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix="kt-rehearse-"))
    failures, warnings, plans = [], [], []
    try:
        machine = Machine(tmp, runner.parent if runner else None)
        plants = plant_files(tmp / "plants", runner is not None) if args.self_test else {}
        for path in workflows + list(plants):
            rel, runs, fails, warns = rehearse_workflow(machine, path, files)
            plans.append((path, rel, runs, fails, warns))
        # Runs of workflows whose jobs need others go in order, as one task;
        # every other run is a task of its own.
        tasks = []
        for *_, rs, _, _ in plans:
            if rs and rs[0].wf_state is not None:
                tasks.append(lambda rs=rs: execute_chain(rs, args.keep))
            else:
                tasks += [lambda r=r: {r: execute(r, args.keep)} for r in rs]
        results = {}
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            for done in pool.map(lambda t: t(), tasks):
                results.update(done)
        caught = 0
        for path, rel, runs, fails, warns in plans:
            bad = fails + [results[r] for r in runs if results[r] and not repeats(r, runs)]
            if path in plants:
                if any(plants[path] in b for b in bad):
                    caught += 1
                else:
                    failures.append(f"rehearse: self-test: the planted error of {path.name} was not "
                                    f"caught (expected {plants[path]!r}, got: {bad or 'success'})")
                continue
            failures += bad
            warnings += warns + [w for r in runs for w in r.warnings]
            warnings += list(dict.fromkeys(f"rehearse: WARNING: {rel} / job {r.job_id}: {r.skipped}"
                                           for r in runs if r.skipped))
            if args.verbose:
                for r in runs:
                    for secs, where in r.timings:
                        print(f"rehearse: {rel} / {r.label} / {where}: {secs:.1f}s")
            if not bad:
                runs = [r for r in runs if not r.skipped]
                steps = sum(r.rehearsed for r in runs)
                extra = sum(1 for r in runs if r.fail_before is not None)
                print(f"rehearse: {rel}: {len({r.job_id for r in runs})} job(s), {steps} step(s) rehearsed"
                      + (f" ({extra} failure-path pass(es))" if extra else ""))
        if plants:
            print(f"rehearse: self-test: {caught} of {len(plants)} planted errors caught"
                  + ("" if runner else " (the runner's own check needs KT_REHEARSE_BIN_DIR)"))
    finally:
        if args.keep:
            print(f"rehearse: kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    for w in dict.fromkeys(warnings):
        print(w, file=sys.stderr)
    for f in failures:
        print(f, file=sys.stderr)
    print(f"rehearse: {len(workflows)} workflow(s), {len(failures)} failure(s), "
          f"{time.monotonic() - started:.1f}s", file=sys.stderr if failures else sys.stdout)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

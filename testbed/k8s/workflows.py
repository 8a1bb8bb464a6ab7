"""Checks the workflows for what actionlint does not (`make lint-workflows`
runs it): every third-party action pinned by a full commit SHA with the
tag in a comment, every job with a timeout, every downloaded binary
checked against a checksum, and the cluster workflows keeping their
cluster for the failure dump.

usage: python workflows.py FILE...
"""

import pathlib
import re
import sys

import yaml

USES = re.compile(r"^\s*(?:-\s+)?uses:\s*(\S+)(.*)$")
PINNED = re.compile(r"^[\w.-]+/[\w./-]+@[0-9a-f]{40}$")
# The values of a boolean flag that mean true to the runner (clap's
# BoolishValueParser, case-insensitive).
KEEP = {"1", "true", "t", "yes", "y", "on"}


def check(path):
    errors = []
    text = path.read_text()
    for n, line in enumerate(text.splitlines(), 1):
        m = USES.match(line)
        if not m:
            continue
        ref, rest = m.group(1), m.group(2)
        if ref.startswith("./") or ref.startswith("docker://"):
            continue
        if not PINNED.match(ref):
            errors.append(f"{path}:{n}: {ref} is not pinned by a full commit SHA")
        elif "#" not in rest:
            errors.append(f"{path}:{n}: {ref}: say which tag the SHA is (a `# vX.Y.Z` comment)")
    doc = yaml.safe_load(text)
    for name, job in (doc.get("jobs") or {}).items():
        if "timeout-minutes" not in job:
            errors.append(f"{path}: job {name} has no timeout-minutes")
        for step in job.get("steps") or []:
            run = (step.get("run") or "").replace("\\\n", " ")
            if re.search(r"curl\b[^\n]*-o\b", run) and "sha256sum" not in run:
                errors.append(f"{path}: job {name}: step {step.get('name', '?')!r} downloads "
                              "without checking a checksum")
            if re.search(r"curl[^|\n]*\|\s*(\w+=\S+\s+)*(ba)?sh\b", run):
                errors.append(f"{path}: job {name}: step {step.get('name', '?')!r} pipes a "
                              "download into a shell")
    env = doc.get("env") or {}
    if re.search(r"TARGET=(kind|k3d)", text):
        # The runner reads KT_KEEP_CLUSTER as a boolean (1/true/yes/on keep);
        # testbed/ci/rehearse.py checks that the runner built here accepts
        # the value the workflow sets.
        keep = str(env.get("KT_KEEP_CLUSTER")).lower()  # YAML's true/1 unquoted too
        if keep not in KEEP:
            errors.append(f"{path}: a cluster workflow must keep its cluster (KT_KEEP_CLUSTER: "
                          "\"1\") so the failure dump sees it, and delete it in a last step")
        if "cluster delete" not in text and "delete cluster" not in text:
            errors.append(f"{path}: the kept cluster is never deleted")
    return errors


def main(files):
    errors = [e for f in files for e in check(pathlib.Path(f))]
    for e in errors:
        print(e, file=sys.stderr)
    print(f"workflows.py: {len(files)} file(s), {len(errors)} problem(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

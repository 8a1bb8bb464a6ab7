"""Validates rendered Kubernetes manifests offline.

Core kinds: kubernetes-validate's bundled JSON schemas (strict: unknown
fields are errors) of the three newest Kubernetes minor versions it ships,
and of the versions the kind and k3d testbeds run (their node images,
pinned in testbed/kind/cluster.yaml and testbed/k3d/config.yaml).
Custom resources (of the CRDs that operators install: the Prometheus
Operator's ServiceMonitor, cert-manager's Issuer and Certificate): the small
schemas in schemas/ (<kind>-<first label of the group>-<version>.json); a
kind with neither fails the run.

usage: python validate.py FILE...   (prints one line per file; exit 1 on any error)
"""

import json
import pathlib
import re
import sys

import jsonschema
import yaml
from kubernetes_validate import utils

HERE = pathlib.Path(__file__).resolve().parent
# API groups of custom resources (their CRDs come with an operator),
# validated against schemas/ instead.
CRD_GROUPS = {"monitoring.coreos.com", "cert-manager.io", "kt.dev"}
# kt's own CRDs: custom resources of these groups are checked against the
# schema of the CRD the bundle ships (generated from the Rust types).
KT_CRD_FILES = {"kt.dev": HERE.parent.parent / "kustomize" / "components" / "datasets" / "crd.yaml"}


TESTBEDS = [HERE.parent / "kind" / "cluster.yaml", HERE.parent / "k3d" / "config.yaml"]


def testbed_minors():
    """The Kubernetes minor versions of the testbeds' pinned node images
    (kindest/node:v1.32.2@..., rancher/k3s:v1.32.2-k3s1)."""
    found = set()
    for f in TESTBEDS:
        for m in re.finditer(r"image:\s*\S+:v(\d+)\.(\d+)\.\d+", f.read_text()):
            found.add(f"{m.group(1)}.{m.group(2)}")
        if not found:
            raise SystemExit(f"validate.py: no pinned node image found in {f}")
    return found


def versions(n=3):
    """The newest n minor versions with bundled schemas and the testbeds'
    minors, oldest first."""
    minors = {}
    for v in utils.all_versions():
        minors[utils.major_minor(v)] = v
    key = lambda m: tuple(int(p) for p in m.split("."))  # noqa: E731
    want = set(sorted(minors, key=key)[-n:])
    for m in testbed_minors():
        if m not in minors:
            raise SystemExit(f"validate.py: kubernetes-validate has no schemas for the "
                             f"testbeds' Kubernetes {m}")
        want.add(m)
    return [minors[m] for m in sorted(want, key=key)]


def kt_crd_schema(group, version, kind, path):
    """The openAPIV3Schema of kt's CRD for `kind`, with apiVersion, kind and
    metadata (which the API server adds to every CRD's schema)."""
    crd = yaml.safe_load(path.read_text())
    if crd.get("spec", {}).get("names", {}).get("kind") != kind:
        return None
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            schema = dict(v["schema"]["openAPIV3Schema"])
            props = dict(schema.get("properties") or {})
            props.update({"apiVersion": {"const": f"{group}/{version}"},
                          "kind": {"const": kind}, "metadata": {"type": "object"}})
            schema["properties"] = props
            return schema
    return None


def crd_schema(doc):
    group, _, version = doc["apiVersion"].partition("/")
    if group in KT_CRD_FILES:
        path = KT_CRD_FILES[group]
        return kt_crd_schema(group, version, doc["kind"], path), path
    path = HERE / "schemas" / f"{doc['kind'].lower()}-{group.split('.')[0]}-{version}.json"
    if not path.exists():
        return None, path
    return json.loads(path.read_text()), path


def main(files):
    vs = versions()
    print(f"validate.py: Kubernetes {', '.join(vs)} (kubernetes-validate "
          f"{utils.latest_version()} schemas, strict)")
    errors = 0
    for f in files:
        docs = [d for d in yaml.safe_load_all(pathlib.Path(f).read_text()) if d]
        if not docs:
            print(f"{f}: no objects", file=sys.stderr)
            errors += 1
            continue
        kinds = {}
        for d in docs:
            name = f"{d.get('kind')}/{d.get('metadata', {}).get('name')}"
            group = d.get("apiVersion", "").rpartition("/")[0]
            if group in CRD_GROUPS:
                schema, path = crd_schema(d)
                if schema is None:
                    print(f"{f}: {name}: CRD {d['apiVersion']} has no schema at {path}",
                          file=sys.stderr)
                    errors += 1
                    continue
                for e in jsonschema.Draft202012Validator(schema).iter_errors(d):
                    print(f"{f}: {name}: {'.'.join(map(str, e.absolute_path))}: {e.message} "
                          f"(schema {path.name})", file=sys.stderr)
                    errors += 1
            else:
                for v in vs:
                    try:
                        utils.validate(d, v, strict=True)
                    except utils.ValidationError as e:
                        # The first error of the object (kubernetes-validate
                        # stops there).
                        print(f"{f}: {name}: Kubernetes {v}: "
                              f"{'.'.join(map(str, e.absolute_path))}: {e.message}",
                              file=sys.stderr)
                        errors += 1
                    except utils.SchemaNotFoundError as e:
                        print(f"{f}: {name}: no schema for {d.get('apiVersion')} "
                              f"{d.get('kind')} in Kubernetes {v}: {e}", file=sys.stderr)
                        errors += 1
            kinds[d["kind"]] = kinds.get(d["kind"], 0) + 1
        summary = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
        print(f"{f}: {len(docs)} objects ({summary})")
    if errors:
        print(f"validate.py: {errors} error(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1:]))

"""Datasets placed on nodes before a job starts: the ``Dataset`` resource
(``datasets.kt.dev``), through the Kubernetes API server, as ``kt dataset``.

A Dataset names a source (a kt key, an S3 prefix or a PVC directory) and a
placement; kt's controller seeds it onto the chosen nodes as one broadcast
and labels them ``data.kt.dev/<namespace>.<name>`` so pods can use node
affinity and read it from a hostPath::

    import kt

    ds = kt.datasets.apply("imagenet", key="team/imagenet", replicas=8,
                           wait="Ready", timeout=1800)
    print(ds.phase, ds.version, ds.ready_nodes, [n.name for n in ds.nodes])
    kt.datasets.rm("imagenet", wait=True)

These calls need no kt token nor metadata server: a kubeconfig
(``kubeconfig=``, ``KUBECONFIG``, ``~/.kube/config``) or, in a pod, its
ServiceAccount (which the API server's RBAC must allow to use datasets).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Mapping, Optional, Sequence, Union

from . import _kt
from .errors import InvalidInput

__all__ = ["apply", "get", "ls", "rm", "wait", "Dataset", "NodeCopy", "Condition", "Phase"]

Phase = Literal["Pending", "Ingesting", "Seeding", "Ready", "Failed"]
"""Where a Dataset is in its life."""

_PHASES = ("Pending", "Ingesting", "Seeding", "Ready", "Failed")

PathLike = Union[str, "os.PathLike[str]"]


@dataclass(frozen=True)
class NodeCopy:
    """One node's copy: ``state`` is ``Seeding``, ``Ready``, ``Failed``,
    ``Lost`` or ``Removing``."""

    name: str
    state: str
    version: Optional[str] = None
    bytes: int = 0
    path: Optional[str] = None
    message: Optional[str] = None


@dataclass(frozen=True)
class Condition:
    """A condition of the status (``SourceReady``, ``Placed``, ``Ready``)."""

    type: str
    status: str
    reason: str
    message: str = ""


@dataclass(frozen=True)
class Dataset:
    """A Dataset as the API server holds it: its ``spec`` (a dict, as in
    YAML) and what the controller wrote in its status."""

    name: str
    namespace: str
    spec: Dict[str, Any]
    phase: str = "Pending"
    reason: Optional[str] = None
    key: Optional[str] = None
    version: Optional[str] = None
    bytes: Optional[int] = None
    path: Optional[str] = None
    label: Optional[str] = None
    desired_nodes: int = 0
    ready_nodes: int = 0
    nodes: List[NodeCopy] = field(default_factory=list)
    conditions: List[Condition] = field(default_factory=list)
    generation: int = 0
    observed_generation: Optional[int] = None


def _dataset(obj: Mapping[str, Any]) -> Dataset:
    meta = obj.get("metadata", {})
    st = obj.get("status") or {}
    return Dataset(
        name=meta.get("name", ""),
        namespace=meta.get("namespace", ""),
        spec=dict(obj.get("spec", {})),
        phase=st.get("phase", "Pending"),
        reason=st.get("reason"),
        key=st.get("key"),
        version=st.get("version"),
        bytes=st.get("bytes"),
        path=st.get("path"),
        label=st.get("label"),
        desired_nodes=st.get("desiredNodes", 0),
        ready_nodes=st.get("readyNodes", 0),
        nodes=[NodeCopy(name=n["name"], state=n["state"], version=n.get("version"),
                        bytes=n.get("bytes", 0), path=n.get("path"), message=n.get("message"))
               for n in st.get("nodes", [])],
        conditions=[Condition(type=c["type"], status=c["status"], reason=c["reason"],
                              message=c.get("message", ""))
                    for c in st.get("conditions", [])],
        generation=meta.get("generation", 0),
        observed_generation=st.get("observedGeneration"),
    )


def _call(op: str, *, name: Optional[str] = None, spec: Optional[str] = None,
          manifest: Optional[str] = None, wait: Optional[str] = None, timeout: float = 600.0,
          kubeconfig: Optional[PathLike] = None, context: Optional[str] = None,
          namespace: Optional[str] = None) -> Any:
    call = getattr(_kt, "datasets_call", None)
    if call is None:
        raise InvalidInput("kt.datasets: this kt package was built without the `kube` feature")
    if wait is not None and wait not in _PHASES:
        raise InvalidInput(f"wait: {wait!r} is not a phase (one of {', '.join(_PHASES)})")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise InvalidInput(f"timeout: {timeout!r} is not a positive number of seconds")
    return json.loads(call(op, name, spec, manifest, wait, float(timeout),
                           os.fspath(kubeconfig) if kubeconfig is not None else None,
                           context, namespace))


def apply(name: Optional[str] = None, *, key: Optional[str] = None, s3: Optional[str] = None,
          endpoint: Optional[str] = None, region: Optional[str] = None,
          credentials_secret: Optional[str] = None, pvc: Optional[str] = None,
          replicas: Optional[int] = None, node_selector: Optional[Mapping[str, str]] = None,
          path: Optional[str] = None, version: Optional[str] = None,
          interval: Optional[str] = None, retain: bool = False, manifest: Optional[str] = None,
          wait: Optional[Phase] = None, timeout: float = 600.0,
          kubeconfig: Optional[PathLike] = None, context: Optional[str] = None,
          namespace: Optional[str] = None) -> List[Dataset]:
    """Creates or updates a Dataset (a server-side apply): ``name`` with one
    source — ``key="team/ds"`` (its latest version, or ``version=``),
    ``s3="s3://bucket/prefix"`` (with ``endpoint=``, ``region=``,
    ``credentials_secret=``) or ``pvc="claim[:path]"`` — placed on
    ``replicas`` nodes matching ``node_selector``; or every Dataset of
    ``manifest`` (YAML). With ``wait="Ready"``, returns once each is Ready
    (a Dataset that ends Failed raises :class:`KtError` with its reason).
    Returns the Datasets as applied (or as waited for)."""
    if manifest is not None:
        if any(v is not None for v in (name, key, s3, pvc, replicas, node_selector)):
            raise InvalidInput("manifest= holds the whole Dataset: drop name, source and "
                               "placement arguments")
        out = _call("apply", manifest=manifest, wait=wait, timeout=timeout,
                    kubeconfig=kubeconfig, context=context, namespace=namespace)
    else:
        if not name:
            raise InvalidInput("kt.datasets.apply: a name is needed (or manifest=)")
        if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int)):
            raise InvalidInput(f"replicas: {replicas!r} is not an int")
        selector: Sequence[str] = [f"{k}={v}" for k, v in (node_selector or {}).items()]
        args = {"key": key, "s3": s3, "endpoint": endpoint, "region": region,
                "credentials_secret": credentials_secret, "pvc": pvc, "replicas": replicas,
                "node_selector": list(selector), "path": path, "version": version,
                "interval": interval, "retain": bool(retain)}
        out = _call("apply", name=name, spec=json.dumps(args), wait=wait, timeout=timeout,
                    kubeconfig=kubeconfig, context=context, namespace=namespace)
    return [_dataset(d) for d in out]


def get(name: str, *, kubeconfig: Optional[PathLike] = None, context: Optional[str] = None,
        namespace: Optional[str] = None) -> Dataset:
    """The Dataset ``name`` (:class:`NotFound` when there is none)."""
    return _dataset(_call("get", name=name, kubeconfig=kubeconfig, context=context,
                          namespace=namespace))


def wait(name: str, phase: Phase = "Ready", *, timeout: float = 600.0,
         kubeconfig: Optional[PathLike] = None, context: Optional[str] = None,
         namespace: Optional[str] = None) -> Dataset:
    """Waits until ``name`` is in ``phase`` for its current spec; raises
    :class:`KtError` with the reason when it ends Failed instead, and
    :class:`Timeout` after ``timeout`` seconds."""
    return _dataset(_call("wait", name=name, wait=phase, timeout=timeout,
                          kubeconfig=kubeconfig, context=context, namespace=namespace))


def ls(*, kubeconfig: Optional[PathLike] = None, context: Optional[str] = None,
       namespace: Optional[str] = None) -> List[Dataset]:
    """Every Dataset of the namespace, by name."""
    return [_dataset(d) for d in _call("list", kubeconfig=kubeconfig, context=context,
                                       namespace=namespace)]


def rm(name: str, *, wait: bool = False, timeout: float = 600.0,
       kubeconfig: Optional[PathLike] = None, context: Optional[str] = None,
       namespace: Optional[str] = None) -> bool:
    """Deletes ``name`` (its node copies and labels are removed by the
    controller; with ``wait``, returns once they are). False when there was
    none."""
    return bool(_call("delete", name=name, wait="Ready" if wait else None, timeout=timeout,
                      kubeconfig=kubeconfig, context=context, namespace=namespace))

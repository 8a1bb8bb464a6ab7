"""The reference guide's Python examples, as written (the guide's
``import kubetorch as kt`` is ``import kt``; paths a test cannot write,
such as ``/data/shard/``, come in as arguments; tensors are numpy's, the
guide's are torch's on CUDA). Each function is what one pod runs:
``test_reference.py`` runs them in the loopback testbed's pods, from the
pod's working directory, and ``mypy --strict`` checks them as a user's
code would be checked.
"""

from __future__ import annotations

import sys
from typing import Dict, List

import numpy as np

import kt


def quick_start() -> List[kt.Item]:
    """Quick Start: files to and from the cluster, list and delete."""
    # Upload files to the cluster (from your laptop/CI)
    kt.put(key="my-service/weights", src="./trained_model/")
    # Download files from the cluster
    kt.get(key="my-service/weights", dest="./local_model/")
    # List and delete
    items = kt.ls("my-service")
    kt.rm("my-service/old-checkpoint", recursive=True)
    return items


def quick_file_transfers() -> None:
    """1. Quick file transfers to and from the cluster."""
    kt.get(key="/my_train_svc/my_toy_dataset", dest="dataset.csv")
    kt.put(key="/my_train_svc/train_profile", src="training.profile")


def publish_shard(rank: int) -> None:
    """Point to point: a data processor publishes its shard."""
    # Trainer publishes checkpoint (stays local, no copy to store)
    kt.put(
        key=f"/data_proc_svc/train/data_shard_{rank}",
        src="./data_out.parquet",
        locale="local",  # Zero-copy: data stays on processer pod
    )


def fetch_shards() -> None:
    """Point to point: a training pod fetches every shard."""
    # Training pods fetch all shards directly from data processors (P2P)
    kt.get(key="/data_proc_svc/train/", dest=".")


def publish_features(src: str) -> None:
    """On producer pod - publish data locally (zero-copy)."""
    kt.put(key="features/batch-1", src=src, locale="local")


def consume_features(dest: str) -> kt.GetResult:
    """On consumer pods - fetch directly from producer."""
    return kt.get(key="features/batch-1", dest=dest)


def broadcast_producer(src: str) -> None:
    """Scalable file broadcast: the producer publishes with broadcast
    coordination."""
    kt.put(
        key="dataset/shard-1",
        src=src,
        locale="local",
        broadcast=kt.BroadcastWindow(timeout=30.0),
    )


def broadcast_consumer(dest: str) -> kt.GetResult:
    """Each consumer joins the broadcast tree: pods download from their
    parent in the tree, not all from source."""
    return kt.get(
        key="dataset/shard-1",
        dest=dest,
        broadcast=kt.BroadcastWindow(timeout=30.0),
    )


def weights_producer(src: str) -> None:
    """Producer (rank 0 - root of tree)."""
    kt.put(
        key="model/weights",
        src=src,
        locale="local",
        broadcast=kt.BroadcastWindow(
            group_id="weight-distribution",
            timeout=60.0,
            fanout=50,  # Each node serves up to 50 children
        ),
    )


def weights_consumer(dest: str) -> kt.GetResult:
    """Consumers join the tree as they arrive, and initiate transfer from
    parent immediately, no need to wait for quorum."""
    return kt.get(
        key="model/weights",
        dest=dest,
        broadcast=kt.BroadcastWindow(group_id="weight-distribution", timeout=60.0, fanout=50),
    )


def state_dict() -> Dict[str, np.ndarray]:
    """A model's state dict (numpy stands in for torch)."""
    rng = np.random.default_rng(10)
    return {"layer1.weight": rng.standard_normal((100, 100), dtype=np.float32),
            "layer1.bias": np.arange(100, dtype=np.float32),
            "steps": np.array([10], dtype=np.int64)}


def empty_state_dict() -> Dict[str, np.ndarray]:
    """Pre-allocated tensors with the same structure."""
    return {name: np.zeros_like(t) for name, t in state_dict().items()}


def checkpoint_trainer() -> None:
    """On trainer pod: publish the checkpoint, lent while the process lives
    (it waits for a line on stdin)."""
    kt.put(key="checkpoint/epoch-10", src=state_dict())
    print("put", flush=True)
    sys.stdin.readline()


def checkpoint_inference() -> None:
    """On inference pod."""
    dest = empty_state_dict()  # Pre-allocated tensors with same structure
    kt.get(key="checkpoint/epoch-10", dest=dest)
    # model.load_state_dict(dest): tensors updated in-place
    for name, want in state_dict().items():
        assert (dest[name] == want).all(), name


def tensor_producer() -> None:
    """Producer of one tensor (lent while the process lives)."""
    tensor = np.random.default_rng(1).standard_normal((1000, 1000), dtype=np.float32)
    kt.put(key="activations/layer1", src=tensor)
    print("put", flush=True)
    sys.stdin.readline()


def tensor_consumer() -> None:
    """Consumer (must pre-allocate destination)."""
    dest = np.empty((1000, 1000), dtype=np.float32)
    kt.get(key="activations/layer1", dest=dest)
    assert (dest == np.random.default_rng(1).standard_normal((1000, 1000),
                                                             dtype=np.float32)).all()


def multi_party_putter(gradient_tensor: np.ndarray) -> kt.TensorResult:
    """5. Coordinated multi-party GPU broadcast: a putter pod."""
    # All pods join the same broadcast group
    broadcast = kt.BroadcastWindow(
        group_id="training-sync",
        world_size=8,  # Wait for 8 participants
        timeout=30.0,
    )
    # On putter pods
    return kt.put(key="gradients", src=gradient_tensor, broadcast=broadcast)


def multi_party_getter(dest_tensor: np.ndarray) -> kt.TensorResult:
    """5. Coordinated multi-party GPU broadcast: a getter pod."""
    broadcast = kt.BroadcastWindow(group_id="training-sync", world_size=8, timeout=30.0)
    # On getter pods
    return kt.get(key="gradients", dest=dest_tensor, broadcast=broadcast)


def lifespans() -> None:
    """Lifespan management: what a service's teardown keeps and deletes."""
    # Persistent checkpoint
    kt.put(key="models/final", src="./checkpoint.pt", lifespan="cluster")
    # Temporary training artifacts
    kt.put(key="my-service/temp", src="./logs/", lifespan="resource")

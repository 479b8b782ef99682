"""What a collective is for decides whether it may be compressed.

qcomm compresses the traffic of training: FSDP2 and FSDP1 unshard all-gathers and
gradient reduce-scatters, DDP and HSDP gradient all-reduces, functional collectives of
compiled data-parallel code, and direct ``qcomm.*`` calls. It sends exact what must not
lose precision; three mechanisms, each tested:

1. **Callers that want the full values** (process-group entry points only): a call whose
   Python stack passes through a state-dict, checkpoint or DTensor-redistribution
   module of torch (:data:`EXACT_CALLERS`: ``get_model_state_dict`` /
   ``get_optimizer_state_dict``, FSDP1's full state dict and ``summon_full_params``,
   DCP save and load, ``DTensor.full_tensor()`` / ``redistribute``) goes exact. The
   walk is cached per code object: a few microseconds a call.
2. **Mesh dimensions that are not data-parallel**: DeviceMesh names each dimension's
   group ``mesh_<name>``; a qcomm group whose dimension name does not start with one of
   :data:`DATA_PARALLEL_DIMS` (tensor, context, pipeline, expert parallel: ``tp``,
   ``cp``, ``pp``, ``ep``, ...) sends everything exact. Unnamed dimensions
   (``mesh_dim_0``) compress.
3. **``with qcomm.exact():``** sends every collective of this thread exact, on any
   group, direct calls included.

Broadcasts, point-to-point and object collectives are never compressed at all.
"""

from __future__ import annotations

import contextlib
import sys
import threading

# Path fragments of torch modules whose collectives need the full values. Matched
# against each frame's file name with "/" separators.
EXACT_CALLERS = (
    "torch/distributed/checkpoint/",  # DCP save/load, get_*_state_dict
    "torch/distributed/_state_dict_utils.py",
    "torch/distributed/tensor/_redistribute.py",  # DTensor.full_tensor / redistribute
    "torch/distributed/fsdp/_state_dict_utils.py",  # FSDP1 state dicts
    "torch/distributed/fsdp/_optim_utils.py",  # FSDP1 optimizer state dicts
    "torch/distributed/fsdp/_unshard_param_utils.py",  # FSDP1 summon_full_params
)

# Mesh dimension names whose groups carry data-parallel traffic: names that start with
# one of these (torchtitan's "dp_shard", "dp_replicate", "dp_shard_cp"; torch's HSDP
# examples' "replicate", "shard"; "rep", "data", "fsdp", ...). Any other name (tp, cp,
# pp, ep, "model", ...) goes exact: exact on a data-parallel dimension costs bytes,
# compression on a tensor-parallel one costs accuracy.
DATA_PARALLEL_DIMS = ("dp", "ddp", "fsdp", "hsdp", "rep", "shard", "data", "default")

_local = threading.local()
_verdicts: dict = {}  # code object -> matching EXACT_CALLERS entry or ""


@contextlib.contextmanager
def exact():
    """Send every qcomm collective of this thread exact inside the block (nests)."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def may_compress(state) -> bool:
    """Whether a call on a group of ``state`` may be compressed: not inside
    :func:`exact`, and the group is not exact by purpose (a non-data-parallel mesh
    dimension)."""
    return not getattr(_local, "depth", 0) and state.exact_reason is None


def exact_caller(limit: int = 64) -> str | None:
    """The torch module on this call's stack that needs full values (an entry of
    :data:`EXACT_CALLERS`), or None: the frames' files, outermost ``limit`` frames
    at most."""
    frame = sys._getframe(1)
    for _ in range(limit):
        if frame is None:
            return None
        code = frame.f_code
        verdict = _verdicts.get(code)
        if verdict is None:
            name = code.co_filename.replace("\\", "/")
            verdict = next((p for p in EXACT_CALLERS if p in name), "")
            _verdicts[code] = verdict
        if verdict:
            return verdict
        frame = frame.f_back
    return None


def mesh_dim_reason(desc: str) -> str | None:
    """Why a group of DeviceMesh description ``desc`` (``mesh_<name>``) goes exact, or
    None (data-parallel, unnamed, or not a mesh dimension)."""
    if not desc.startswith("mesh_"):
        return None
    name = desc[len("mesh_"):]
    if name.startswith("dim_") or name.lower().startswith(DATA_PARALLEL_DIMS):
        return None
    return (f"mesh dimension {name!r} is not data-parallel (compressed: names starting "
            f"with {', '.join(DATA_PARALLEL_DIMS)})")

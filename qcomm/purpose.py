"""What a collective is for decides whether it may be compressed.

qcomm compresses the traffic of training: FSDP2 and FSDP1 unshard all-gathers and
gradient reduce-scatters, DDP and HSDP gradient all-reduces, functional collectives of
compiled data-parallel code, and direct ``qcomm.*`` calls. It sends exact what must not
lose precision; three mechanisms, each tested:

1. **Callers that want the full values** (process-group entry points only):
   **DTensor's redistributions** (``DTensor.full_tensor()``, ``redistribute``, and so
   the state dicts and DCP of FSDP2 models) reach a qcomm group through its *exact
   twin* (:func:`install_dtensor_view`): the same members, connections and state, every
   call exact, registered under the group's name plus :data:`TWIN_SUFFIX`. DTensor's
   modules see torch's functional collectives through a view that hands them the twin's
   name for a qcomm group; a traced graph records that name, so this holds under
   ``torch.compile`` too, where no Python frame of DTensor is left when the collective
   runs. Other callers are found on the Python stack: a call whose stack passes through
   a state-dict, checkpoint or DTensor module of torch (:data:`EXACT_CALLERS`:
   ``get_model_state_dict`` / ``get_optimizer_state_dict``, FSDP1's full state dict and
   ``summon_full_params``, DCP save and load) goes exact. The walk is cached per code
   object: a few microseconds a call.
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
import importlib
import sys
import threading
import types

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


# ---------------------------------------------------------------------------------
# DTensor's redistributions: the exact twin, by name

# The twin of qcomm group "<name>" is registered as "<name>" + TWIN_SUFFIX.
TWIN_SUFFIX = ":exact"
# The modules through which DTensor redistributes (every functional collective of
# full_tensor(), redistribute(), DTensor ops' partial reductions): their ``funcol``.
DTENSOR_MODULES = (
    "torch.distributed.tensor.placement_types",
    "torch.distributed.tensor._collective_utils",
    "torch.distributed.tensor._redistribute",
    "torch.distributed.tensor._nonlinear_redux",
    "torch.distributed.tensor._utils",
)
# functions of torch's functional collectives that take a ``group``
_GROUP_FUNCTIONS = ("all_gather_single", "all_gather_tensor", "all_gather_tensor_autograd",
                    "all_gather_single_autograd", "reduce_scatter_single",
                    "reduce_scatter_tensor", "reduce_scatter_single_autograd",
                    "reduce_scatter_tensor_autograd", "all_reduce", "all_reduce_autograd",
                    "all_to_all_single", "all_to_all_single_autograd",
                    "all_gather_inplace", "_resolve_group")
_twins: dict[str, str] = {}  # qcomm group name -> its exact twin's name
_view: types.ModuleType | None = None


def register_twin(name: str) -> str:
    """Record that qcomm group ``name`` has an exact twin; returns the twin's name."""
    _twins[name] = name + TWIN_SUFFIX
    return _twins[name]


def forget_twin(name: str) -> None:
    _twins.pop(name, None)


def _twin_of(group):
    """``group`` (anything funcol takes as a group) as its exact twin's name where it is
    a qcomm group, else unchanged. Plain Python and dict lookups only: Dynamo traces it
    and the graph records the twin's name."""
    import torch.distributed._functional_collectives as funcol

    resolved = funcol._resolve_group(group)
    name = resolved if isinstance(resolved, str) else resolved.group_name
    twin = _twins.get(name)
    return group if twin is None else twin


def _on_twin(fn, index: int):
    def call(*args, **kwargs):
        if len(args) > index:
            args = (*args[:index], _twin_of(args[index]), *args[index + 1:])
        elif "group" in kwargs:
            kwargs["group"] = _twin_of(kwargs["group"])
        return fn(*args, **kwargs)

    call.__name__, call.__doc__ = fn.__name__, fn.__doc__
    return call


def install_dtensor_view() -> None:
    """Give DTensor's modules (:data:`DTENSOR_MODULES`) a view of torch's functional
    collectives whose group-taking functions send a qcomm group's calls to its exact
    twin (idempotent; done when the first qcomm group is made)."""
    global _view
    if _view is not None:
        return
    import inspect

    import torch.distributed._functional_collectives as funcol

    view = types.ModuleType("qcomm.purpose.funcol", funcol.__doc__)
    view.__dict__.update(funcol.__dict__)
    for name in _GROUP_FUNCTIONS:
        fn = getattr(funcol, name, None)
        if fn is not None:
            index = list(inspect.signature(fn).parameters).index("group")
            setattr(view, name, _on_twin(fn, index))
    for module_name in DTENSOR_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # another torch release's layout
            continue
        if getattr(module, "funcol", None) is funcol:
            module.funcol = view
    _view = view

"""The inner group, the one that moves bytes: torch's method names across releases, and
waiting on its Work with an error that names the qcomm collective.

torch 2.13 renamed the flat forms (``all_gather_single``, ``reduce_scatter_single``,
``all_to_all_single``); older releases only have the underscore names
(``_allgather_base``, ``_reduce_scatter_base``, ``alltoall_base``). Every call of an
inner group's collective goes through one of the functions here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_c10d = dist.distributed_c10d


def default(group):
    """``group``, or the default group for None."""
    return _c10d._get_default_group() if group is None else group


def inner_group(group):
    """The group that moves bytes: a qcomm group's inner group, else ``group`` itself."""
    group = default(group)
    return getattr(group, "inner", group)


def method(pg, new: str, old: str):
    """``pg``'s method of torch >= 2.13's name ``new``, or of the older name ``old``."""
    fn = getattr(pg, new, None)
    return fn if fn is not None else getattr(pg, old)


def all_gather(pg, out, inp):
    return method(pg, "all_gather_single", "_allgather_base")(out, inp, _c10d.AllgatherOptions())


def reduce_scatter(pg, out, inp, op):
    opts = _c10d.ReduceScatterOptions()
    opts.reduceOp = op
    return method(pg, "reduce_scatter_single", "_reduce_scatter_base")(out, inp, opts)


def all_to_all(pg, out, inp):
    return method(pg, "all_to_all_single", "alltoall_base")(
        out, inp, [], [], _c10d.AllToAllOptions())


def all_reduce(pg, tensor, op):
    opts = _c10d.AllreduceOptions()
    opts.reduceOp = op
    return pg.allreduce([tensor], opts)


def raise_backend(kind: str, what: str, rank: int, err: BaseException):
    raise dist.DistBackendError(
        f"qcomm {kind}: {what} failed on rank {rank} (a peer died, timed out, or called "
        f"a different collective): {err}") from err


def start(fn, kind: str, what: str, rank: int, *args):
    """``fn(*args)``, an inner collective; a failure to start it names the collective."""
    try:
        return fn(*args)
    except RuntimeError as err:
        raise_backend(kind, what, rank, err)


def wait(work, kind: str, what: str, rank: int) -> None:
    """Wait for an inner Work; its failure becomes an error naming the collective."""
    try:
        work.wait()
    except RuntimeError as err:
        raise_backend(kind, what, rank, err)


# ---------------------------------------------------------------------------------
# Building inner groups (the qcomm backend's own, and the subgroups of two-level plans)

_INNER_TYPES = {"gloo": dist.ProcessGroup.BackendType.GLOO,
                "nccl": dist.ProcessGroup.BackendType.NCCL}


def _inner_map(spec: str | None) -> dict[str, str]:
    """``{"cpu": "gloo", "cuda": "nccl"}`` from ``None`` (by device, like torch's
    default), a backend name, or torch's ``"cpu:gloo,cuda:nccl"`` form."""
    if spec is None:
        cuda = torch.cuda.is_available() and dist.is_nccl_available()
        return {"cpu": "gloo", "cuda": "nccl"} if cuda else {"cpu": "gloo"}
    spec = spec.strip().lower()
    if ":" not in spec:
        if spec == "gloo":
            return {"cpu": "gloo", "cuda": "gloo"}
        if spec == "nccl":
            return {"cuda": "nccl"}
        raise ValueError(f"QCOMM_INNER / CommConfig.inner: unknown backend {spec!r} "
                         "(expected 'gloo', 'nccl' or 'cpu:gloo,cuda:nccl')")
    mapping = {}
    for part in spec.split(","):
        device, _, name = part.partition(":")
        if device.strip() not in ("cpu", "cuda") or name.strip() not in _INNER_TYPES:
            raise ValueError(f"QCOMM_INNER / CommConfig.inner: bad entry {part!r} in {spec!r}")
        mapping[device.strip()] = name.strip()
    return mapping


def _option_types() -> dict[str, type]:
    """The options type each inner backend's constructor takes, where torch has it."""
    types = {}
    gloo = getattr(dist.ProcessGroupGloo, "_Options", None)
    if gloo is not None:
        types["gloo"] = gloo
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is not None:
        types["nccl"] = nccl.Options
    return types


def check_options(options) -> None:
    """``pg_options`` for a qcomm group go to the inner backend they are made for
    (``ProcessGroupNCCL.Options``, ``ProcessGroupGloo._Options``); others are refused."""
    types = _option_types()
    if options is not None and not isinstance(options, tuple(types.values())):
        raise TypeError(
            "qcomm: pg_options must be the options of an inner backend ("
            + " or ".join(t.__qualname__ for t in types.values())
            + f"), got {type(options).__name__}")


def _make_backend(name: str, store, rank: int, size: int, timeout, options=None):
    """Backend ``name``; ``options`` are the user's when they are of its type."""
    if not isinstance(options, _option_types().get(name, ())):
        options = None
    if name == "gloo":
        if options is not None:
            options._timeout = timeout
            return dist.ProcessGroupGloo(store, rank, size, options)
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    opts = options if options is not None else dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, opts)


def make_inner(store, rank: int, size: int, timeout, spec: str | None, *,
               options=None) -> dist.ProcessGroup:
    """A plain ProcessGroup with real backends per device, as torch builds one;
    ``options`` (the user's ``pg_options``) go to the backend they are made for."""
    pg = dist.ProcessGroup(store, rank, size)
    made: dict[str, object] = {}
    mapping = _inner_map(spec)
    for device, name in mapping.items():
        if name not in made:
            made[name] = _make_backend(name, dist.PrefixStore(f"inner/{name}/", store),
                                       rank, size, timeout, options)
        pg._register_backend(torch.device(device), _INNER_TYPES[name], made[name])
    first = next(iter(mapping.values()))
    pg._set_default_backend(_INNER_TYPES[first])
    return pg


def completed_work(result=None):
    """A Work that is already complete (what compressed calls return)."""
    fut = torch.futures.Future()
    fut.set_result(result if result is not None else [])
    return torch._C._distributed_c10d._create_work_from_future(fut)

"""The ``"qcomm"`` torch.distributed backend: a Python ProcessGroup over an inner one.

``import qcomm`` registers it; ``dist.init_process_group("qcomm")`` (and ``new_group``,
DeviceMesh dimensions, HSDP) then build a :class:`QcommProcessGroup` whose inner group
is gloo for CPU tensors and NCCL for CUDA tensors (``CommConfig.inner`` /
``QCOMM_INNER`` override it). :func:`wrap` puts one over an existing group.

This module is plumbing: it maps every torch entry point that reaches an all-gather,
reduce-scatter or all-reduce (both generations of method names: torch <= 2.12 calls
``_allgather_base`` / ``_reduce_scatter_base`` / ``alltoall_base``, >= 2.13
``all_gather_single`` / ``reduce_scatter_single`` / ``all_to_all_single``; coalesced
and list forms) onto :mod:`qcomm.collectives`, which decides per call what is
compressed. Everything else is forwarded to the inner group unchanged.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from . import collectives as C
from . import driver, functional, handshake, purpose
from . import inner as I
from .config import CommConfig, QuantConfig, as_comm_config, comm_config_or_error, node_key
from .engine import Works
from .topology import Subgroups, plain_subgroups

BACKEND_NAME = "qcomm"
_BACKEND_TYPES = {"ProcessGroupGloo": dist.ProcessGroup.BackendType.GLOO,
                  "ProcessGroupNCCL": dist.ProcessGroup.BackendType.NCCL}
log = logging.getLogger("qcomm")
_c10d = dist.distributed_c10d


def _combine(works: list):
    """One Work for several (:class:`qcomm.engine.Works`); the Work itself for one."""
    works = [w for w in works if w is not None]
    if len(works) == 1:
        return works[0]
    return Works(works) if works else I.completed_work()


def _reduce_op(opts):
    """The ReduceOp in an options object (or a bare ReduceOp / RedOpType)."""
    if opts is None:
        return ReduceOp.SUM
    return getattr(opts, "reduceOp", opts)


def _async(opts) -> bool:
    """Whether the caller wants a Work back (``opts.asyncOp``, which torch >= 2.7 sets
    from ``async_op``; a synchronous call then runs in the caller's thread and returns
    None, which torch accepts). Options without the field, and C++ callers, get a Work."""
    return bool(getattr(opts, "asyncOp", True)) if opts is not None else True


def _check_all(fn: str, **tensors) -> None:
    """A list form's tensors by argument, each checked as the flat forms' are
    (:func:`qcomm.collectives.check_tensor`)."""
    for name, ts in tensors.items():
        for t in ts:
            C.check_tensor(name, t, fn)


def _is_flat_form(outs: list[torch.Tensor], like: torch.Tensor, world: int) -> bool:
    """Whether a list form is the flat form in disguise: ``world`` contiguous tensors of
    ``like``'s size, dtype and device."""
    return len(outs) == world and all(
        o.numel() == like.numel() and o.dtype == like.dtype and o.device == like.device
        and o.is_contiguous() for o in outs
    )


class QcommProcessGroup(dist.ProcessGroup):
    """A process group that sends float all-gathers, reduce-scatters and all-reduces as
    quantized payloads through ``inner`` and passes everything else through exactly."""

    def __init__(self, inner: dist.ProcessGroup, config: CommConfig, *,
                 owns_inner: bool = True, exact: bool = False,
                 subgroups: Subgroups | None = None, nodes: list[str] | None = None,
                 state: driver.GroupState | None = None, error: str | None = None) -> None:
        """``subgroups``, ``nodes`` and ``error`` as :class:`qcomm.driver.GroupState`'s;
        ``state``: another group's (an exact twin shares its group's: the same inner
        group, call order and seeds)."""
        if not isinstance(config, CommConfig):
            raise TypeError(f"config must be a qcomm.CommConfig, got {config!r}")
        super().__init__(inner.rank(), inner.size())
        self._qcomm_state = state if state is not None else driver.GroupState(
            config, inner, subgroups=subgroups, nodes=nodes, error=error)
        self._owns_inner = owns_inner
        self._qcomm_name: str | None = None
        self._qcomm_desc = "undefined"
        self._qcomm_window: list | None = None  # a coalescing window's Works
        # An exact twin sends every call exact (qcomm.purpose: DTensor's calls);
        # a group's twin is made when torch names the group.
        self._qcomm_exact = exact
        self._qcomm_twin: QcommProcessGroup | None = None
        functional.install()  # the functional op that would go around this group
        # The inner group's backends, registered as this group's: torch's C++ reaches a
        # group's backend directly for device binding (init_process_group(device_id=)
        # eager-connects it, new_group splits from it), timeouts, and some functional
        # ops (_c10d_functional's *_out forms on torch 2.13, which then run exact)
        for device in getattr(inner, "_device_types", ()):  # (a Python inner has none)
            backend = inner._get_backend(device)
            kind = _BACKEND_TYPES.get(type(backend).__name__,
                                      dist.ProcessGroup.BackendType.CUSTOM)
            self._register_backend(device, kind, backend)

    @property
    def config(self) -> CommConfig:
        return self._qcomm_state.config

    @property
    def inner(self) -> dist.ProcessGroup:
        """The group that moves this group's bytes (gloo, NCCL)."""
        return self._qcomm_state.inner

    @inner.setter
    def inner(self, group) -> None:
        self._qcomm_state.use_inner(group)

    def __repr__(self) -> str:
        return (f"QcommProcessGroup(rank={self.rank()}, size={self.size()}, "
                f"inner={self.inner.name()}, name={self._qcomm_name!r})")

    # -- names: the C++ base reads them from its (absent) backends -------------------
    @property
    def group_name(self) -> str:
        if self._qcomm_name is None:
            raise RuntimeError("ProcessGroup name not set")
        return self._qcomm_name

    @property
    def group_desc(self) -> str:
        return self._qcomm_desc

    def _set_group_name(self, name: str) -> None:
        self._qcomm_name = name
        if not self._qcomm_exact:
            self._make_twin(name)

    def _make_twin(self, name: str) -> None:
        """The exact twin DTensor's redistributions reach this group through
        (:mod:`qcomm.purpose`): the same inner group and state, every call exact,
        registered with torch under the name the purpose module gives it."""
        purpose.install_dtensor_view()
        twin = QcommProcessGroup(self.inner, self.config, owns_inner=False, exact=True,
                                 state=self._qcomm_state)
        twin._qcomm_name = purpose.register_twin(name)
        _unregister(twin._qcomm_name)  # a re-made group's name
        _c10d._register_process_group(twin._qcomm_name, twin)
        self._qcomm_twin = twin

    def _set_group_desc(self, desc: str) -> None:
        self._qcomm_desc = desc
        # DeviceMesh names each dimension's group "mesh_<name>": a dimension that is not
        # data-parallel (tensor, context parallel...) sends everything exact
        reason = purpose.mesh_dim_reason(desc)
        if reason and self._qcomm_state.exact_reason is None:
            log.info("qcomm: group %r sends exact: %s", desc, reason)
        self._qcomm_state.send_exact(reason)

    def getGroupName(self) -> str:  # noqa: N802 (torch's C++-style name)
        return self.group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._set_group_name(name)

    def name(self) -> str:
        return BACKEND_NAME

    def getBackendName(self) -> str:  # noqa: N802
        return BACKEND_NAME

    def _get_backend_name(self) -> str:
        return BACKEND_NAME

    # -- what the caller wants: full values (state dicts, checkpoints, DTensor
    # redistribution) go exact (qcomm.purpose); every compressible entry point below
    # runs inside this
    def _purpose(self):
        if self._qcomm_exact or purpose.exact_caller():
            return purpose.exact()
        return contextlib.nullcontext()

    # -- all-gather ---------------------------------------------------------------
    def all_gather_single(self, output, input, opts=None):  # noqa: A002 (torch's names)
        with self._purpose():
            return self._issued(C.all_gather_into_tensor(output, input, self,
                                                         async_op=_async(opts)))

    _allgather_base = all_gather_single

    def allgather(self, output_tensors, input_tensors, opts=None):
        if isinstance(input_tensors, torch.Tensor):  # allgather(list, tensor) overload
            output_tensors, input_tensors = [output_tensors], [input_tensors]
        works = []
        with self._purpose():
            for outs, inp in zip(output_tensors, input_tensors, strict=True):
                _check_all("allgather", input=[inp], output=outs)
                exact = self._exact_allgather(outs, inp)
                works.append(C.gather_into(
                    self, list(outs), None, inp, async_op=True, exact=exact,
                    can_compress=_is_flat_form(outs, inp, self.size())))
        return self._issued(_combine(works))

    def _exact_allgather(self, outs, inp):
        return lambda: self.inner.allgather([list(outs)], [inp], _c10d.AllgatherOptions())

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return _combine([self.all_gather_single(o, i) for o, i in
                         zip(outputs, inputs, strict=True)])

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        # torch's layout: output_lists[r][i] receives rank r's input_list[i]
        world = self.size()
        if len(output_lists) != world or any(len(o) != len(input_list) for o in output_lists):
            raise ValueError(
                f"all_gather_coalesced: expected {world} output lists (one per rank) of "
                f"{len(input_list)} tensors (one per input), got "
                f"{[len(o) for o in output_lists]}")
        return _combine([self.allgather([[output_lists[r][i] for r in range(world)]], [inp])
                         for i, inp in enumerate(input_list)])

    # -- reduce-scatter -----------------------------------------------------------
    def reduce_scatter_single(self, output, input, opts=None):  # noqa: A002
        with self._purpose():
            return self._issued(C.reduce_scatter_tensor(output, input, _reduce_op(opts),
                                                        self, async_op=_async(opts)))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        if isinstance(output_tensors, torch.Tensor):  # reduce_scatter(out, list, op)
            output_tensors, input_tensors = [output_tensors], [input_tensors]
        op = _reduce_op(opts)
        works = []
        with self._purpose():
            for out, chunks in zip(output_tensors, input_tensors, strict=True):
                _check_all("reduce_scatter", output=[out], input=chunks)
                works.append(C.scatter_from(
                    self, out, list(chunks), None, op, async_op=True,
                    exact=self._exact_reduce_scatter(out),
                    can_compress=_is_flat_form(chunks, out, self.size())))
        return self._issued(_combine(works))

    def _exact_reduce_scatter(self, out):
        def run(op, chunks):
            opts = _c10d.ReduceScatterOptions()
            opts.reduceOp = op
            return self.inner.reduce_scatter([out], [list(chunks)], opts)
        return run

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return _combine([self.reduce_scatter_single(o, i, opts) for o, i in
                         zip(outputs, inputs, strict=True)])

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- all-reduce ---------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        if isinstance(tensors, torch.Tensor):  # allreduce(tensor, op) overload
            tensors = [tensors]
        op = _reduce_op(opts)
        with self._purpose():
            return self._issued(_combine([C.all_reduce(t, op, self, async_op=_async(opts))
                                          for t in tensors]))

    allreduce_coalesced = allreduce

    # -- everything else: exact, through the inner group ----------------------------
    def all_to_all_single(self, *args, **kwargs):
        self._qcomm_state.check_failed()
        self._qcomm_state.engine.drain()
        return self._issued(I.method(self.inner, "all_to_all_single", "alltoall_base")(
            *args, **kwargs))

    alltoall_base = all_to_all_single

    # torch's _coalescing_manager(group, device) brackets collectives that each run here
    # as they are called; the Work _end_coalescing returns replaces theirs (torch drops
    # them), so it stands for every Work issued inside the window.
    def _start_coalescing(self, device) -> None:
        self._qcomm_window = []

    def _end_coalescing(self, device):
        window, self._qcomm_window = self._qcomm_window or [], None
        return _combine(window)

    def _issued(self, work):
        """Every Work this group returns passes here (the coalescing window's record)."""
        window = self._qcomm_window
        if window is not None and work is not None:
            window.append(work)
        return work

    def shutdown(self) -> None:
        if self._qcomm_twin is not None:
            purpose.forget_twin(self._qcomm_name)
            _unregister(self._qcomm_twin._qcomm_name)
            self._qcomm_twin = None
        if self._qcomm_exact:
            return  # the twin's group owns everything it uses
        self._qcomm_state.engine.shutdown()
        if self._owns_inner:
            self.inner.shutdown()
        self._qcomm_state.buffers.clear()

    def abort(self) -> None:
        if self._owns_inner:
            self.inner.abort()


def _unregister(name: str) -> None:
    """Drop ``name`` from torch's registry of groups by name, if it is there."""
    try:
        _c10d._unregister_process_group(name)
    except (KeyError, RuntimeError, ValueError):
        pass


def _forward(name: str):
    def method(self, *args, **kwargs):
        self._qcomm_state.check_failed()
        self._qcomm_state.engine.drain()  # after the compressed calls in flight (order)
        return self._issued(getattr(self.inner, name)(*args, **kwargs))
    method.__name__ = name
    method.__doc__ = f"Exact: forwarded to the inner group's ``{name}``."
    return method


for _name in ("alltoall", "broadcast", "barrier", "send", "recv", "recv_anysource", "gather",
              "scatter", "reduce", "monitored_barrier"):
    setattr(QcommProcessGroup, _name, _forward(_name))


# ---------------------------------------------------------------------------------
# Inner groups and registration

def _create(opts, pg_options=None) -> QcommProcessGroup:
    """The creator ``init_process_group("qcomm")`` / ``new_group`` call (torch's extended
    API: ``opts`` carries store, rank, size and timeout; ``pg_options`` the user's
    backend options, passed to the inner backend they are made for)."""
    store, rank, size, timeout = opts.store, opts.group_rank, opts.group_size, opts.timeout
    I.check_options(pg_options)
    # a bad QCOMM_* value is posted as this rank's config: every rank raises, naming it
    config, error = comm_config_or_error()
    nodes = handshake.check_at_creation(store, rank, size, config, node_key(), error)
    inner = I.make_inner(store, rank, size, timeout, config.inner, options=pg_options)
    # nodes: just agreed, no exchange at the first collective; the subgroups follow
    # dist.set_timeout, which lands on inner
    return QcommProcessGroup(inner, config,
                             subgroups=Subgroups(store, inner, config.inner, rank), nodes=nodes)


def register() -> None:
    """Register the ``"qcomm"`` backend (idempotent; ``import qcomm`` does it)."""
    if BACKEND_NAME.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True,
                                  devices=["cpu", "cuda"])


def wrap(group=None, config: CommConfig | QuantConfig | None = None) -> QcommProcessGroup:
    """A qcomm group of the members of ``group`` (default: the default group), usable
    with ``dist.*`` calls, DeviceMesh and FSDP like any group. ``config``: a
    :class:`~qcomm.CommConfig`, a :class:`~qcomm.QuantConfig` for every collective, or
    None (default): the ``QCOMM_*`` environment.

    Like ``new_group``, every member must call it: it connects the members anew, from
    the group's store, so that the qcomm group and ``group`` never share a socket (an
    asynchronous compressed call in flight on one and the user's next call on the
    other would otherwise interleave their messages on it). A group whose store torch
    does not know (one not made by ``init_process_group`` / ``new_group``) is shared as
    it is, and the caller must order the two groups' calls."""
    group = I.default(group)
    config, error = as_comm_config(config, "qcomm.wrap"), None
    if config is None:
        config, error = comm_config_or_error()
    made = getattr(getattr(group, "_qcomm_state", None), "subgroups", None)
    # a qcomm group's subgroups stay its own: a maker of the same store, whose groups
    # (the two-level plan's) the wrap never shares with the group it wraps
    subgroups = (made.sibling(group.rank()) if made is not None
                 else plain_subgroups(group, group.rank()))
    inner, owns, nodes = I.inner_group(group), False, None
    if subgroups.store is not None and group.size() > 1:
        # configs and nodes agreed through the store, as a new group's at creation
        nodes = handshake.check_at_creation(subgroups.store, group.rank(), group.size(),
                                            config, node_key(), error)
        inner = subgroups.own(group.rank(), group.size())
        owns = True
    pg = QcommProcessGroup(inner, config, owns_inner=owns, subgroups=subgroups, nodes=nodes,
                           error=error)
    name = f"{group.group_name}:qcomm:{id(pg):x}"
    pg._set_group_name(name)
    ranks = dict(_c10d._world.pg_group_ranks.get(group, {r: r for r in range(group.size())}))
    store = _c10d._world.pg_map.get(group, (None, None))[1]
    if hasattr(_c10d, "_register_pg_in_world"):
        _c10d._register_pg_in_world(pg, backend_name=BACKEND_NAME, store=store,
                                    group_name=name, backend_config=BACKEND_NAME,
                                    rank_mapping=ranks)
    else:  # torch <= 2.12 kept the same dictionaries, filled inline
        world = _c10d._world
        world.pg_map[pg] = (BACKEND_NAME, store)
        world.pg_names[pg] = name
        world.pg_backend_config[pg] = BACKEND_NAME
        world.pg_group_ranks[pg] = ranks
        tag = f"ptd:{name}"
        world.tags_to_pg.setdefault(tag, []).append(pg)
        world.pg_to_tag[pg] = tag
        _c10d._register_process_group(name, pg)
    return pg

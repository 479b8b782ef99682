"""One driver for every compressed collective: what a group keeps across calls, and
the chain every call goes through, whoever makes it (the direct calls and the process
group through :mod:`qcomm.collectives`, FSDP2's per-module collectives through
:mod:`qcomm.fsdp`).

:func:`run` takes one call from its validated tensors to its result::

    first call of a plain or wrapped group: the config agreement (handshake)
    which QuantConfig (the call's, or the group's for this kind)
    bits=auto's kind, CPU group -> _run_agreed: every call agreed, exact ones too
    compressible?  no  -> stats (exact), exact()               -> its Work / None
                   yes -> under the group's lock:
                            call index (compressed calls done before it)
                            compressed(Call): the algorithm, which takes its seeds,
                              its descriptor check and its buffers from the Call
                          stats (compressed, wire bytes)       -> a Work / None
                          (async_op: run on the group's worker (CPU) or stream (CUDA),
                          its Work returned at once: qcomm.engine)

Under bits=auto on a CPU group (:func:`_run_agreed`), the way a call goes is decided
from the group's model, the same on every rank, and written in its descriptor beside
its kind, elements, dtype, op and config; the descriptors are compared before any
payload or exact call moves, so ranks that disagree on any of them are refused alike,
whichever way each would have gone. Exact calls of a kind the group could compress
are agreed too (small ones riding in the envelope: no exchange more), and auto's state
changes only once a call has passed its check.

Seeds: one per payload, distinct per (call index, slot), where the algorithm's slot
tells the phases, ranks and chunks of a call apart; the same on every rank for a given
(call, slot), so reruns are reproducible and ranks' rounding errors do not correlate.

The call index is taken when the call runs, not when it is issued: calls run one at a
time in the order they were issued (the worker's queue; a synchronous call drains it
first), so the index follows the callers' order on every rank, and the caller of an
async call never waits for the lock a running call holds (two async all-gathers issued
back to back: the second returns at once). A refused call (:class:`handshake.Refused`,
every rank alike, before any payload moved) leaves the index where it was: the retried
call gets the seeds it would have had without the refusal.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from . import auto, handshake, purpose
from . import inner as I
from .codec import FLOAT_DTYPES, codec_options
from .config import CommConfig, QuantConfig, comm_config_or_error
from .engine import AsyncWork, Engine, on_side_stream
from .layout import PATH_COMPRESSED, PATH_EXACT, PATH_UNDECIDED
from .stats import CollectiveStats, Stats
from .topology import (
    EXACT,
    FLAT,
    TWO_LEVEL,
    Subgroups,
    Topology,
    log_plan_once,
    plain_subgroups,
)

_RedOpType = ReduceOp.RedOpType
COMPRESSIBLE_OPS = (_RedOpType.SUM, _RedOpType.AVG, _RedOpType.PREMUL_SUM)

# Payload buffers kept per (role, device, CUDA stream); a buffer larger than this is
# allocated per call instead (FSDP's biggest flat shards would pin that much memory).
BUFFER_CACHE_MAX_BYTES = 64 << 20


class BufferCache:
    """Grow-only scratch buffers per role, bounded by ``BUFFER_CACHE_MAX_BYTES`` each.

    Safe to reuse across calls: a compressed collective waits for its inner work
    before returning (on CUDA: the current stream waits), and the key includes the
    CUDA stream so FSDP's all-gather and reduce-scatter streams never share one.
    """

    def __init__(self) -> None:
        self._bufs: dict = {}

    def get(self, role: str, numel: int, dtype: torch.dtype, device: torch.device):
        nbytes = numel * dtype.itemsize
        if nbytes > BUFFER_CACHE_MAX_BYTES:
            return torch.empty(numel, dtype=dtype, device=device)
        cuda_stream = (torch.cuda.current_stream(device).cuda_stream
                       if device.type == "cuda" else 0)
        key = (role, dtype, str(device), cuda_stream)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._bufs[key] = buf
        return buf[:numel]

    def nbytes(self) -> int:
        """Bytes the cache holds now (what the soak run watches stay bounded)."""
        return sum(b.numel() * b.element_size() for b in self._bufs.values())

    def clear(self) -> None:
        self._bufs.clear()


class GroupState:
    """What a group needs across calls: config, the inner group that moves its bytes,
    the call counter (seeds), buffers, stats, and whether it has failed.

    Built complete here, and changed only by this module's code (its methods and
    :func:`run`): ``subgroups`` are the topology's connections (None: no store to make
    them from), ``nodes`` every member's node key where the ranks agreed at creation
    (:func:`qcomm.handshake.check_at_creation`), ``connect`` that a plain group's calls
    move to connections of their own at its first call."""

    def __init__(self, config: CommConfig, inner, *, subgroups: Subgroups | None = None,
                 nodes: list[str] | None = None, connect: bool = False,
                 error: str | None = None) -> None:
        self.config = config
        # Why this rank has no config of its own (a bad QCOMM_* value; ``config`` is then
        # the default): posted in its place at the config agreement, which every rank
        # then refuses naming it (qcomm.handshake)
        self.error = error
        # The group's size, asked once: ProcessGroup.size() costs ~2.5 us a call through
        # pybind, and an exact call asked it four times (bench/experiments/exact_path.py at f72c4cf)
        self.world = inner.size() if inner is not None else 1
        # The group that moves the bytes. A plain group's state starts on the group
        # itself and, with ``connect``, moves to connections of its own at its first
        # call through qcomm (:meth:`agree`, Subgroups.own).
        self.inner = inner
        self.connect = connect
        self._codec: dict[str, dict] = {}  # codec keywords by device type (codec_for)
        # The first failure of a call whose inner work had started: every later call on
        # the group raises it (the ranks may be out of step).
        self.failed: BaseException | None = None
        # Compressed calls done: the next call's index (advances identically on every
        # rank; read and advanced under ``lock``, by the call that runs: module docstring)
        self.calls = 0
        self.buffers = BufferCache()
        self.stats = Stats()
        self.lock = threading.Lock()
        # The worker that runs asynchronous compressed calls on CPU, and the streams
        # that run them on CUDA, one per device index (qcomm.engine).
        self.engine = Engine()
        self.streams: dict = {}
        # What the ranks agreed on (the config, every call's descriptor, the envelope's
        # history: qcomm.handshake); the config from the start where they did at creation.
        self.agreement = handshake.Agreement(config=nodes is not None)
        # The members' nodes (qcomm.topology), learned with the config agreement; None
        # until then (and for a group of one rank). subgroups: the two-level plan's.
        self.subgroups = subgroups
        self.topology: Topology | None = None
        self.plan, self.plan_why = FLAT, "no node information"
        # Why every call of this group goes exact, whatever its config (a mesh dimension
        # that is not data-parallel: qcomm.purpose); None: calls may compress.
        self.exact_reason: str | None = None
        # bits=auto's measured model (qcomm.auto), made at the first call it decides
        self.auto: auto.Model | None = None
        if nodes is not None:
            self.learn_topology(nodes, inner.rank())

    def codec_for(self, device: torch.device) -> dict:
        """The codec keywords of this group's calls on ``device``
        (:func:`qcomm.codec.codec_options` of its config), derived once per device type:
        the config is frozen, and a compressed call should not rebuild them."""
        got = self._codec.get(device.type)
        if got is None:
            got = self._codec[device.type] = codec_options(self.config, device)
        return got

    def agree(self, group, kind: str, device: torch.device) -> None:
        """Once per plain or wrapped group, at its first collective through qcomm: a
        plain group's calls move to connections of their own (``connect``:
        :meth:`qcomm.topology.Subgroups.own`, where the group's store is known); every
        rank must hold this config (:meth:`qcomm.handshake.Agreement.agree_config`),
        whose exchange also tells every rank each member's node (the plan)."""
        if self.world == 1 and self.error is not None:
            raise ValueError(f"qcomm: {self.error}")
        if self.agreement.config or self.world == 1:
            return
        with self.lock:
            if self.agreement.config:
                return
            if self.connect and self.subgroups is not None and self.subgroups.store is not None:
                self.inner = self.subgroups.own(group.rank(), group.size())
            self.connect = False
            keys = self.agreement.agree_config(self.inner, self.config, kind, device,
                                               self.record_control, self.error)
            self.learn_topology(keys, self.inner.rank())

    def use_inner(self, inner) -> None:
        """Move the group's bytes to ``inner`` (a group of the same members)."""
        self.inner = inner

    def send_exact(self, reason: str | None) -> None:
        """Every call of the group goes exact for ``reason`` (None: calls may compress
        again): :mod:`qcomm.purpose`."""
        self.exact_reason = reason

    def learn_topology(self, keys: list[str], rank: int) -> None:
        """Every member's node key, in group-rank order (the same list on every rank)."""
        self.topology = Topology(tuple(keys), rank)
        self.plan, self.plan_why = self.topology.plan(self.config.topology,
                                                      self.config.intra_node)
        if self.plan == TWO_LEVEL and (self.subgroups is None or self.subgroups.store is None):
            self.plan, self.plan_why = FLAT, "no store to build the subgroups from"
        log_plan_once(self.topology, self.plan, self.plan_why)

    def check_failed(self) -> None:
        """Raise if an earlier call on this group failed after its inner work started."""
        if self.failed is not None:
            raise dist.DistBackendError(
                "qcomm: not run: an earlier call on this group failed after its inner "
                f"collectives had started, which may leave the ranks out of step: "
                f"{self.failed}") from self.failed

    def record_control(self, kind: str, nbytes: int, group=None) -> None:
        """Control bytes sent to every peer of ``group`` alike (descriptors, the
        agreement, auto's probes), counted against the link they crossed: all of them
        on the node for the two-level plan's node group, none for its group across
        nodes, else (the group's own inner group) the share of the peers on this
        rank's node."""
        made = self.subgroups.made if self.subgroups is not None else None
        if made is not None and group is made[0]:
            intra = nbytes
        elif made is not None and group is made[1]:
            intra = 0
        else:
            intra = split_intra(self, nbytes)
        self.stats.record_control(kind, nbytes, intra)

    def fail(self, err: BaseException) -> None:
        """Fail the group for good (the first failure is the one named)."""
        if self.failed is None:
            self.failed = err


_plain_states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_plain_lock = threading.Lock()


def group_state(group, config: CommConfig | None = None) -> GroupState:
    """The state of ``group`` (None: the default group); created on first use for
    plain groups, with ``config`` or else the config of the ``QCOMM_*`` environment
    variables. A ``config`` other than the one an existing state holds is a
    ValueError naming both (the hook route's :func:`qcomm.fsdp.compress` sets it)."""
    group = I.default(group)
    state = getattr(group, "_qcomm_state", None)
    if state is None:
        with _plain_lock:
            state = _plain_states.get(group)
            if state is None:
                error = None  # a bad QCOMM_* value: refused at the config agreement
                if config is None:
                    config, error = comm_config_or_error()
                state = _plain_states[group] = GroupState(
                    config, group, subgroups=plain_subgroups(group), connect=True,
                    error=error)
                return state
    if config is not None and config != state.config:
        raise ValueError(f"qcomm: the group already runs {state.config!r}; asked for "
                         f"{config!r} (one config per group)")
    return state


def adopt(group, config: CommConfig, device: torch.device) -> GroupState:
    """The state of plain ``group`` running ``config`` (a ValueError if it runs another),
    its config agreed by every rank now: the hook route's groups (:func:`qcomm.fsdp.compress`),
    agreed at install time, which every rank runs, not at a first call that a rank might
    make alone. A collective: every member calls it."""
    group = I.default(group)
    state = group_state(group, config)
    state.agree(group, "all_gather", device)
    return state


def stats(group=None, *, reset: bool = False) -> dict[str, CollectiveStats]:
    """Counters of ``group`` (default: the default group), per collective kind.

    Works for qcomm groups and for plain groups used through the direct functions
    (:func:`qcomm.all_gather_into_tensor`, ...). ``reset=True`` zeroes them after
    reading.
    """
    counters = group_state(group).stats
    snap = counters.snapshot()
    if reset:
        counters.reset()
    return snap


def auto_model(group=None) -> dict | None:
    """bits=auto's model of ``group`` (default: the default group), its measured inputs
    and corrections (:meth:`qcomm.auto.Model.describe`); None before its first auto
    decision."""
    model = group_state(group).auto
    return None if model is None else model.describe()


def inner_of(group):
    """The group that moves ``group``'s bytes (its state's :attr:`GroupState.inner`)."""
    return group_state(group).inner


# ---------------------------------------------------------------------------------
# Decisions


def op_type(op) -> _RedOpType:
    """The RedOpType of ``op`` (a ReduceOp, a RedOpType, or PREMUL_SUM with a factor)."""
    return getattr(op, "op", op)


def premul_factor(op):
    """PREMUL_SUM's factor (float or 0-d tensor); None for any other op."""
    if op_type(op) == _RedOpType.PREMUL_SUM:
        # ``.factor`` is torch >= 2.12; before, only pickling's (op, factor) state has it
        # (torch 2.11 raised AttributeError here on every PREMUL_SUM).
        factor = getattr(op, "factor", None)
        return factor if factor is not None else op.__getstate__()[1]
    return None


def quant_config(kind: str, state: GroupState, config) -> QuantConfig | None:
    """The QuantConfig for one call: ``config`` (a QuantConfig, a CommConfig, or None
    for the group's), or None if this kind is switched off."""
    if config is None:
        config = state.config
    if isinstance(config, CommConfig):
        return getattr(config, kind)
    if isinstance(config, QuantConfig):
        return config
    raise TypeError(f"config must be a QuantConfig, a CommConfig or None, got {config!r}")


def compressible(tensor: torch.Tensor, numel: int, world: int, q: QuantConfig | None,
                 min_numel: int, op=None) -> bool:
    """Whether a call goes as packed payloads: a float32/bf16/fp16 tensor of a
    supported op and at least ``min_numel`` elements (all-gather: the input;
    reduce-scatter: the output; all-reduce: the tensor), quantization switched on for
    it, and peers to send to (one rank alone sends nothing, so nothing is lost)."""
    return (
        q is not None
        and world > 1
        and tensor.dtype in FLOAT_DTYPES
        and numel >= max(min_numel, 1)
        and (op is None or op_type(op) in COMPRESSIBLE_OPS)
    )


def call_seed(base: int, call: int, slot: int) -> int:
    """The seed of one payload: distinct per (call, slot), the same on every rank."""
    return ((base * 0x9E3779B97F4A7C15) ^ (call << 24) ^ slot) & ((1 << 64) - 1)


def peer_bytes(world: int, nbytes: int) -> int:
    """Bytes this rank sends its peers when each of ``world - 1`` gets ``nbytes``
    (how :mod:`qcomm.stats` counts every collective)."""
    return (world - 1) * nbytes


# ---------------------------------------------------------------------------------
# Exact calls


def native_ops(inner, device: torch.device) -> bool:
    """Whether ``inner``'s backend for ``device`` runs AVG and PREMUL_SUM itself (NCCL)."""
    try:
        backend = inner._get_backend(device)
    except (AttributeError, RuntimeError):
        return False
    return type(backend).__name__ == "ProcessGroupNCCL"


def exact_reduce(op, tensor: torch.Tensor, inner=None):
    """How an exact call runs ``op`` on ``inner``: returns (the op to send, PREMUL_SUM's
    factor or None, whether to divide by the world after a SUM). NCCL runs both ops
    natively (sent as they are). Gloo rejects PREMUL_SUM (the caller scales its inputs
    by the factor and sends SUM) and float AVG ("Cannot use ReduceOp.AVG with Gloo":
    SUM, then one division, what NCCL's AVG computes too); integer AVG is left to the
    inner group."""
    if inner is not None and native_ops(inner, tensor.device):
        return op, None, False
    factor = premul_factor(op)
    if factor is not None:
        return ReduceOp.SUM, factor, False
    if op_type(op) == _RedOpType.AVG and tensor.is_floating_point():
        return ReduceOp.SUM, None, True
    return op, None, False


def finish(work, async_op: bool, kind: str, rank: int, divide=None):
    """An exact call's result: its Work (async_op) or nothing, once it has completed
    (a failure names the collective; an async Work fails with the inner group's own
    message when waited for). ``divide=(tensor, k)`` divides the result by k once the
    call has finished (AVG run as SUM): an async call's Work does it as its future
    completes, so it stays asynchronous (where the inner Work has a future)."""
    if async_op and divide is None:
        return work
    if async_op and work is not None:
        out, k = divide

        def divided(future):
            future.value()  # raises the inner call's failure into this Work
            with torch.no_grad():
                out.div_(k)
            return [out]

        try:
            future = work.get_future()
        except RuntimeError:  # a Work without a future (gloo's list reduce-scatter): wait
            future = None
        if future is not None:
            return torch._C._distributed_c10d._create_work_from_future(future.then(divided))
    if work is not None:
        I.wait(work, kind, "the exact (uncompressed) call", rank)
    if divide is not None:
        with torch.no_grad():
            divide[0].div_(divide[1])
    return I.completed_work([divide[0]]) if async_op else None


# ---------------------------------------------------------------------------------
# The driver


@dataclass
class Call:
    """One collective the driver runs through an algorithm (compressed; or, under
    bits=auto, exact after its agreement), as :func:`run` hands it over."""

    kind: str  # "all_gather", "reduce_scatter" or "all_reduce"
    inner: object  # the group that moves the bytes
    state: GroupState
    q: QuantConfig  # how this call's payloads are quantized
    index: int  # compressed calls this group made before this one
    rank: int  # this rank in the group
    world: int  # ranks in the group
    # The codec keywords of this call's payloads (impl, warps: GroupState.codec_for
    # the tensor's device): every codec call passes them.
    codec: dict = field(default_factory=dict)
    # The way its descriptor says it goes (layout.PATHS: compressed, or under bits=auto
    # exact or undecided), and whether every rank has agreed on it already (auto's
    # first call, agreed before its model was measured): then no second check.
    path: int = PATH_COMPRESSED
    agreed: bool = False

    def seed(self, slot: int) -> int:
        """The seed of this call's payload ``slot`` (see the module docstring)."""
        return call_seed(self.state.config.seed ^ self.q.seed, self.index, slot)

    def buffer(self, role: str, numel: int, dtype: torch.dtype, device: torch.device):
        """A scratch buffer of the group's cache (valid until the call returns)."""
        return self.state.buffers.get(role, numel, dtype, device)

    def check_descriptors(self, numel: int, dtype: torch.dtype, op, device: torch.device,
                          body: int = 0):
        """Start the call's descriptor check (None on CUDA, or where the call is agreed
        already): finish it before sending. ``body``: the bytes of payloads that may
        ride in its envelope (:class:`qcomm.handshake.DescriptorCheck`)."""
        if self.agreed:
            return None
        return self.state.agreement.check_call(self.inner, self.state, self.kind, numel,
                                               dtype, self.q, op, self.index, device, body,
                                               self.path)

    def check_received(self, rows: torch.Tensor, numel: int, dtype: torch.dtype,
                       skip: int | None = None) -> None:
        self.state.agreement.check_received(rows, numel, dtype, self.q, skip)

    @property
    def two_level(self) -> bool:
        return self.state.plan == TWO_LEVEL

    @property
    def topology(self) -> Topology:
        return self.state.topology

    def subgroups(self) -> tuple:
        """(intra, inter): the inner groups of this rank's node and of its local index."""
        return self.state.subgroups.get(self.state.topology)

    def on(self, inner, rank: int, world: int) -> Call:
        """This call's view of a subgroup (the same index, config and seeds)."""
        return Call(self.kind, inner, self.state, self.q, self.index, rank, world, self.codec,
                    self.path, self.agreed)

    def flat_bytes(self, wire: int) -> tuple[int, int]:
        """(wire, intra) of a one-level exchange that sends every peer alike."""
        return wire, split_intra(self.state, wire)


def failed_work(state: GroupState, result) -> AsyncWork:
    """A completed Work that raises the group's failure from ``wait()``."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    try:
        state.check_failed()
    except dist.DistBackendError as err:
        future.set_exception(err)
    return AsyncWork(future, result)


def split_intra(state: GroupState, nbytes: int) -> int:
    """The part of ``nbytes``, sent to every peer alike, that went to this rank's node."""
    topo = state.topology
    if topo is None or len(topo.keys) < 2:
        return 0
    return nbytes * topo.same_node_peers() // (len(topo.keys) - 1)


def run(group, kind: str, *, tensor: torch.Tensor, numel: int, logical: int, exact,
        compressed, agreed_exact, result, op=None, config=None, can_compress: bool = True,
        async_op: bool = False, keep=()):
    """Run one collective on ``group``: compressed where it can be, else exact.

    ``tensor`` and ``numel`` decide compressibility (:func:`compressible`), ``logical``
    is the bytes the exact collective would send (stats), ``exact(async_op)`` runs the
    passthrough and returns its result (:func:`finish`), ``compressed(call)`` runs the
    algorithm and returns (wire bytes, those of them sent inside this rank's node),
    ``agreed_exact(call)`` is bits=auto's exact path on a CPU group (its descriptor
    checked first, the exact bytes riding in its envelope where they fit: likewise
    (wire, intra)), ``result`` is what an async call's Work holds (``keep``: the
    inputs not in ``tensor`` or ``result``, which a CUDA call's stream must keep
    alive). ``config`` as :func:`quant_config`; ``can_compress=False`` forces exact,
    and so do the group's plan (members on one node, :mod:`qcomm.topology`) and its
    purpose (:mod:`qcomm.purpose`: ``qcomm.exact()``, a mesh dimension that is not
    data-parallel).

    Under bits=auto (the call's kind in the config's ``auto``) on a CPU group, every
    call the group could compress is agreed before any payload or exact call moves:
    :func:`_run_agreed`.
    """
    group = I.default(group)
    state = group_state(group)
    if state.failed is not None and async_op:
        return failed_work(state, result)  # the failure reaches wait(), as an async one's
    state.check_failed()
    if state.subgroups is not None:
        state.subgroups.follow()  # the served group's timeout, where it changed
    state.agree(group, kind, tensor.device)
    q = quant_config(kind, state, config)
    may = (can_compress and q is not None and state.world > 1 and state.plan != EXACT
           and purpose.may_compress(state))
    # auto: the call's own CommConfig says (the DDP hook's state), else the group's
    auto_kinds = (config if isinstance(config, CommConfig) else state.config).auto
    decides = may and kind in auto_kinds
    may = may and compressible(tensor, numel, state.world, q, state.config.min_numel, op)
    if decides and tensor.device.type == "cpu":
        return _run_agreed(state, kind, tensor, numel, op, q, may, logical, compressed,
                           agreed_exact, result, async_op)
    predicted = None  # auto's (exact, compressed) seconds, where it decides
    if may and decides:  # a CUDA group: no descriptors, its calls cannot be refused
        may, *predicted = decide(state, kind, numel, tensor, q)
    if not may:
        state.stats.record(kind, compressed=False, logical=logical, wire=logical,
                           intra=split_intra(state, logical), predicted=predicted)
        state.engine.drain()  # the inner group's calls in every rank's same order
        if predicted is None or async_op:  # an async exact call's end is NCCL's own
            return exact(async_op)
        with _timing(state, kind, False, numel, tensor, predicted[0]):
            return exact(async_op)
    rank, codec = state.inner.rank(), state.codec_for(tensor.device)

    def body() -> None:
        state.check_failed()  # a call queued behind one that failed
        with state.lock, torch.no_grad():
            call = Call(kind, state.inner, state, q, state.calls, rank, state.world, codec)
            try:
                if predicted is None:
                    wire, intra = compressed(call)
                else:
                    with _timing(state, kind, True, numel, tensor, predicted[1]):
                        wire, intra = compressed(call)
            except handshake.Refused:
                raise  # every rank refused it alike, before any payload: still in step
            except BaseException as err:
                state.fail(err)
                raise
            state.calls += 1
        state.stats.record(kind, compressed=True, logical=logical, wire=wire, intra=intra,
                           predicted=predicted)

    return _issue(state, body, tensor, result, async_op, keep)


def _issue(state: GroupState, body, tensor: torch.Tensor, result, async_op: bool, keep=()):
    """Run ``body``: an async call on the group's worker (CPU: its Work returned at once)
    or stream (CUDA), a synchronous one here, after the calls in flight."""
    if async_op and state.config.asynchronous:
        if tensor.device.type == "cpu":
            return state.engine.submit(body, result)  # qcomm.engine: off the caller's thread
        if tensor.device.type == "cuda":  # on qcomm's stream, after the caller's
            return on_side_stream(state.streams, body, tensor.device,
                                  [tensor, *keep, *result], result)
    state.engine.drain()
    side = state.streams.get(tensor.device.index) if tensor.device.type == "cuda" else None
    if side is not None:  # after the async calls still on qcomm's stream (shared state)
        torch.cuda.current_stream(tensor.device).wait_stream(side)
    body()
    return I.completed_work(result) if async_op else None


def _run_agreed(state: GroupState, kind: str, tensor: torch.Tensor, numel: int, op,
                q: QuantConfig, decidable: bool, logical: int, compressed, agreed_exact,
                result, async_op: bool):
    """One bits=auto call on a CPU group, whose every call of an auto kind is agreed.

    ``decidable``: this rank's call is compressible (:func:`compressible`); auto decides
    it from the group's model (the same on every rank), else it goes exact. The call's
    descriptor carries its way (compressed or exact) beside its kind, elements, dtype,
    op and config, and is checked before any payload or exact call moves: ranks that
    disagree on any of them, or on the way, are refused alike (:class:`Refused`) and
    nothing changes, auto's state included. The exact bytes of a small call ride in
    its envelope (:mod:`qcomm.envelope`): no exchange more than the exact call.

    The model is measured at the first decidable call, once every rank has agreed on it
    (an undecided descriptor), so a call refused there measures nothing. What steers a
    decision changes only once a call has passed its check, on every rank alike
    (:meth:`qcomm.auto.Model.commit`); every committed call's time, async or not, is
    observed, and a due refresh runs after it. A failure anywhere in it, the model's
    probes included, fails the group."""
    device, dtype = tensor.device, tensor.dtype
    rank, codec = state.inner.rank(), state.codec_for(device)

    def body() -> None:
        state.check_failed()  # a call queued behind one that failed
        with state.lock, torch.no_grad():
            model, agreed, predicted = state.auto, False, None
            try:
                if decidable and model is None:
                    first = Call(kind, state.inner, state, q, state.calls, rank, state.world,
                                 codec, PATH_UNDECIDED)
                    first.check_descriptors(numel, dtype, op, device).finish()
                    model = state.auto = _calibrate(state, kind, device, q)
                    agreed = True
                compress = False
                if decidable:
                    compress, *predicted = model.choose(kind, numel, dtype, q)
                call = Call(kind, state.inner, state, q, state.calls, rank, state.world,
                            codec, PATH_COMPRESSED if compress else PATH_EXACT, agreed)
                start = auto.clock()
                wire, intra = compressed(call) if compress else agreed_exact(call)
                seconds = auto.clock() - start
                if compress:
                    state.calls += 1
                if predicted is not None:
                    model.commit(kind, numel, dtype, q, compress)
                    model.observe(kind, compress, numel, dtype, seconds, predicted[compress])
                    if model.due(kind):
                        auto.refresh(state, model, kind, device)
            except handshake.Refused:
                raise  # every rank refused it alike, before any payload: still in step
            except BaseException as err:
                state.fail(err)
                raise
        state.stats.record(kind, compressed=compress, logical=logical, wire=wire, intra=intra,
                           predicted=predicted)

    return _issue(state, body, tensor, result, async_op)


def _calibrate(state: GroupState, kind: str, device: torch.device,
               q: QuantConfig) -> auto.Model:
    """bits=auto's model of ``state``'s group, for the QuantConfigs of its auto kinds
    (``q`` where it has none: a call's own config made the call auto)."""
    configs = [getattr(state.config, k) for k in state.config.auto]
    return auto.calibrate(state, kind, device, [c for c in configs if c is not None] or [q])


def decide(state: GroupState, kind: str, numel: int, tensor: torch.Tensor,
           q: QuantConfig) -> tuple[bool, float, float]:
    """bits=auto's choice for one call of a CUDA group (:mod:`qcomm.auto`), whose calls
    exchange no descriptor: (compress?, predicted exact and compressed seconds). The
    group's model is measured at its first decided call and refreshed from observed
    times (:func:`qcomm.auto.refresh`), each a collective on the inner group at the
    same call on every rank, after the calls in flight; the calls timed by events that
    have completed since the last call are observed first (no wait)."""
    model = state.auto
    if model is None:
        state.engine.drain()
        model = state.auto = _calibrate(state, kind, tensor.device, q)
    model.collect()
    if model.due(kind):
        state.engine.drain()
        auto.refresh(state, model, kind, tensor.device)
    return model.decide(kind, numel, tensor.dtype, q)


@contextlib.contextmanager
def _timing(state: GroupState, kind: str, compressed: bool, numel: int,
            tensor: torch.Tensor, predicted: float):
    """Time what runs inside on the current CUDA stream by two events, read when they
    have completed (:meth:`qcomm.auto.Model.time_later`): a CUDA call's time without a
    sync on the hot path."""
    if tensor.device.type != "cuda":
        yield
        return
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    yield
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    state.auto.time_later(start, end, kind, compressed, numel, tensor.dtype, predicted)

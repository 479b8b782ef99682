"""The quantized collectives, as plain functions over any process group.

Public entry points (torch's signatures plus ``config``); ``group`` may be a qcomm
group (its inner group, config, seeds and counters are used) or any plain group
(gloo, NCCL: a config from the environment and per-group seeds are kept here)::

    all_gather_into_tensor(out, inp, group=None, *, config=None, async_op=False)
    reduce_scatter_tensor(out, inp, op=SUM, group=None, *, config=None, async_op=False)
    all_reduce(tensor, op=SUM, group=None, *, config=None, async_op=False)

Algorithms (``W`` ranks, payloads from :func:`qcomm.quantize`, fixed size per call):

- all-gather: quantize the local shard into one payload, all-gather the payloads,
  dequantize every shard (this rank's own included) into the output: all ranks hold
  identical values. The input is read before the output is written (FSDP2 gathers in
  place: its input is a view into its output).
- reduce-scatter: quantize the ``W - 1`` peer chunks, one payload each (every payload
  carries its own header, and the wire layout puts a payload's meta before its codes,
  so one quantize over the whole input would not split into per-chunk payloads),
  exchange them with one all-to-all, then accumulate in fp32: this rank's own chunk
  exact, each received chunk dequantized once.
- all-reduce (CGX's scatter-reduce-allgather): the reduce-scatter above into fp32,
  then the all-gather above of the re-quantized reduced chunk. Sizes not divisible by
  ``W`` are zero-padded.

What is not compressible (integer/bool/float64 dtypes, ops other than SUM, AVG and
PREMUL_SUM, contributions under ``min_numel``, a collective switched off) goes
through the inner group exactly; PREMUL_SUM, which gloo rejects, is applied here.

Compressed calls complete before they return (``async_op=True`` returns an already
completed Work); on CUDA the inner NCCL work is ordered on the current stream, so
the host does not block.

Failures are errors, never wrong numbers or hangs (tests/test_reliability.py):

- inf/NaN in an input decodes to NaN over its bucket (codec) on every receiving rank;
  the all-reduce's re-quantization of a non-finite sum keeps it non-finite.
- Ranks that disagree (size, dtype, config, collective, op, a skipped call) raise
  ``ValueError`` naming the field on every rank before any payload moves (the
  descriptor exchange below, CPU groups); received payload headers are checked too.
  Configs themselves agree once per group: through the store at creation
  (process_group.py), or at the first collective of a plain or wrapped group.
- A failed inner exchange (a dead peer, the group's timeout) raises
  ``DistBackendError`` naming the qcomm collective and the phase.
- Not covered: a call that is compressed on one rank and exact on another because
  of its size or dtype (the exact call goes to gloo as it is, which aborts on
  mismatched sizes as plain gloo does), and async exact calls, whose Work fails
  with the inner group's own message.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import weakref

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from . import layout
from .codec import FLOAT_DTYPES, Packed, dequantize, quantize
from .config import CommConfig, QuantConfig, comm_config_from_env
from .layout import HEADER_NBYTES, packed_nbytes
from .stats import Stats

_c10d = dist.distributed_c10d
_RedOpType = ReduceOp.RedOpType
COMPRESSIBLE_OPS = (_RedOpType.SUM, _RedOpType.AVG, _RedOpType.PREMUL_SUM)

# Payload buffers kept per (role, device, stream); a buffer larger than this is
# allocated per call instead (FSDP's biggest flat shards would pin that much memory).
BUFFER_CACHE_MAX_BYTES = 64 << 20
# Shapes whose headers a CUDA group has checked, kept at most (a set of small tuples).
CHECKED_MAX = 4096


class _BufferCache:
    """Grow-only scratch buffers per role, bounded by ``BUFFER_CACHE_MAX_BYTES`` each.

    Safe to reuse across calls: a compressed collective waits for its inner work
    before returning (on CUDA: the current stream waits), and the key includes the
    CUDA stream so FSDP's all-gather and reduce-scatter streams never share one.
    """

    def __init__(self) -> None:
        self._bufs: dict = {}

    def get(self, role: str, numel: int, dtype: torch.dtype, device: torch.device):
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes > BUFFER_CACHE_MAX_BYTES:
            return torch.empty(numel, dtype=dtype, device=device)
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        key = (role, dtype, str(device), stream)
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
    """What a group needs across calls: config, the call counter (seeds), buffers, stats."""

    def __init__(self, config: CommConfig, *, agreed: bool = False) -> None:
        self.config = config
        self.calls = itertools.count()  # advances identically on every rank
        self.buffers = _BufferCache()
        self.stats = Stats()
        self.lock = threading.Lock()
        # Whether every rank is known to run this config: True for groups made by
        # init_process_group / new_group (checked through the store at creation); plain
        # and wrapped groups check it at their first collective (ensure_agreed).
        self.agreed = agreed
        # (numel, dtype, config) whose received headers were checked on a CUDA group:
        # reading headers back costs a device sync, which would stall FSDP's overlap
        # if paid per call; CPU groups check every call (free). Bounded: a run of many
        # sizes would otherwise grow it without end.
        self.checked: set = set()

    def next_call(self) -> int:
        return next(self.calls)


_plain_states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_plain_lock = threading.Lock()


def group_state(group) -> GroupState:
    """The state of ``group`` (None: the default group); created on first use for
    plain groups, with the config of the ``QCOMM_*`` environment variables."""
    group = _c10d._get_default_group() if group is None else group
    state = getattr(group, "_qcomm_state", None)
    if state is not None:
        return state
    with _plain_lock:
        state = _plain_states.get(group)
        if state is None:
            state = _plain_states[group] = GroupState(comm_config_from_env())
        return state


def inner_group(group):
    """The group that moves bytes: a qcomm group's inner group, else ``group`` itself."""
    group = _c10d._get_default_group() if group is None else group
    return getattr(group, "inner", group)


# ---------------------------------------------------------------------------------
# torch's method names: 2.13 renamed the flat forms; older releases only have the
# underscore names (pg._allgather_base, pg._reduce_scatter_base, pg.alltoall_base).


def _method(pg, new: str, old: str):
    fn = getattr(pg, new, None)
    return fn if fn is not None else getattr(pg, old)


def inner_all_gather(pg, out, inp):
    return _method(pg, "all_gather_single", "_allgather_base")(out, inp, _c10d.AllgatherOptions())


def inner_reduce_scatter(pg, out, inp, op):
    opts = _c10d.ReduceScatterOptions()
    opts.reduceOp = op
    return _method(pg, "reduce_scatter_single", "_reduce_scatter_base")(out, inp, opts)


def inner_all_to_all(pg, out, inp):
    return _method(pg, "all_to_all_single", "alltoall_base")(
        out, inp, [], [], _c10d.AllToAllOptions())


def inner_all_reduce(pg, tensor, op):
    opts = _c10d.AllreduceOptions()
    opts.reduceOp = op
    return pg.allreduce([tensor], opts)


# ---------------------------------------------------------------------------------
# Decisions and helpers


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


def call_seed(base: int, call: int, stream: int) -> int:
    """The seed of one payload: distinct per (call, stream), where ``stream`` tells
    the phases, ranks and chunks of a call apart; the same on every rank for a given
    (call, stream), so reruns are reproducible."""
    return ((base * 0x9E3779B97F4A7C15) ^ (call << 24) ^ stream) & ((1 << 64) - 1)


# ---------------------------------------------------------------------------------
# Agreement: ranks check that they are in the same collective before payloads move.
#
# Gloo aborts the process (std::terminate in pair.cc, "Received data size doesn't
# match expected size") when a peer sends more bytes than this rank expects, and
# silently leaves the tail unwritten when it sends fewer. Payload sizes follow from
# (numel, dtype, config), so ranks that disagree on any of them must find out before
# the payloads travel. On CPU groups every compressed call therefore all-gathers a
# fixed-size descriptor first, started before the quantize so that its latency hides
# behind the codec, and checked before the payload exchange:
#
#     [0:32]   the payload header this rank would send (layout.py: numel, dtype,
#              bits, scheme, bucket size, norm, rounding); all-reduce: the whole tensor
#     [32]     kind: 1 all-gather, 2 reduce-scatter, 3 all-reduce
#     [33]     reduce op (RedOpType value), 255 for an all-gather
#     [34:40]  reserved, 0
#     [40:48]  call index (uint64 LE): compressed calls this group has made so far
#
# A size-agreement exchange only on the first call per shape (cached) would be
# unsound: a rank that has seen its shape before skips the exchange while a rank on
# a new shape does not, and the mismatched messages abort gloo just the same.
# Measured here (2 ranks, loopback, 2 busy cores): a 48-byte gloo all-gather costs
# ~0.5 ms against ~1.4 ms for a compressed all-gather of 1024 fp32 and ~57 ms of
# 2^20, and it overlaps the quantize. CUDA groups skip it (comparing descriptors on
# the host would synchronize the stream every call) and check received headers once
# per shape instead.

DESC_NBYTES = 48
KIND_IDS = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 3}
KIND_NAMES = {v: k for k, v in KIND_IDS.items()}
# Config fingerprint exchanged once per plain or wrapped group: sha256 hex, then repr.
CONFIG_NBYTES = 1024


def _raise_backend(kind: str, what: str, rank: int, err: BaseException):
    raise dist.DistBackendError(
        f"qcomm {kind}: {what} failed on rank {rank} (a peer died, timed out, or called "
        f"a different collective): {err}") from err


def _wait(work, kind: str, what: str, rank: int) -> None:
    """Wait for an inner Work; its failure becomes an error naming the collective."""
    try:
        work.wait()
    except RuntimeError as err:
        _raise_backend(kind, what, rank, err)


def describe_call(kind: str, numel: int, dtype: torch.dtype, q: QuantConfig, op,
                  call: int) -> bytes:
    """The 48-byte descriptor of one compressed call (layout above)."""
    op_id = 255 if op is None else int(op_type(op))
    return (layout.encode_header(numel, dtype, q) + bytes([KIND_IDS[kind], op_id])
            + bytes(6) + (call & ((1 << 64) - 1)).to_bytes(8, "little"))


def _explain(mine: bytes, theirs: bytes, rank: int, peer: int) -> str:
    """What differs between two descriptors, field by field."""
    if theirs[32] not in KIND_NAMES:
        return f"rank {peer} sent no qcomm descriptor (first bytes {theirs[:8]!r})"
    diff = []
    if mine[32] != theirs[32]:
        diff.append(f"collective: rank {peer} is in {KIND_NAMES[theirs[32]]}, "
                    f"rank {rank} in {KIND_NAMES[mine[32]]}")
    if mine[33] != theirs[33]:
        diff.append(f"reduce op: rank {peer} has {_op_name(theirs[33])}, "
                    f"rank {rank} {_op_name(mine[33])}")
    try:
        a, b = layout.decode_header(mine[:32]), layout.decode_header(theirs[:32])
        diff += [f"{k}: rank {peer} has {b[k]!r}, rank {rank} {a[k]!r}"
                 for k in a if a[k] != b[k]]
    except ValueError as err:
        diff.append(f"rank {peer}'s header: {err}")
    ca, cb = (int.from_bytes(d[40:48], "little") for d in (mine, theirs))
    if ca != cb:
        diff.append(f"call index: rank {peer} is at compressed call {cb}, rank {rank} at {ca} "
                    "(a rank skipped or added a collective)")
    return "; ".join(diff) or "descriptors differ in reserved bytes"


def _op_name(op_id: int) -> str:
    if op_id == 255:
        return "none (all-gather)"
    names = {int(v): k for k, v in _RedOpType.__members__.items()}
    return names.get(op_id, str(op_id))


class Agreement:
    """One descriptor exchange, started when made (before the quantize) and checked by
    :meth:`finish` (wait and compare) before the payloads move. A mismatch raises ``ValueError`` on
    every rank naming the rank and the field; the inputs are untouched by then."""

    def __init__(self, inner, state: GroupState, kind: str, desc: bytes,
                 device: torch.device) -> None:
        self.kind, self.desc, self.rank = kind, desc, inner.rank()
        world = inner.size()
        send = state.buffers.get("desc_send", DESC_NBYTES, torch.uint8, device)
        send.copy_(torch.frombuffer(bytearray(desc), dtype=torch.uint8))
        self.recv = state.buffers.get("desc_recv", world * DESC_NBYTES, torch.uint8, device)
        try:
            self.work = inner_all_gather(inner, self.recv, send)
        except RuntimeError as err:
            _raise_backend(kind, "the descriptor exchange", self.rank, err)
        state.stats.record_control(kind, (world - 1) * DESC_NBYTES)

    def finish(self) -> None:
        _wait(self.work, self.kind, "the descriptor exchange", self.rank)
        rows = self.recv.view(-1, DESC_NBYTES).tolist()
        for peer, row in enumerate(rows):
            theirs = bytes(row)
            if theirs != self.desc:
                why = _explain(self.desc, theirs, self.rank, peer)
                raise ValueError(f"qcomm {self.kind}: ranks disagree ({why}); "
                                 "nothing was sent or written")


def start_agreement(inner, state: GroupState, kind: str, numel: int, dtype: torch.dtype,
                    q: QuantConfig, op, call: int, device: torch.device) -> Agreement | None:
    """Start the descriptor exchange of one compressed call (None on CUDA: see above)."""
    if device.type == "cuda":
        return None
    return Agreement(inner, state, kind, describe_call(kind, numel, dtype, q, op, call), device)


def _config_blob(config: CommConfig) -> bytes:
    text = repr(config).encode()
    blob = hashlib.sha256(text).hexdigest().encode() + text
    return blob[:CONFIG_NBYTES].ljust(CONFIG_NBYTES, b"\0")


def ensure_agreed(group, state: GroupState, inner, kind: str, device: torch.device) -> None:
    """Once per plain or wrapped group, at its first collective through qcomm: every
    rank must hold the same :class:`CommConfig`, or ranks would choose differently
    between compressed and exact calls (and their messages would not match)."""
    if state.agreed or group.size() == 1:
        return
    with state.lock:
        if state.agreed:
            return
        world, rank = inner.size(), inner.rank()
        mine = _config_blob(state.config)
        send = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(device)
        recv = torch.empty(world * CONFIG_NBYTES, dtype=torch.uint8, device=device)
        try:
            work = inner_all_gather(inner, recv, send)
        except RuntimeError as err:
            _raise_backend(kind, "the config agreement", rank, err)
        _wait(work, kind, "the config agreement", rank)
        state.stats.record_control(kind, (world - 1) * CONFIG_NBYTES)
        for peer, row in enumerate(recv.view(world, CONFIG_NBYTES).cpu().tolist()):
            theirs = bytes(row)
            if theirs[:64] != mine[:64]:
                raise ValueError(
                    f"qcomm config differs between ranks: rank {rank} has "
                    f"{mine[64:].rstrip(bytes(1)).decode()}, rank {peer} has "
                    f"{theirs[64:].rstrip(bytes(1)).decode(errors='replace')} (check the "
                    "QCOMM_* environment variables, or the config given to qcomm.wrap)")
        state.agreed = True


def _check_rows(rows: torch.Tensor, numel: int, dtype: torch.dtype, q: QuantConfig,
                skip: int | None, state: GroupState) -> None:
    """Check every received payload's header with one device-to-host copy; a mismatch
    (ranks with different configs or sizes) is a clear error naming the sender."""
    if rows.device.type == "cuda":
        key = (numel, dtype, q)
        if key in state.checked:
            return
        if len(state.checked) >= CHECKED_MAX:
            state.checked.clear()
        state.checked.add(key)
    expected = layout.encode_header(numel, dtype, q)
    heads = rows[:, :HEADER_NBYTES].cpu()
    for r in range(rows.shape[0]):
        if r == skip or bytes(heads[r].tolist()) == expected:
            continue
        try:
            Packed.from_payload(rows[r], numel, dtype, q)
        except ValueError as err:
            raise ValueError(f"payload from rank {r}: {err}") from None
        raise ValueError(f"payload from rank {r} has an unexpected qcomm header")


def _peer_bytes(world: int, nbytes: int) -> int:
    return (world - 1) * nbytes


def completed_work(result=None):
    """A Work that is already complete (what compressed calls return)."""
    fut = torch.futures.Future()
    fut.set_result(result if result is not None else [])
    return torch._C._distributed_c10d._create_work_from_future(fut)


def _exact_avg(op, out: torch.Tensor) -> bool:
    """Whether an exact call must run AVG as SUM and divide here: gloo rejects AVG
    ("Cannot use ReduceOp.AVG with Gloo"); a float SUM then one division is what
    NCCL's AVG computes too. Integer AVG is left to the inner group."""
    return op_type(op) == _RedOpType.AVG and out.is_floating_point()


def _finish(work, async_op: bool, kind: str, rank: int, divide=None):
    """An exact call's result: its Work (async_op) or nothing, once it has completed
    (a failure names the collective; an async Work fails with the inner group's own
    message when waited for). ``divide=(tensor, k)`` divides the result by k after
    the wait (AVG run as SUM), so such a call completes before it returns."""
    if async_op and divide is None:
        return work
    if work is not None:
        _wait(work, kind, "the exact (uncompressed) call", rank)
    if divide is not None:
        divide[0].div_(divide[1])
    return completed_work([divide[0]]) if async_op else None


# ---------------------------------------------------------------------------------
# The compressed algorithms (synchronous; callers have validated the tensors)


@torch.no_grad()
def packed_all_gather(inner, outs: list[torch.Tensor], inp: torch.Tensor, q: QuantConfig,
                      state: GroupState, seed: int, agreement: Agreement | None = None,
                      kind: str = "all_gather", accumulate: bool = False) -> int:
    """All-gather ``inp`` from every rank into ``outs[r]`` as payloads (``accumulate``:
    added into fp32 ``outs``); returns the payload size (bytes this rank sends).
    ``agreement``, when given, is finished (checked) after the quantize and before
    anything is sent or written."""
    n, world = inp.numel(), len(outs)
    nb = packed_nbytes(n, q)
    send = state.buffers.get("ag_send", nb, torch.uint8, inp.device)
    recv = state.buffers.get("ag_recv", world * nb, torch.uint8, inp.device)
    quantize(inp, q, seed=seed, out=send)  # reads inp first
    if agreement is not None:
        agreement.finish()
    _wait(inner_all_gather(inner, recv, send), kind, f"the all-gather of {nb}-byte payloads",
          inner.rank())
    rows = recv.view(world, nb)
    _check_rows(rows, n, inp.dtype, q, skip=None, state=state)
    for r, out in enumerate(outs):
        # payload sizes are multiples of 16 bytes: every row's fp32 meta view is aligned
        dequantize(Packed(rows[r], n, inp.dtype, q), out=out, accumulate=accumulate,
                   check=False)
    return nb


@torch.no_grad()
def packed_reduce_scatter(inner, chunks: list[torch.Tensor], rank: int, q: QuantConfig,
                          state: GroupState, seeds: list[int],
                          agreement: Agreement | None = None,
                          kind: str = "reduce_scatter",
                          residuals: list[torch.Tensor] | None = None
                          ) -> tuple[torch.Tensor, int]:
    """Sum ``chunks[j]`` of every rank into rank j; returns (fp32 sum of this rank's
    chunk, in a scratch buffer; payload size per chunk). ``agreement`` as in
    :func:`packed_all_gather`. ``residuals`` (error feedback): fp32, one per chunk;
    what the last call's quantization left out is added to each peer chunk before it
    is quantized, and what this one leaves out replaces it."""
    world = len(chunks)
    n = chunks[0].numel()
    dtype, device = chunks[0].dtype, chunks[0].device
    nb = packed_nbytes(n, q)
    send = state.buffers.get("rs_send", world * nb, torch.uint8, device).view(world, nb)
    recv = state.buffers.get("rs_recv", world * nb, torch.uint8, device)
    for j, chunk in enumerate(chunks):
        if j == rank:  # the own chunk stays exact; its slot only travels to itself
            continue
        if residuals is None:
            quantize(chunk, q, seed=seeds[j], out=send[j])
            continue
        fed = residuals[j].add_(chunk.reshape(-1))  # the residual becomes what is owed
        quantize(fed.to(dtype), q, seed=seeds[j], out=send[j])
        sent = state.buffers.get("rs_sent", n, torch.float32, device).zero_()
        dequantize(Packed(send[j], n, dtype, q), out=sent, accumulate=True, check=False)
        # A non-finite gradient is sent as it is (its bucket decodes NaN: GradScaler
        # sees the overflow and skips the step) but not owed: an inf kept in the
        # residual would poison every later step of this chunk.
        fed.sub_(sent).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    if agreement is not None:
        agreement.finish()
    _wait(inner_all_to_all(inner, recv, send.view(-1)), kind,
          f"the all-to-all of {nb}-byte payloads", rank)
    rows = recv.view(world, nb)
    _check_rows(rows, n, dtype, q, skip=rank, state=state)
    acc = state.buffers.get("rs_acc", n, torch.float32, device)
    acc.copy_(chunks[rank].reshape(-1))
    for j in range(world):
        if j != rank:
            dequantize(Packed(rows[j], n, dtype, q), out=acc, accumulate=True, check=False)
    return acc, nb


def _apply_op(acc: torch.Tensor, op, world: int) -> None:
    kind = op_type(op)
    if kind == _RedOpType.AVG:
        acc.div_(world)
    elif kind == _RedOpType.PREMUL_SUM:
        # sum(f * x_i) == f * sum(x_i): applied once, in fp32, after the sum.
        acc.mul_(premul_factor(op))


# ---------------------------------------------------------------------------------
# Validation (before any communication)


def _check_tensor(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _check_pair(fn: str, out: torch.Tensor, inp: torch.Tensor, world: int,
                gathered: bool) -> None:
    if out.dtype != inp.dtype:
        raise TypeError(f"{fn}: output dtype {out.dtype} differs from input dtype {inp.dtype}")
    if out.device != inp.device:
        raise ValueError(f"{fn}: output on {out.device}, input on {inp.device}")
    big, small = (out, inp) if gathered else (inp, out)
    if big.numel() != world * small.numel():
        raise ValueError(
            f"{fn}: output has {out.numel()} elements and input {inp.numel()}; over "
            f"{world} ranks the {'output' if gathered else 'input'} must have {world} "
            f"times the elements of the {'input' if gathered else 'output'}"
        )


def _check_contiguous(fn: str, name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{fn}: {name} must be contiguous (shape {tuple(t.shape)}, "
                         f"stride {t.stride()})")


# ---------------------------------------------------------------------------------
# Public functions


def _checked_pair(name: str, out, inp, group, *, gathered: bool):
    """Validate a flat collective's (out, inp) before any communication; resolve the group."""
    out, inp = _check_tensor("out", out), _check_tensor("inp", inp)
    group = _c10d._get_default_group() if group is None else group
    world = group.size()
    _check_pair(name, out, inp, world, gathered=gathered)
    _check_contiguous(name, "out", out)
    _check_contiguous(name, "inp", inp)
    return out, inp, group, world


def all_gather_into_tensor(out: torch.Tensor, inp: torch.Tensor, group=None, *,
                           config=None, async_op: bool = False):
    """Gather ``inp`` of every rank into ``out`` (``world * inp.numel()`` elements),
    quantized per ``config`` (the group's by default). Like
    :func:`torch.distributed.all_gather_into_tensor`; ``inp`` may alias its slot of
    ``out``."""
    out, inp, group, world = _checked_pair("all_gather_into_tensor", out, inp, group,
                                           gathered=True)
    outs = list(out.view(-1).chunk(world)) if inp.numel() else []
    return gather_into(group, outs, out, inp, config=config, async_op=async_op)


@torch.no_grad()
def gather_into(group, outs: list[torch.Tensor], out_flat: torch.Tensor | None,
                inp: torch.Tensor, *, config=None, async_op: bool = False, exact=None,
                can_compress: bool = True):
    """All-gather into per-rank outputs ``outs`` (views of ``out_flat`` when given);
    ``exact()`` is the passthrough to run when the call is not compressed (default:
    the inner flat all-gather into ``out_flat``); ``can_compress=False`` forces it."""
    state, inner = group_state(group), inner_group(group)
    world, n = group.size(), inp.numel()
    ensure_agreed(group, state, inner, "all_gather", inp.device)
    q = quant_config("all_gather", state, config)
    nbytes = n * inp.element_size()
    if not can_compress or not compressible(inp, n, world, q, state.config.min_numel):
        state.stats.record("all_gather", compressed=False, logical=_peer_bytes(world, nbytes),
                           wire=_peer_bytes(world, nbytes))
        work = exact() if exact is not None else inner_all_gather(inner, out_flat, inp)
        return _finish(work, async_op, "all_gather", inner.rank())
    with state.lock:
        call = state.next_call()
        seed = call_seed(state.config.seed ^ q.seed, call, inner.rank())
        agreement = start_agreement(inner, state, "all_gather", n, inp.dtype, q, None, call,
                                    inp.device)
        nb = packed_all_gather(inner, outs, inp, q, state, seed, agreement)
    state.stats.record("all_gather", compressed=True, logical=_peer_bytes(world, nbytes),
                       wire=_peer_bytes(world, nb))
    return completed_work([out_flat] if out_flat is not None else outs) if async_op else None


def reduce_scatter_tensor(out: torch.Tensor, inp: torch.Tensor, op=ReduceOp.SUM, group=None,
                          *, config=None, async_op: bool = False):
    """Reduce ``inp`` (``world * out.numel()`` elements) over the group and scatter:
    rank r gets the reduction of chunk r in ``out``. SUM, AVG and PREMUL_SUM are
    compressed; other ops go exact. Like :func:`torch.distributed.reduce_scatter_tensor`."""
    out, inp, group, world = _checked_pair("reduce_scatter_tensor", out, inp, group,
                                           gathered=False)
    chunks = list(inp.reshape(-1).chunk(world)) if out.numel() else []
    return scatter_from(group, out, chunks, inp, op, config=config, async_op=async_op)


@torch.no_grad()
def scatter_from(group, out: torch.Tensor, chunks: list[torch.Tensor],
                 inp_flat: torch.Tensor | None, op, *, config=None, async_op: bool = False,
                 exact=None, can_compress: bool = True, residuals=None):
    """Reduce-scatter of per-rank input ``chunks`` (views of ``inp_flat`` when given)
    into ``out``; ``exact(op, chunks)`` is the passthrough (default: the inner flat
    reduce-scatter of ``inp_flat``); ``can_compress=False`` forces it.
    ``residuals(world, n, device)``, when given, returns the error-feedback buffers of
    a compressed call (:func:`packed_reduce_scatter`)."""
    state, inner = group_state(group), inner_group(group)
    world, rank, n = group.size(), inner.rank(), out.numel()
    ensure_agreed(group, state, inner, "reduce_scatter", out.device)
    q = quant_config("reduce_scatter", state, config)
    nbytes = n * out.element_size()
    logical = _peer_bytes(world, nbytes)
    if not can_compress or not compressible(out, n, world, q, state.config.min_numel, op):
        state.stats.record("reduce_scatter", compressed=False, logical=logical, wire=logical)
        factor = premul_factor(op)
        if factor is not None:  # gloo rejects PREMUL_SUM: scale copies, then SUM
            op = ReduceOp.SUM
            if exact is None:
                inp_flat = inp_flat * factor
            else:
                chunks = [c * factor for c in chunks]
        avg = _exact_avg(op, out)
        if avg:
            op = ReduceOp.SUM
        work = exact(op, chunks) if exact is not None else inner_reduce_scatter(
            inner, out, inp_flat, op)
        return _finish(work, async_op, "reduce_scatter", rank, divide=(out, world) if avg else None)
    with state.lock:
        call = state.next_call()
        base = state.config.seed ^ q.seed
        seeds = [call_seed(base, call, rank * world + j) for j in range(world)]
        agreement = start_agreement(inner, state, "reduce_scatter", n, out.dtype, q, op, call,
                                    out.device)
        acc, nb = packed_reduce_scatter(
            inner, chunks, rank, q, state, seeds, agreement,
            residuals=None if residuals is None else residuals(world, n, out.device))
        _apply_op(acc, op, world)
        out.copy_(acc.view(out.shape))
    state.stats.record("reduce_scatter", compressed=True, logical=logical,
                       wire=_peer_bytes(world, nb))
    return completed_work([out]) if async_op else None


@torch.no_grad()
def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, *, config=None,
               async_op: bool = False):
    """Reduce ``tensor`` in place over the group (SUM, AVG, PREMUL_SUM compressed by
    scatter-reduce-allgather; other ops exact); every rank ends with identical values.
    Like :func:`torch.distributed.all_reduce`."""
    tensor = _check_tensor("tensor", tensor)
    group = _c10d._get_default_group() if group is None else group
    state, inner = group_state(group), inner_group(group)
    world, rank, numel = group.size(), inner.rank(), tensor.numel()
    ensure_agreed(group, state, inner, "all_reduce", tensor.device)
    q = quant_config("all_reduce", state, config)
    chunk = -(-numel // world)
    if not compressible(tensor, numel, world, q, state.config.min_numel, op):
        nbytes = 2 * _peer_bytes(world, chunk * tensor.element_size())
        state.stats.record("all_reduce", compressed=False, logical=nbytes, wire=nbytes)
        factor = premul_factor(op)
        if factor is not None:  # gloo rejects PREMUL_SUM: scale in place, then SUM
            tensor.mul_(factor)
            op = ReduceOp.SUM
        avg = _exact_avg(op, tensor)
        if avg:
            op = ReduceOp.SUM
        return _finish(inner_all_reduce(inner, tensor, op), async_op, "all_reduce", rank,
                       divide=(tensor, world) if avg else None)
    with state.lock:
        call = state.next_call()
        base = state.config.seed ^ q.seed
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        flat = work.view(-1)
        padded = flat
        if chunk * world != numel:
            padded = state.buffers.get("ar_pad", chunk * world, tensor.dtype, tensor.device)
            padded[numel:].zero_()
            padded[:numel].copy_(flat)
        chunks = list(padded.split(chunk))
        seeds = [call_seed(base, call, 2 * (rank * world + j)) for j in range(world)]
        agreement = start_agreement(inner, state, "all_reduce", numel, tensor.dtype, q, op,
                                    call, tensor.device)
        acc, nb_rs = packed_reduce_scatter(inner, chunks, rank, q, state, seeds, agreement,
                                           kind="all_reduce")
        _apply_op(acc, op, world)
        # padded is scratch (or the tensor itself): the gather writes it, then copies
        seed = call_seed(base, call, 2 * (rank * world + rank) + 1)
        nb_ag = packed_all_gather(inner, chunks, acc, q, state, seed, kind="all_reduce")
        if padded is not flat:
            flat.copy_(padded[:numel])
        if work is not tensor:
            tensor.copy_(work)
    state.stats.record("all_reduce", compressed=True,
                       logical=2 * _peer_bytes(world, chunk * tensor.element_size()),
                       wire=_peer_bytes(world, nb_rs + nb_ag))
    return completed_work([tensor]) if async_op else None

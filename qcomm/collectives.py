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
"""

from __future__ import annotations

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

    def clear(self) -> None:
        self._bufs.clear()


class GroupState:
    """What a group needs across calls: config, the call counter (seeds), buffers, stats."""

    def __init__(self, config: CommConfig) -> None:
        self.config = config
        self.calls = itertools.count()  # advances identically on every rank
        self.buffers = _BufferCache()
        self.stats = Stats()
        self.lock = threading.Lock()
        # (numel, dtype, config) whose received headers were checked on a CUDA group:
        # reading headers back costs a device sync, which would stall FSDP's overlap
        # if paid per call; CPU groups check every call (free).
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
        return op.factor
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


def _check_rows(rows: torch.Tensor, numel: int, dtype: torch.dtype, q: QuantConfig,
                skip: int | None, state: GroupState) -> None:
    """Check every received payload's header with one device-to-host copy; a mismatch
    (ranks with different configs or sizes) is a clear error naming the sender."""
    if rows.device.type == "cuda":
        key = (numel, dtype, q)
        if key in state.checked:
            return
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


def _row_packed(row: torch.Tensor, numel: int, dtype: torch.dtype, q: QuantConfig) -> Packed:
    # The fp32 meta is a view of the payload bytes: it needs a 4-byte aligned offset,
    # which a row of an odd-sized payload (1-3 bits, odd number of code groups) lacks.
    if row.storage_offset() % 4:
        row = row.clone()
    return Packed(row, numel, dtype, q)


def _impl(device: torch.device) -> str | None:
    # The codec's impl=None picks "torch" for CPU without honouring QCOMM_COMPILE=0
    # (codec.py _select_impl returns before that check); naming "torch" explicitly
    # gets the documented behaviour. Drop once the codec applies it for None too.
    return None if device.type == "cuda" else "torch"


def _peer_bytes(world: int, nbytes: int) -> int:
    return (world - 1) * nbytes


def completed_work(result=None):
    """A Work that is already complete (what compressed calls return)."""
    fut = torch.futures.Future()
    fut.set_result(result if result is not None else [])
    return torch._C._distributed_c10d._create_work_from_future(fut)


def _finish(work, async_op: bool):
    if async_op:
        return work
    if work is not None:
        work.wait()
    return None


# ---------------------------------------------------------------------------------
# The compressed algorithms (synchronous; callers have validated the tensors)


@torch.no_grad()
def packed_all_gather(inner, outs: list[torch.Tensor], inp: torch.Tensor, q: QuantConfig,
                      state: GroupState, seed: int) -> int:
    """All-gather ``inp`` from every rank into ``outs[r]`` as payloads; returns the
    payload size (bytes this rank sends)."""
    n, world = inp.numel(), len(outs)
    nb = packed_nbytes(n, q)
    send = state.buffers.get("ag_send", nb, torch.uint8, inp.device)
    recv = state.buffers.get("ag_recv", world * nb, torch.uint8, inp.device)
    quantize(inp, q, seed=seed, out=send, impl=_impl(inp.device))  # reads inp first
    inner_all_gather(inner, recv, send).wait()
    rows = recv.view(world, nb)
    _check_rows(rows, n, inp.dtype, q, skip=None, state=state)
    for r, out in enumerate(outs):
        dequantize(_row_packed(rows[r], n, inp.dtype, q), out=out, check=False,
                   impl=_impl(inp.device))
    return nb


@torch.no_grad()
def packed_reduce_scatter(inner, chunks: list[torch.Tensor], rank: int, q: QuantConfig,
                          state: GroupState, seeds: list[int]) -> tuple[torch.Tensor, int]:
    """Sum ``chunks[j]`` of every rank into rank j; returns (fp32 sum of this rank's
    chunk, in a scratch buffer; payload size per chunk)."""
    world = len(chunks)
    n = chunks[0].numel()
    dtype, device = chunks[0].dtype, chunks[0].device
    nb = packed_nbytes(n, q)
    send = state.buffers.get("rs_send", world * nb, torch.uint8, device).view(world, nb)
    recv = state.buffers.get("rs_recv", world * nb, torch.uint8, device)
    # quantize(out=) views the meta as fp32: rows of an odd payload size are staged
    stage = state.buffers.get("rs_stage", nb, torch.uint8, device) if nb % 4 else None
    for j, chunk in enumerate(chunks):
        if j == rank:  # the own chunk stays exact; its slot only travels to itself
            continue
        if stage is None:
            quantize(chunk, q, seed=seeds[j], out=send[j], impl=_impl(device))
        else:
            send[j].copy_(quantize(chunk, q, seed=seeds[j], out=stage, impl=_impl(device))
                          .payload)
    inner_all_to_all(inner, recv, send.view(-1)).wait()
    rows = recv.view(world, nb)
    _check_rows(rows, n, dtype, q, skip=rank, state=state)
    acc = state.buffers.get("rs_acc", n, torch.float32, device)
    acc.copy_(chunks[rank].reshape(-1))
    for j in range(world):
        if j != rank:
            dequantize(_row_packed(rows[j], n, dtype, q), out=acc, accumulate=True, check=False,
                       impl=_impl(device))
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


def all_gather_into_tensor(out: torch.Tensor, inp: torch.Tensor, group=None, *,
                           config=None, async_op: bool = False):
    """Gather ``inp`` of every rank into ``out`` (``world * inp.numel()`` elements),
    quantized per ``config`` (the group's by default). Like
    :func:`torch.distributed.all_gather_into_tensor`; ``inp`` may alias its slot of
    ``out``."""
    out, inp = _check_tensor("out", out), _check_tensor("inp", inp)
    group = _c10d._get_default_group() if group is None else group
    world = group.size()
    _check_pair("all_gather_into_tensor", out, inp, world, gathered=True)
    _check_contiguous("all_gather_into_tensor", "out", out)
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
    q = quant_config("all_gather", state, config)
    nbytes = n * inp.element_size()
    if not can_compress or not compressible(inp, n, world, q, state.config.min_numel):
        state.stats.record("all_gather", compressed=False, logical=_peer_bytes(world, nbytes),
                           wire=_peer_bytes(world, nbytes))
        work = exact() if exact is not None else inner_all_gather(inner, out_flat, inp)
        return _finish(work, async_op)
    with state.lock:
        call = state.next_call()
        seed = call_seed(state.config.seed ^ q.seed, call, inner.rank())
        nb = packed_all_gather(inner, outs, inp, q, state, seed)
    state.stats.record("all_gather", compressed=True, logical=_peer_bytes(world, nbytes),
                       wire=_peer_bytes(world, nb))
    return completed_work([out_flat] if out_flat is not None else outs) if async_op else None


def reduce_scatter_tensor(out: torch.Tensor, inp: torch.Tensor, op=ReduceOp.SUM, group=None,
                          *, config=None, async_op: bool = False):
    """Reduce ``inp`` (``world * out.numel()`` elements) over the group and scatter:
    rank r gets the reduction of chunk r in ``out``. SUM, AVG and PREMUL_SUM are
    compressed; other ops go exact. Like :func:`torch.distributed.reduce_scatter_tensor`."""
    out, inp = _check_tensor("out", out), _check_tensor("inp", inp)
    group = _c10d._get_default_group() if group is None else group
    world = group.size()
    _check_pair("reduce_scatter_tensor", out, inp, world, gathered=False)
    chunks = list(inp.reshape(-1).chunk(world)) if out.numel() else []
    return scatter_from(group, out, chunks, inp, op, config=config, async_op=async_op)


@torch.no_grad()
def scatter_from(group, out: torch.Tensor, chunks: list[torch.Tensor],
                 inp_flat: torch.Tensor | None, op, *, config=None, async_op: bool = False,
                 exact=None, can_compress: bool = True):
    """Reduce-scatter of per-rank input ``chunks`` (views of ``inp_flat`` when given)
    into ``out``; ``exact(op, chunks)`` is the passthrough (default: the inner flat
    reduce-scatter of ``inp_flat``); ``can_compress=False`` forces it."""
    state, inner = group_state(group), inner_group(group)
    world, rank, n = group.size(), inner.rank(), out.numel()
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
        if exact is not None:
            return _finish(exact(op, chunks), async_op)
        return _finish(inner_reduce_scatter(inner, out, inp_flat, op), async_op)
    with state.lock:
        call = state.next_call()
        base = state.config.seed ^ q.seed
        seeds = [call_seed(base, call, rank * world + j) for j in range(world)]
        acc, nb = packed_reduce_scatter(inner, chunks, rank, q, state, seeds)
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
    q = quant_config("all_reduce", state, config)
    chunk = -(-numel // world)
    if not compressible(tensor, numel, world, q, state.config.min_numel, op):
        nbytes = 2 * _peer_bytes(world, chunk * tensor.element_size())
        state.stats.record("all_reduce", compressed=False, logical=nbytes, wire=nbytes)
        factor = premul_factor(op)
        if factor is not None:  # gloo rejects PREMUL_SUM: scale in place, then SUM
            tensor.mul_(factor)
            op = ReduceOp.SUM
        return _finish(inner_all_reduce(inner, tensor, op), async_op)
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
        acc, nb_rs = packed_reduce_scatter(inner, chunks, rank, q, state, seeds)
        _apply_op(acc, op, world)
        # padded is scratch (or the tensor itself): the gather writes it, then copies
        seed = call_seed(base, call, 2 * (rank * world + rank) + 1)
        nb_ag = packed_all_gather(inner, chunks, acc, q, state, seed)
        if padded is not flat:
            flat.copy_(padded[:numel])
        if work is not tensor:
            tensor.copy_(work)
    state.stats.record("all_reduce", compressed=True,
                       logical=2 * _peer_bytes(world, chunk * tensor.element_size()),
                       wire=_peer_bytes(world, nb_rs + nb_ag))
    return completed_work([tensor]) if async_op else None

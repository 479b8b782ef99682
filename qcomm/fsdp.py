"""Stateful FSDP2 collectives, per FSDP module: weight differences and error feedback.

A quantized all-gather of weights sends every weight with its quantization error, every
step, afresh: at 4 bits that is ~10% relative error on each weight matrix
(``tests/test_weight_deltas.py``: 9.8%), and 1200-step training with 4-bit weights lost
2.5% held-out loss to it (docs/results.md, ``train-loopback-1200``). Weights move little
between steps, so what :class:`DeltaAllGather` sends is the *difference* between a
rank's shard and the reconstruction every rank already holds
(SDP4Bit's qWD, with the error fed back):

    ref        the unsharded flat parameters as all ranks last reconstructed them
               (identical on every rank: the same bytes decoded by the same code)
    delta_r  = shard_r - ref[r]                     on rank r, in fp32
    send       quantize(delta_r)                    (the group's all-gather QuantConfig)
    sum[s]   = ref[s] + dequantize(payload_s)       on every rank, for every rank s, fp32
    output   = sum                                  (cast to the parameters' dtype)
    ref      = round(sum)                           kept as ``state`` says, below

What one gather gets wrong, and what ``round`` leaves out, is part of the next delta,
so the weights' error stays a fraction of one step's change instead of a fraction of
the weights (tests, 4 bits: 0.05-0.07% instead of 9.8%). ``ref`` starts at zero, so the
first gather is a plain quantized gather and each later one refines it (FSDP2 gathers
every module in forward and again in backward; the backward gather sends the forward
one's residual). Every call has the same size on the wire, so ranks never disagree on
what a call sends. Measured (docs/results.md, ``train-loopback-1200``: 1200 steps, 3
paired seeds): W4G4 +0.36% held-out loss against fp32 communication with differences,
+2.84% without; 2-bit differences -0.07%.

:class:`ErrorFeedbackReduceScatter` does the same for gradients: each rank adds what
its previous quantized send of a chunk left out to the chunk it sends next. Measured,
it made stochastically rounded 4-bit gradients *worse* under AdamW (+1.44% against
+0.36%): unbiased rounding needs no feedback. With ``rounding="nearest"`` it was +0.66%
(within noise), no better than stochastic rounding alone.

State (``state=``, per class and module, the module's unsharded size on every rank;
FSDP2 frees the unsharded parameters after use, this stays):

- :data:`DEFAULT_STATE`, 8-bit minmax codes rounded to nearest in 128-element buckets:
  1.06 bytes a parameter (a 70B model: ~74 GB a rank instead of 280).
- ``"dtype"``: the parameters' (gradients') dtype, rounded to nearest even: 2 bytes for
  bf16 parameters.
- ``"float32"``: 4 bytes, every difference summed exactly (what qcomm did before).

Every rank applies the same deterministic rounding to the same fp32 sums, so every
rank keeps, and computes with, the same bits. Opt in per module where the bytes on the
wire matter more than that memory (``include=``). Use::

    fully_shard(block) for each block; fully_shard(model)
    qcomm.fsdp.quantize_weight_deltas(model)      # every FSDP module in model
    qcomm.fsdp.quantize_weight_deltas(model, include=lambda name, m: "mlp" in name)
    qcomm.fsdp.feed_back_gradient_errors(model)

FSDP2's ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` (torch >= 2.9) carry
them; the group is FSDP's own (a ``"qcomm"`` group, whose configs, seeds and stats are
used, or any plain group, configured from ``QCOMM_*``).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import collectives as C
from . import driver
from .codec import dequantize_rows, quantize_rows, update_state_rows
from .config import CommConfig, QuantConfig, as_comm_config
from .layout import meta_words_of, packed_nbytes
from .pieces import pieces
from .process_group import QcommProcessGroup, wrap

try:  # torch >= 2.9
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as _AllGatherBase
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterBase
except ImportError:  # pragma: no cover - older torch: the installers below refuse
    _AllGatherBase = _ReduceScatterBase = object


# How a module's state is kept between calls (``state=``):
STATE_FP32 = "float32"  # fp32, 4 bytes an element: the sum of every decoded difference
STATE_DTYPE = "dtype"   # the tensors' own dtype (2 bytes for bf16), rounded to nearest even
# The default: 8-bit minmax codes, rounded to nearest, 1.06 bytes an element (128-element
# buckets: 8 bytes of [min, step] each). What it rounds off (at most half a step, 1/510
# of a bucket's range) the next difference sends: the weights' error stays the 4-bit
# difference's, not the state's (docs/results.md, ``train-loopback-1200``).
DEFAULT_STATE = QuantConfig(bits=8, bucket_size=128, scheme="minmax", rounding="nearest")


def check_state(state) -> str | QuantConfig:
    """``state`` if it names a way to keep state (module docstring), else a ValueError."""
    if isinstance(state, QuantConfig):
        if state.rounding != "nearest":
            raise ValueError("qcomm.fsdp state: a QuantConfig state must round to nearest "
                             "(every rank must keep the same bytes; stochastic rounding "
                             f"would need shared seeds), got {state!r}")
        return state
    if state in (STATE_FP32, STATE_DTYPE):
        return state
    raise ValueError(f"qcomm.fsdp state must be {STATE_FP32!r}, {STATE_DTYPE!r} or a "
                     f"qcomm.QuantConfig (rounding='nearest'), got {state!r}")


class PieceState:
    """``world`` rows of ``n`` elements kept across calls, read and written piece by
    piece (the collective's pipeline pieces ``parts``) as fp32 rows:

    - ``"float32"``: an fp32 [world, n] tensor; a piece's rows are a view of it.
    - ``"dtype"``: a [world, n] tensor of ``dtype``; loaded into an fp32 scratch buffer,
      stored rounded to nearest even.
    - a QuantConfig: per piece, ``world`` payload rows of that config (the wire format),
      updated with the received differences by one
      :func:`qcomm.codec.update_state_rows` (:meth:`update`: decode, add, store the
      output, requantize in one pass; round to nearest: the same fp32 sums give the
      same bytes on every rank and device). A bucket holding inf or NaN is stored with
      zero meta, so it decodes to zeros: state never keeps a non-finite value.

    Zero at first. ``store`` of the first two kinds replaces non-finite values by zero.
    ``codec``: the keywords of its codec calls (the group's
    :meth:`qcomm.driver.GroupState.codec_for`; default: the codec's own)."""

    def __init__(self, state, world: int, n: int, dtype: torch.dtype, device: torch.device,
                 parts: list[tuple[int, int]], *, codec: dict | None = None) -> None:
        self.state, self.world, self.parts = state, world, parts
        self.codec = codec or {}
        if state == STATE_FP32 or state == STATE_DTYPE:
            kind = torch.float32 if state == STATE_FP32 else dtype
            self.data = torch.zeros(world, n, dtype=kind, device=device)
            return
        self.data = []
        for a, b in parts:
            rows = torch.empty(world, packed_nbytes(b - a, state), dtype=torch.uint8,
                               device=device)
            quantize_rows(torch.zeros(world, b - a, device=device), state, [0] * world,
                          out=rows, **self.codec)
            self.data.append(rows)

    def nbytes(self) -> int:
        data = self.data if isinstance(self.data, list) else [self.data]
        return sum(t.numel() * t.element_size() for t in data)

    @property
    def quantized(self) -> bool:
        return isinstance(self.state, QuantConfig)

    def load(self, call: driver.Call, p: int, a: int, b: int, *,
             copy: bool = True) -> torch.Tensor:
        """Piece ``p``'s rows (elements ``[a, b)``) as fp32 [world, b - a]: what the
        caller changes in them it hands to :meth:`store`. A copy in a scratch buffer, so
        nothing changes the state until then (a refused call stores nothing); without
        ``copy``, an fp32 state's own rows (a caller past the descriptor check)."""
        if self.state == STATE_FP32 and not copy:
            return self.data[:, a:b]
        rows = call.buffer("fsdp_state", self.world * (b - a), torch.float32,
                           self.data[0].device).view(self.world, b - a)
        if not self.quantized:
            rows.copy_(self.data[:, a:b])
        else:
            dequantize_rows(self.data[p], b - a, torch.float32, self.state, out=rows,
                            check=False, **self.codec)
        return rows

    def store(self, p: int, rows: torch.Tensor) -> None:
        """Keep ``rows`` (what :meth:`load` gave for piece ``p``, changed); they may be
        overwritten."""
        if not self.quantized:
            rows.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
            a, b = self.parts[p]
            kept = self.data[:, a:b]
            if rows.data_ptr() != kept.data_ptr():  # not the state's own rows
                kept.copy_(rows)
            return
        out = self.data[p]
        quantize_rows(rows, self.state, [0] * self.world, out=out, **self.codec)
        a, b = self.parts[p]
        # a non-finite bucket's meta is NaN (qcomm/layout.py); zero meta decodes to 0
        # in every scheme (its codes are all zero): a few bytes a bucket, not a pass
        # over the elements
        meta_words_of(out, b - a, self.state).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)

    def update(self, call: driver.Call, p: int, deltas: torch.Tensor, config: QuantConfig,
               out: torch.Tensor) -> None:
        """A quantized state's piece ``p`` plus ``deltas`` (its ``world`` payload rows of
        ``config``) into ``out`` [world, b - a] and back into the state, in one call
        (:func:`qcomm.codec.update_state_rows`): what :meth:`load`, an accumulating
        decode and :meth:`store` give, byte for byte. A 16-bit ``out`` on the torch path
        sums in the group's scratch buffer, as :meth:`load` does."""
        a, b = self.parts[p]
        scratch = None
        if out.dtype != torch.float32 and out.device.type != "cuda":
            scratch = call.buffer("fsdp_state", self.world * (b - a), torch.float32,
                                  out.device)
        update_state_rows(self.data[p], deltas, b - a, self.state, config, out=out,
                          scratch=scratch, check=False, **self.codec)

    def subtract_row(self, call: driver.Call, r: int, x: torch.Tensor) -> torch.Tensor:
        """``x -= row r`` (``x``: fp32 [n]), piece by piece through a piece-sized scratch
        buffer: no buffer of the row's size is kept."""
        if not self.quantized:
            return x.sub_(self.data[r])
        for p, (a, b) in enumerate(self.parts):
            piece = call.buffer("fsdp_state", b - a, torch.float32, x.device).view(1, -1)
            dequantize_rows(self.data[p][r:r + 1], b - a, torch.float32, self.state,
                            out=piece, check=False, **self.codec)
            x[a:b].sub_(piece[0])
        return x


class _Allocate:
    """FSDP2's ``Comm.allocate``: plain ``torch.empty`` buffers (shared by every comm here)."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class _PerModule(_Allocate):
    """State one FSDP module's collective keeps across calls: one :class:`PieceState`
    per (group, world, shard numel, dtype, device, pieces), zero at first."""

    def __init__(self, config: QuantConfig | None = None, *, state=DEFAULT_STATE) -> None:
        if config is not None and not isinstance(config, (QuantConfig, CommConfig)):
            raise TypeError(f"config must be a qcomm.QuantConfig, a qcomm.CommConfig (its "
                            f"collective's) or None (the group's), got {config!r}")
        self.config = config
        self.state = check_state(state)
        self._states: dict[tuple, PieceState] = {}

    def reset(self) -> None:
        """Drop the state (the next call starts from zero again). Call it on every rank
        or on none: ranks that disagree send different values (never different sizes,
        so nothing hangs)."""
        self._states.clear()

    def state_nbytes(self) -> int:
        """Bytes of state held on this rank."""
        return sum(s.nbytes() for s in self._states.values())

    def _state(self, group, call: driver.Call, n: int, dtype: torch.dtype,
               device: torch.device, parts: list[tuple[int, int]]) -> PieceState:
        key = (id(group), call.world, n, dtype, device, tuple(parts))
        got = self._states.get(key)
        if got is None:
            got = self._states[key] = PieceState(self.state, call.world, n, dtype, device,
                                                 parts, codec=call.codec)
        return got


class DeltaAllGather(_PerModule, _AllGatherBase):
    """FSDP2 all-gather that sends quantized weight differences (module docstring).

    ``config``: the QuantConfig of the differences (default: the group's all-gather
    config; ``None`` there means the group sends weights exactly, and so does this).
    ``state``: how the reconstruction is kept between gathers (:data:`DEFAULT_STATE`,
    8-bit codes; ``"dtype"``, the parameters' dtype; ``"float32"``; see
    :class:`PieceState`). One instance per FSDP module: its state is that module's
    reconstruction.
    """

    @torch.no_grad()
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False):
        out, inp, group, world = C.check_flat_pair("DeltaAllGather", output_tensor,
                                                   input_tensor, group, gathered=True)
        n = inp.numel()
        out_rows = out.view(world, n)

        def prepare(call: driver.Call):
            """The difference to send, and how every rank decodes it through the state."""
            ref = self._state(group, call, n, inp.dtype, inp.device, pieces(n, call.q))
            # reads inp (a view into out) before anything is written; a copy, never
            # the caller's tensor
            delta = ref.subtract_row(call, call.rank, inp.to(torch.float32, copy=True))

            def decode(p: int, a: int, b: int, rows: torch.Tensor) -> None:
                # every rank: the same state and payload bytes through the same code,
                # so the same reconstruction, bit for bit. Non-finite weights arrive
                # non-finite (buckets decode NaN) but are not kept: those entries (a
                # quantized state: those buckets) restart from zero on every rank, so
                # weights repaired after a bad step (a reloaded checkpoint) come back at
                # the next gather
                if ref.quantized:
                    ref.update(call, p, rows, call.q, out_rows[:, a:b])
                    return
                acc = ref.load(call, p, a, b, copy=False)  # past the descriptor check
                dequantize_rows(rows, b - a, torch.float32, call.q, out=acc,
                                accumulate=True, check=False, **call.codec)
                out_rows[:, a:b].copy_(acc)
                ref.store(p, acc)

            return delta, decode

        return C.gather_into(group, out_rows if n else [], out, inp, config=self.config,
                             async_op=async_op, prepare=prepare)


class ErrorFeedbackReduceScatter(_PerModule, _ReduceScatterBase):
    """FSDP2 reduce-scatter with error feedback: each rank adds what its last quantized
    send of a chunk left out to the chunk it sends now (Seide et al. 2014; Karimireddy
    et al. 2019), so gradient quantization errors cancel over steps instead of adding
    up. State: the peer chunks' residuals, the module's unsharded size, kept as
    ``state`` says (:class:`PieceState`; the gradients' dtype for ``"dtype"``). Meant
    for biased (round-to-nearest) gradients; see the module docstring for what it
    measured in training.

    ``config``: the gradients' QuantConfig (default: the group's reduce-scatter one).
    """

    @torch.no_grad()
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op=dist.ReduceOp.SUM, async_op: bool = False):
        out, inp, group, world = C.check_flat_pair("ErrorFeedbackReduceScatter",
                                                   output_tensor, input_tensor, group,
                                                   gathered=False)
        chunks = inp.view(world, out.numel()) if out.numel() else []

        def residuals(call: driver.Call, n: int, dtype: torch.dtype, device: torch.device,
                      parts: list[tuple[int, int]]) -> PieceState:
            return self._state(group, call, n, dtype, device, parts)

        return C.scatter_from(group, out, chunks, inp, op, config=self.config,
                              async_op=async_op, residuals=residuals)


def fsdp_modules(module: torch.nn.Module, include=None) -> list:
    """The FSDP2 modules in ``module`` (itself included), in ``modules()`` order;
    ``include(name, module)``, when given, picks among them (``name`` as in
    ``named_modules()``, ``""`` for ``module`` itself)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for name, m in module.named_modules() if isinstance(m, FSDPModule)
            and (include is None or include(name, m))]


def _modules(fn: str, setter: str, module: torch.nn.Module, include) -> list:
    """The FSDP modules ``fn`` installs on; a clear error where there are none."""
    if include is not None and not callable(include):
        raise TypeError(f"{fn}: include must be a callable (name, module) -> bool, got "
                        f"{include!r}")
    found = fsdp_modules(module, include)
    # a unit that owns no parameters has no collectives to replace (module docstring)
    mods = [m for m in found if _param_groups(m)]
    if not mods:
        raise ValueError(f"{fn}: no FSDP2 module " + (
            "that owns parameters found" if found
            else "found that include() accepts" if include is not None and fsdp_modules(module)
            else f"found in the {type(module).__name__} given{_what_instead(module)}"))
    if not hasattr(mods[0], setter):
        raise RuntimeError(f"{fn} needs FSDPModule.{setter} (torch >= 2.9); this is torch "
                           f"{torch.__version__}")
    alone = {id(g): g for m in mods for g in _groups_of(m) if g.size() == 1}
    if len(alone) == len({id(g) for m in mods for g in _groups_of(m)}):
        warnings.warn(
            f"{fn}: FSDP's group has 1 rank, so there is nothing to compress and no call "
            "will be (a mesh whose data-parallel dimension is 1: e.g. Lightning's "
            "ModelParallelStrategy() on one node defaults to tensor parallel; pass "
            "fully_shard a mesh of the data-parallel ranks)", UserWarning, stacklevel=3)
    return mods


def _groups_of(module) -> list:
    """The groups FSDP sends ``module``'s all-gathers and reduce-scatters on."""
    group = _param_groups(module)[0]
    return [group._all_gather_process_group, group._reduce_scatter_process_group]


def _what_instead(module) -> str:
    """What to use for a model that holds no FSDP2 module (the wrapper it is, named)."""
    from torch.nn.parallel import DistributedDataParallel

    name = type(module).__name__
    if isinstance(module, DistributedDataParallel):
        return (f" ({name} is DDP: use ddp.register_comm_hook(state, qcomm.ddp_comm_hook), "
                "or init_process_group('qcomm'))")
    if name == "FullyShardedDataParallel":
        return f" ({name} is FSDP1: use init_process_group('qcomm'), the backend route)"
    return " (call fully_shard on the model or its blocks first)"


def _install(fn: str, setter: str, module: torch.nn.Module, include, make) -> list:
    mods = _modules(fn, setter, module, include)
    comms = []
    for m in mods:
        comms.append(make())
        getattr(m, setter)(comms[-1])
    return comms


# ---------------------------------------------------------------------------------
# The hook route: FSDP2's own comm hooks over the group FSDP already uses


class CompressedAllGather(_Allocate, _AllGatherBase):
    """FSDP2's all-gather through qcomm's driver on FSDP's own group (a plain gloo or
    NCCL group: its qcomm state holds the config, seeds, stats and connections of its
    own; :func:`compress`)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False):
        return C.all_gather_into_tensor(output_tensor, input_tensor, group,
                                        async_op=async_op)


class CompressedReduceScatter(_Allocate, _ReduceScatterBase):
    """FSDP2's reduce-scatter through qcomm's driver on FSDP's own group
    (:func:`compress`)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op=dist.ReduceOp.SUM, async_op: bool = False):
        return C.reduce_scatter_tensor(output_tensor, input_tensor, op, group,
                                       async_op=async_op)


class Compression:
    """What :func:`compress` installed: ``remove()`` puts FSDP's own comms back."""

    def __init__(self, installed: list, groups: list, replicate: list) -> None:
        self.installed = installed  # (module, previous all-gather, previous reduce-scatter)
        self.groups = groups  # the groups whose all-gathers and reduce-scatters go through qcomm
        self.replicate = replicate  # HSDP: (mesh info, its replicate group, the qcomm group)

    @property
    def replicate_groups(self) -> list:
        """The qcomm groups HSDP's replicate all-reduces now run on."""
        return list({id(q): q for _, _, q in self.replicate}.values())

    def remove(self) -> None:
        for module, all_gather, reduce_scatter in self.installed:
            module.set_custom_all_gather(all_gather)
            module.set_custom_reduce_scatter(reduce_scatter)
        for info, group, _ in self.replicate:
            info.replicate_process_group = group
        self.installed, self.replicate = [], []


def _param_groups(module) -> list:
    """The FSDP parameter groups ``module`` owns: none for a module whose parameters all
    sit in child ``fully_shard`` units (torchtitan's root: embedding, blocks and
    ``[norm, output]`` are units of their own), which torch's own ``set_custom_*``
    setters skip too."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.13: a list
    if groups is None:
        groups = [state._fsdp_param_group]
    return [g for g in groups if g is not None]


def compress(module: torch.nn.Module, config: CommConfig | QuantConfig | None = None, *,
             include=None) -> Compression:
    """Compress FSDP2's all-gathers and reduce-scatters of every FSDP module in
    ``module`` (or those ``include(name, module)`` accepts), after ``fully_shard``,
    over the group FSDP already uses (NCCL or gloo, unchanged): FSDP2's own comm hooks
    (``set_custom_all_gather`` / ``set_custom_reduce_scatter``, torch >= 2.9) call
    qcomm's driver, with everything the backend route has (the group's topology, exact
    inside a node; seeds; stats: ``qcomm.stats(group)``; bad-input handling; connections
    of its own). Everything else (the optimizer, checkpoints, DTensor, the user's own
    collectives) stays on the native group, exact, with no qcomm code on its path.

    ``config``: the group's :class:`~qcomm.CommConfig`, or a :class:`~qcomm.QuantConfig`
    for both collectives (and HSDP's all-reduce), the rest from ``QCOMM_*`` (default:
    ``QCOMM_*``). Call on
    every rank (the group's config and nodes are agreed here, once). Compose with
    :func:`quantize_weight_deltas` / :func:`feed_back_gradient_errors` by calling them
    after: their all-gathers or reduce-scatters replace these for their modules.
    Returns a :class:`Compression`; ``remove()`` undoes it.

    HSDP's replicate all-reduce: torch's ``set_all_reduce_hook`` runs *after* it, so it
    cannot stand in for it; FSDP issues it with ``dist.all_reduce`` on its mesh info's
    replicate group, which this replaces by a :func:`qcomm.wrap` of that group (one per
    group; collective, like every step here): compressed there, the group itself left
    as it is for every other caller (torch >= 2.9's ``HSDPMeshInfo``)."""
    config = as_comm_config(config, "compress")
    mods = _modules("compress", "set_custom_all_gather", module, include)
    groups, installed = [], []
    for m in mods:
        param_groups = _param_groups(m)
        if len(param_groups) != 1:
            raise ValueError(f"compress: FSDP module {type(m).__name__} has "
                             f"{len(param_groups)} parameter groups; torch takes custom comms "
                             "only for one (no shard_placement_fn with several meshes)")
        pg = param_groups[0]
        for group in (pg._all_gather_process_group, pg._reduce_scatter_process_group):
            if all(group is not g for g in groups):
                groups.append(group)
        installed.append((m, pg._all_gather_comm, pg._reduce_scatter_comm))
    device = torch.device(_device_type(mods[0]))
    for group in groups:
        if isinstance(group, QcommProcessGroup):
            raise ValueError("compress: FSDP's group is already a qcomm group (the backend "
                             "route); its calls compress without hooks")
        driver.adopt(group, config, device)
    replicate, made = [], {}
    for m, _, _ in installed:
        info = _param_groups(m)[0].mesh_info
        group = getattr(info, "replicate_process_group", None)
        if group is None or isinstance(group, QcommProcessGroup):
            continue  # not HSDP, or this mesh info's group is swapped already
        if id(group) not in made:
            made[id(group)] = wrap(group, config)
        replicate.append((info, group, made[id(group)]))
        info.replicate_process_group = made[id(group)]
    for m, _, _ in installed:
        m.set_custom_all_gather(CompressedAllGather())
        m.set_custom_reduce_scatter(CompressedReduceScatter())
    return Compression(installed, groups, replicate)


def _device_type(module) -> str:
    mesh = _param_groups(module)[0].mesh_info.mesh
    if mesh.device_type == "cuda":
        return f"cuda:{torch.cuda.current_device()}"
    return mesh.device_type


def quantize_weight_deltas(module: torch.nn.Module, config: QuantConfig | None = None, *,
                           state=DEFAULT_STATE, include=None) -> list[DeltaAllGather]:
    """Give every FSDP2 module in ``module`` (or those ``include(name, module)``
    accepts) its own :class:`DeltaAllGather`; returns them (e.g. to
    :meth:`~DeltaAllGather.reset` after loading a checkpoint, or to sum
    :meth:`~DeltaAllGather.state_nbytes`). The others keep the group's all-gather.
    Call after ``fully_shard``, on every rank, with the same modules."""
    check_state(state)
    return _install("quantize_weight_deltas", "set_custom_all_gather", module, include,
                    lambda: DeltaAllGather(config, state=state))


def feed_back_gradient_errors(module: torch.nn.Module, config: QuantConfig | None = None, *,
                              state=DEFAULT_STATE, include=None
                              ) -> list[ErrorFeedbackReduceScatter]:
    """Give every FSDP2 module in ``module`` (or those ``include`` accepts) its own
    :class:`ErrorFeedbackReduceScatter`; returns them. Call after ``fully_shard``, on
    every rank."""
    check_state(state)
    return _install("feed_back_gradient_errors", "set_custom_reduce_scatter", module,
                    include, lambda: ErrorFeedbackReduceScatter(config, state=state))

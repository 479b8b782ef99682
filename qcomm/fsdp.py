"""Weight-difference all-gathers for FSDP2 (SDP4Bit's qWD), per FSDP module.

A quantized all-gather of weights sends every weight with its quantization error, every
step, afresh: at 4 bits that is ~10% relative error on each weight matrix
(``python -m bench.weight_error``), and 1200-step training lost 2.5% held-out loss to it
(README). Weights move little between steps, so what :class:`DeltaAllGather` sends is
the *difference* between a rank's shard and the reconstruction every rank already holds:

    ref        fp32, the unsharded flat parameters as all ranks last reconstructed them
               (identical on every rank: the same payloads decoded by the same code)
    delta_r  = shard_r - ref[r]                     on rank r, in fp32
    send       quantize(delta_r)                    (the group's all-gather QuantConfig)
    ref[s]  += dequantize(payload_s)                on every rank, for every rank s
    output   = ref                                  (cast to the parameters' dtype)

The error is fed back: what one gather gets wrong is part of the next delta, so the
weights' error stays a fraction of one step's change instead of a fraction of the
weights. ``ref`` starts at zero, so the first gather is a plain quantized gather and
each later one refines it (FSDP2 gathers every module in forward and again in backward;
the backward gather sends the forward gather's residual). All calls have the same size
on the wire, so ranks never disagree on whether a gather is a "first" one.

Cost: ``ref`` is one fp32 copy of the module's unsharded parameters on every rank (FSDP2
frees the unsharded parameters after use; this copy stays). Set it on the modules
whose all-gathers dominate, or not at all where memory is the constraint.

Use::

    fully_shard(block) for each block; fully_shard(model)
    qcomm.fsdp.quantize_weight_deltas(model)           # every FSDP module in model

FSDP2's ``set_custom_all_gather`` (torch >= 2.9) carries it; the group is FSDP's own
(a ``"qcomm"`` group, whose all-gather config and seeds are used, or any plain group,
configured from ``QCOMM_*``). The reduce-scatter is untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import collectives as C
from .config import QuantConfig

try:  # torch >= 2.9
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as _AllGatherBase
except ImportError:  # pragma: no cover - older torch: quantize_weight_deltas refuses
    _AllGatherBase = object


class DeltaAllGather(_AllGatherBase):
    """FSDP2 all-gather that sends quantized weight differences (module docstring).

    ``config``: the QuantConfig of the differences (default: the group's all-gather
    config; ``None`` there means the group sends weights exactly, and so does this).
    One instance per FSDP module: it holds that module's reconstruction.
    """

    def __init__(self, config: QuantConfig | None = None) -> None:
        if config is not None and not isinstance(config, QuantConfig):
            raise TypeError(f"config must be a qcomm.QuantConfig or None, got {config!r}")
        self.config = config
        self._refs: dict[tuple, torch.Tensor] = {}

    def reset(self) -> None:
        """Forget the reconstruction (the next gather starts from zero again). Call it
        on every rank or on none: ranks that disagree send different values (never
        different sizes, so nothing hangs)."""
        self._refs.clear()

    def ref_nbytes(self) -> int:
        """Bytes the reconstruction holds on this rank."""
        return sum(t.numel() * t.element_size() for t in self._refs.values())

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    @torch.no_grad()
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False):
        out, inp, group, world = C._checked_pair("DeltaAllGather", output_tensor,
                                                 input_tensor, group, gathered=True)
        state, inner = C.group_state(group), C.inner_group(group)
        C.ensure_agreed(group, state, inner, "all_gather", inp.device)
        q = self.config if self.config is not None else C.quant_config(
            "all_gather", state, None)
        n = inp.numel()
        if not C.compressible(inp, n, world, q, state.config.min_numel):
            nbytes = C._peer_bytes(world, n * inp.element_size())
            state.stats.record("all_gather", compressed=False, logical=nbytes, wire=nbytes)
            return C._finish(C.inner_all_gather(inner, out, inp), async_op, "all_gather",
                             inner.rank())
        key = (id(group), world, n, inp.device)
        ref = self._refs.get(key)
        if ref is None:
            ref = self._refs[key] = torch.zeros(world * n, dtype=torch.float32,
                                                device=inp.device)
        slots = list(ref.chunk(world))
        delta = inp.float() - slots[inner.rank()]  # reads inp (a view into out) first
        with state.lock:
            call = state.next_call()
            seed = C.call_seed(state.config.seed ^ q.seed, call, inner.rank())
            agreement = C.start_agreement(inner, state, "all_gather", n, delta.dtype, q,
                                          None, call, inp.device)
            nb = C.packed_all_gather(inner, slots, delta, q, state, seed, agreement,
                                     accumulate=True)
        out.copy_(ref)
        state.stats.record("all_gather", compressed=True,
                           logical=C._peer_bytes(world, n * inp.element_size()),
                           wire=C._peer_bytes(world, nb))
        return C.completed_work([out]) if async_op else None


def fsdp_modules(module: torch.nn.Module) -> list:
    """The FSDP2 modules in ``module`` (itself included), in ``modules()`` order."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def quantize_weight_deltas(module: torch.nn.Module, config: QuantConfig | None = None
                           ) -> list[DeltaAllGather]:
    """Give every FSDP2 module in ``module`` its own :class:`DeltaAllGather`; returns
    them (e.g. to :meth:`~DeltaAllGather.reset` after loading a checkpoint, or to sum
    :meth:`~DeltaAllGather.ref_nbytes`). Call after ``fully_shard``, on every rank."""
    mods = fsdp_modules(module)
    if not mods:
        raise ValueError("quantize_weight_deltas: no FSDP2 module found (call fully_shard "
                         "on the model or its blocks first)")
    if not hasattr(mods[0], "set_custom_all_gather"):
        raise RuntimeError(f"quantize_weight_deltas needs FSDPModule.set_custom_all_gather "
                           f"(torch >= 2.9); this is torch {torch.__version__}")
    comms = []
    for m in mods:
        comm = DeltaAllGather(config)
        m.set_custom_all_gather(comm)
        comms.append(comm)
    return comms

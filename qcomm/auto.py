"""``bits=auto``: each call sent exact or compressed, whichever this group's measured
costs predict faster.

Compression pays where the bytes it saves take longer to send than the codec takes to
run: on a 100 Mbit/s link an 8-bit FSDP2 step is several times faster than gloo's, on
loopback it is slower. A collective kind the config marks ``auto``
(:attr:`qcomm.CommConfig.auto`, ``QCOMM_BITS=auto``) is decided call by call::

    exact(bytes)      = the exact inner call's time, fitted  latency + bytes / bandwidth
    compressed(n, q)  = codec + wire, pipelined over the call's pieces:
                        max(codec, wire) + min(codec, wire) / pieces
        codec         = quantize and decode element counts x their measured s/element
        wire          = the payload exchanges' latency + bytes / bandwidth, per level
                        (flat: the whole group; two-level: exact inside the node, the
                        payloads across)

Its inputs are measured on this group, not assumed (:func:`calibrate`, at the first
call a kind's ``auto`` decides, within ~0.1-0.5 s on a 100 Mbit/s link): the exact
inner calls at two sizes (the kinds' own: gloo's reduce-scatter is not its
all-gather), the payloads' all-gather and all-to-all at two sizes on each level's
group, and the codec's seconds an element on this device, on the group's own codec
path. **Every rank decides alike**: each probe's time is the slowest rank's (one
all-reduce MAX), so every rank holds the same model, and a decision is a function of
that model and the call's (kind, elements, dtype, config) alone, which the ranks agree
on. A wrong guess costs time, never a hang or mixed bytes.

**Refreshed when observed times drift**: every :data:`REFRESH` decided calls of a kind
(the same call on every rank), the synchronous calls' observed times over their
predictions, summed per path, are agreed (the slowest rank's, one all-reduce) and scale
that path's predictions; decisions are then made again. Where the model compresses,
the call is the fixed setting's (the same config, the same bytes).

``qcomm.stats()`` counts each kind's decided calls each way with the predicted times
of both paths (``auto_exact``, ``auto_compressed``, ``predicted_exact_s``,
``predicted_compressed_s``); :func:`describe` gives the model itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import inner as I
from .config import QuantConfig
from .layout import packed_nbytes

# Bytes a rank contributes to each probe: a small one (latency) and a large one
# (bandwidth): 256 KiB crosses a 100 Mbit/s link in 21 ms, a 1 Gbit/s one in 2 ms, so
# on a fast link the large probe is run again scaled to take PROBE_SECONDS (at most
# PROBE_SCALE_MAX times larger: 16 MiB), where latency no longer swamps bandwidth.
PROBE_SMALL, PROBE_LARGE = 256, 256 << 10
PROBE_SECONDS = 0.01
PROBE_SCALE_MAX = 64
PROBE_REPEATS = 3  # timed calls of each probe after one warm-up; the fastest counts
# Elements of the codec probe: large enough that a call's fixed cost (~50-200 us on
# CPU) is a small part, small enough to stay a few ms on one core.
CODEC_PROBE = 1 << 16
# Decided calls of a kind between two agreed refreshes of the model, and the furthest
# one refresh may move a path's predictions (a factor of 4 either way).
REFRESH = 128
MAX_CORRECTION = 4.0
DECISIONS_MAX = 4096  # cached decisions kept, at most (one small tuple each)


@dataclass(frozen=True)
class Line:
    """``latency + bytes * per_byte`` seconds: one inner call, fitted to two sizes."""

    latency: float
    per_byte: float

    def __call__(self, nbytes: float) -> float:
        return self.latency + nbytes * self.per_byte

    @classmethod
    def fit(cls, small: tuple[int, float], large: tuple[int, float]) -> Line:
        (b0, t0), (b1, t1) = small, large
        per_byte = max((t1 - t0) / (b1 - b0), 0.0)
        return cls(max(t0 - b0 * per_byte, 0.0), per_byte)

    @property
    def bandwidth(self) -> float:
        """Bytes a second (inf for a link too fast to tell)."""
        return 1.0 / self.per_byte if self.per_byte > 0 else float("inf")


@dataclass
class Model:
    """One group's measured costs (the same on every rank) and its decisions."""

    world: int
    exact: dict[str, Line]  # kind -> the exact inner call by bytes a rank contributes
    gather: Line  # the payloads' all-gather (flat: the group; two-level: across nodes)
    exchange: Line  # the payloads' all-to-all, likewise (the descriptor's too)
    intra_gather: Line | None  # two-level: the node's all-gather of payloads
    intra_exchange: Line | None  # two-level: the node's exact all-to-all
    nodes: int  # ranks one payload exchange spans (flat: world; two-level: nodes)
    codec: dict[QuantConfig, tuple[float, float, float]]  # s/element: quantize, decode, decode-sum
    correction: dict[tuple[str, bool], float] = field(default_factory=dict)
    decisions: dict[tuple, tuple[bool, float, float]] = field(default_factory=dict)
    # per kind: decided calls since the last refresh, and per path (compressed?) the
    # synchronous calls' observed and predicted seconds
    since: dict[str, int] = field(default_factory=dict)
    observed: dict[tuple[str, bool], list[float]] = field(default_factory=dict)

    def predict(self, kind: str, numel: int, dtype: torch.dtype, q: QuantConfig,
                pieces: int) -> tuple[float, float]:
        """(exact, compressed) seconds of one call of ``numel`` elements a rank (an
        all-gather's input, a reduce-scatter's output, an all-reduce's tensor) sent in
        ``pieces`` pieces."""
        size = torch.empty((), dtype=dtype).element_size()
        exact = self.exact[kind](numel * size)
        # a config the group was not calibrated for (a direct call's own): the codec's
        # cost an element hardly depends on the bits; the first config's stands in
        quant, decode, dsum = self.codec.get(q) or next(iter(self.codec.values()))
        if kind == "all_reduce":  # a reduce-scatter of chunks, then their all-gather
            chunk = -(-numel // self.world)
            rs, ag = self._rs(chunk, q, size, quant, dsum), self._ag(chunk, q, quant, decode)
            codec, wire = rs[0] + ag[0], rs[1] + ag[1]
        elif kind == "reduce_scatter":
            codec, wire = self._rs(numel, q, size, quant, dsum)
        else:
            codec, wire = self._ag(numel, q, quant, decode)
        compressed = max(codec, wire) + min(codec, wire) / max(pieces, 1)
        return (exact * self.correction.get((kind, False), 1.0),
                compressed * self.correction.get((kind, True), 1.0))

    def _ag(self, n: int, q: QuantConfig, quant: float, decode: float):
        """(codec, wire) seconds of an all-gather of ``n``-element payloads."""
        payload = packed_nbytes(n, q)
        wire = self.gather(payload) + self.exchange(0)  # and the descriptor's exchange
        if self.intra_gather is not None:  # two-level: the node gathers the payloads
            wire += self.intra_gather(self.nodes * payload)
        return n * quant + self.world * n * decode, wire

    def _rs(self, n: int, q: QuantConfig, size: int, quant: float, dsum: float):
        """(codec, wire) seconds of a reduce-scatter into ``n`` elements."""
        payload = packed_nbytes(n, q)
        wire = self.exchange(payload) + self.exchange(0)
        codec = (self.nodes - 1) * n * quant + self.nodes * n * dsum
        if self.intra_exchange is not None:  # two-level: exact inside the node, summed
            wire += self.intra_exchange(self.nodes * n * size)
            codec += self.world * n * dsum  # the node's fp32 sum, as much as a decode
        return codec, wire

    def decide(self, kind: str, numel: int, dtype: torch.dtype,
               q: QuantConfig) -> tuple[bool, float, float]:
        """(compress?, predicted exact s, predicted compressed s), cached per call shape
        until the next refresh."""
        key = (kind, numel, dtype, q)
        got = self.decisions.get(key)
        if got is None:
            from .collectives import pieces  # the algorithms import the driver, which imports this

            if len(self.decisions) >= DECISIONS_MAX:
                self.decisions.clear()
            n = -(-numel // self.world) if kind == "all_reduce" else numel
            exact, compressed = self.predict(kind, numel, dtype, q, len(pieces(n, q)))
            got = self.decisions[key] = (compressed < exact, exact, compressed)
        return got

    def observe(self, kind: str, compressed: bool, seconds: float,
                predicted: float) -> None:
        """A synchronous decided call's time on this rank, beside its prediction."""
        seen = self.observed.setdefault((kind, compressed), [0.0, 0.0])
        seen[0] += seconds
        seen[1] += predicted

    def due(self, kind: str) -> bool:
        """Count one decided call of ``kind``; whether the model is due a refresh first
        (every :data:`REFRESH` calls: the same call on every rank)."""
        self.since[kind] = self.since.get(kind, 0) + 1
        return self.since[kind] > REFRESH


def _timed(fn, *args, **kwargs) -> float:
    """The fastest of :data:`PROBE_REPEATS` calls of ``fn(*args, **kwargs)`` after a
    warm-up (connections; the codec's first call in a process), in seconds."""
    fn(*args, **kwargs)
    best = float("inf")
    for _ in range(PROBE_REPEATS):
        start = time.perf_counter()
        fn(*args, **kwargs)
        best = min(best, time.perf_counter() - start)
    return best


class _Probes:
    """The inner calls of one calibration: each timed (:func:`_timed`), and the bytes
    every call hands its peers counted (they go to stats as control bytes)."""

    def __init__(self, kind: str, device: torch.device) -> None:
        self.kind, self.device = kind, device
        self.bytes = 0

    def _time(self, fn, group, *args, to_peers: int) -> float:
        rank, what = group.rank(), "auto's probe of the link"

        def call():
            I.wait(I.start(fn, self.kind, what, rank, group, *args), self.kind, what, rank)

        self.bytes += (PROBE_REPEATS + 1) * to_peers
        return _timed(call)

    def payloads(self, group, nbytes: int) -> list[float]:
        """The payloads' all-gather and all-to-all of ``nbytes`` a peer on ``group``."""
        w, dev = group.size(), self.device
        send = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
        rows = torch.zeros(w * nbytes, dtype=torch.uint8, device=dev)
        recv = torch.empty(w * nbytes, dtype=torch.uint8, device=dev)
        return [self._time(I.all_gather, group, recv, send, to_peers=(w - 1) * nbytes),
                self._time(I.all_to_all, group, recv, rows, to_peers=(w - 1) * nbytes)]

    def exact(self, group, kinds, nbytes: int) -> list[float]:
        """The exact fp32 calls of ``kinds`` on ``group``, ``nbytes`` a rank each."""
        w, n = group.size(), nbytes // 4
        full = torch.zeros(w * n, device=self.device)
        part = torch.zeros(n, device=self.device)
        calls = {"all_gather": (I.all_gather, (full, part), (w - 1) * n * 4),
                 "reduce_scatter": (I.reduce_scatter, (part, full, dist.ReduceOp.SUM),
                                    (w - 1) * n * 4),
                 "all_reduce": (I.all_reduce, (part, dist.ReduceOp.SUM),
                                2 * (w - 1) * -(-n // w) * 4)}
        return [self._time(calls[k][0], group, *calls[k][1], to_peers=calls[k][2])
                for k in kinds]

    def agree(self, group, times: list[float]) -> list[float]:
        """Every rank's ``times`` -> the slowest rank's (one all-reduce MAX)."""
        t = torch.tensor(times, dtype=torch.float64, device=self.device)
        rank, what = group.rank(), "auto's agreement"
        I.wait(I.start(I.all_reduce, self.kind, what, rank, group, t, dist.ReduceOp.MAX),
               self.kind, what, rank)
        self.bytes += 2 * (group.size() - 1) * -(-len(times) // group.size()) * 8
        return t.tolist()


def _codec_costs(configs, codec: dict, device: torch.device) -> list[float]:
    """Seconds an element of quantize, decode and decode-sum, per config, on this
    rank's codec path (``codec``: the group's keywords)."""
    from .codec import dequantize_rows, dequantize_sum, quantize_rows

    n = CODEC_PROBE
    x = torch.randn(2, n, device=device)
    out = torch.empty(2, n, device=device)
    times = []
    for q in configs:
        rows = torch.empty(2, packed_nbytes(n, q), dtype=torch.uint8, device=device)
        times += [
            _timed(quantize_rows, x, q, [1, 2], out=rows, **codec) / (2 * n),
            _timed(dequantize_rows, rows, n, torch.float32, q, out=out, check=False,
                   **codec) / (2 * n),
            _timed(dequantize_sum, rows, n, torch.float32, q, own=x[0], out=out[1], skip=0,
                   check=False, **codec) / n]
    return times


def calibrate(state, kind: str, device: torch.device, configs) -> Model:
    """Measure the model of ``state``'s group for the QuantConfigs ``configs`` of its
    auto kinds (every rank at the same call: collective). Each probe runs at
    :data:`PROBE_SMALL` and :data:`PROBE_LARGE` bytes a rank; where the large one is
    over in under :data:`PROBE_SECONDS` (a fast link: latency would swamp the
    bandwidth), once more at the size that takes about that long, by the agreed
    times. The probes' bytes are counted as ``kind``'s control bytes."""
    inner, world = state.inner, state.world
    two_level = state.plan == "two_level"
    levels = list(state.subgroups.get(state.topology))[::-1] if two_level else [inner]
    kinds = [k for k in state.config.auto if getattr(state.config, k) is not None] or [kind]
    probes = _Probes(kind, device)

    def measure(nbytes: int) -> list[float]:
        times = probes.exact(inner, kinds, nbytes)
        for g in levels:
            times += probes.payloads(g, nbytes)
        return times

    configs = list(dict.fromkeys(configs))
    small = measure(PROBE_SMALL)
    agreed = probes.agree(inner, small + measure(PROBE_LARGE)
                          + _codec_costs(configs, state.codec_for(device), device))
    m = len(small)
    small, large, codec = agreed[:m], agreed[m:2 * m], agreed[2 * m:]
    large_bytes = PROBE_LARGE
    if max(large) < PROBE_SECONDS:  # fast: again at the size that takes PROBE_SECONDS
        scale = min(PROBE_SECONDS / max(max(large), 1e-6), PROBE_SCALE_MAX)
        large_bytes = int(PROBE_LARGE * scale) // 4 * 4
        large = probes.agree(inner, measure(large_bytes))
    state.record_control(kind, probes.bytes)
    lines = [Line.fit((PROBE_SMALL, s), (large_bytes, t)) for s, t in zip(small, large,
                                                                          strict=True)]
    exact = dict(zip(kinds, lines, strict=False))
    level = [lines[len(kinds) + 2 * j: len(kinds) + 2 * j + 2] for j in range(len(levels))]
    return Model(world=world, exact=exact, gather=level[0][0], exchange=level[0][1],
                 intra_gather=level[1][0] if two_level else None,
                 intra_exchange=level[1][1] if two_level else None,
                 nodes=state.topology.nodes if two_level else world,
                 codec={q: tuple(codec[3 * i: 3 * i + 3]) for i, q in enumerate(configs)})


def refresh(state, model: Model, kind: str, device: torch.device) -> None:
    """The agreed refresh of ``kind`` (collective: every rank at the same decided call):
    each path's observed over predicted seconds since the last, the slowest rank's,
    scales that path's predictions (by at most :data:`MAX_CORRECTION` a refresh)."""
    inner, rank = state.inner, state.inner.rank()
    paths = (False, True)
    sums = [v for p in paths for v in model.observed.get((kind, p), (0.0, 0.0))]
    agreed = torch.tensor(sums, dtype=torch.float64, device=device)
    I.wait(I.start(I.all_reduce, kind, "auto's refresh", rank, inner, agreed,
                   dist.ReduceOp.MAX), kind, "auto's refresh", rank)
    state.record_control(kind, 2 * (state.world - 1) * -(-len(sums) // state.world) * 8)
    t = agreed.tolist()
    for i, path in enumerate(paths):
        observed, predicted = t[2 * i], t[2 * i + 1]
        if observed > 0 and predicted > 0:
            step = min(max(observed / predicted, 1 / MAX_CORRECTION), MAX_CORRECTION)
            model.correction[(kind, path)] = model.correction.get((kind, path), 1.0) * step
    model.observed = {k: v for k, v in model.observed.items() if k[0] != kind}
    model.since[kind] = 1
    model.decisions.clear()


def describe(group=None) -> dict:
    """The auto model of ``group`` (default: the default group): its measured inputs and
    corrections, or None before its first auto decision."""
    from .driver import group_state

    model = group_state(group).auto
    if model is None:
        return None
    return {"world": model.world, "nodes": model.nodes,
            "exact": {k: {"latency_s": v.latency, "bandwidth_Bps": v.bandwidth}
                      for k, v in model.exact.items()},
            "gather": {"latency_s": model.gather.latency,
                       "bandwidth_Bps": model.gather.bandwidth},
            "exchange": {"latency_s": model.exchange.latency,
                         "bandwidth_Bps": model.exchange.bandwidth},
            "codec_s_per_element": {repr(q): dict(zip(("quantize", "decode", "decode_sum"),
                                                      v, strict=True))
                                    for q, v in model.codec.items()},
            "correction": {f"{k}/{'compressed' if p else 'exact'}": v
                           for (k, p), v in model.correction.items()}}

"""``bits=auto``: each call sent exact or compressed, whichever this group's measured
costs predict faster.

Compression pays where the bytes it saves take longer to send than the codec takes to
run: on a 100 Mbit/s link an 8-bit FSDP2 step is several times faster than gloo's, on
loopback it is slower. A collective kind the config marks ``auto``
(:attr:`qcomm.CommConfig.auto`, ``QCOMM_BITS=auto``) is decided call by call::

    exact(bytes)      = the exact inner call's time, fitted  latency + bytes / bandwidth;
                        on a CPU group, whose every such call is agreed, the
                        descriptor's exchange with the bytes riding in it where they
                        fit the envelope, else that exchange + the exact call
    compressed(n, q)  = codec and wire, pipelined over the call's pieces:
                        max(codec, wire) + min(codec, wire) / pieces
        codec         = per codec call: its fixed cost + elements x its cost an element
        wire          = the payload exchanges' latency + bytes / bandwidth, per level
                        (flat: the whole group; two-level: exact inside the node, the
                        payloads across); a one-piece call that fits the envelope rides
                        in its descriptor's exchange, codec + that exchange

Its inputs are measured on this group, not assumed (:func:`calibrate`, at the first
call a kind's ``auto`` decides, once every rank has agreed on that call; within
~0.1-0.5 s on a 100 Mbit/s link): the exact
inner calls at two sizes (the kinds' own: gloo's reduce-scatter is not its
all-gather), the payloads' all-gather and all-to-all at two sizes on each level's
group, and the codec's calls at two sizes on this device, on the group's own codec
path. **Every rank decides alike**: each probe's time is the slowest rank's (one
all-reduce MAX), so every rank holds the same model, and a decision is a function of
that model and the call's (kind, elements, dtype, config) alone. On a CPU group the
call's descriptor carries the way it goes beside those, and is compared before any
payload or exact call moves (:func:`qcomm.driver._run_agreed`): ranks that disagree
are refused alike. What steers a decision besides the model (the calls since a
refresh, a trial's calls left, the calls taken on each path) changes only when a call
every rank agreed on is committed (:meth:`Model.commit`), so it is the same on every
rank, and a refused call changes nothing. A wrong guess costs time, never a hang or
mixed bytes.

**Refreshed when observed times drift**: after 4 committed calls of a kind, then 8, 16,
... and every :data:`REFRESH` (after the same call on every rank), the calls' observed
times (synchronous or not: the whole call, as the worker runs an async one) over their
predictions, their median per path and size class (factors
of 4 of the bytes), are agreed (the slowest rank's, one all-reduce) and, once a class
has :data:`MIN_OBSERVED` calls on a path, scale that path's predictions for the class; a
class never observed on a path keeps the raw model's (what a path does at one size says
little of another: a shaper's burst speeds small calls only, a call's fixed costs weigh
on small ones only). Decisions are then made again. Compression is chosen where it is
predicted :data:`MARGIN` faster: near a tie, exact. A size class observed on one path
only sends its next :data:`MIN_OBSERVED` calls the other way, where the two predictions
are within 2x, so a path the model underrates is seen, and corrected at the next
refresh. Where the model compresses, the call is the fixed setting's (the same config,
the same bytes).

``qcomm.stats()`` counts each kind's decided calls each way with the predicted times
of both paths (``auto_exact``, ``auto_compressed``, ``predicted_exact_s``,
``predicted_compressed_s``); :func:`qcomm.auto_model` gives the model itself.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import inner as I
from .config import KINDS, QuantConfig
from .envelope import envelope_cap
from .layout import DESC_NBYTES, packed_nbytes
from .pieces import envelope_body, pieces

# Bytes a rank contributes to each probe: a small one (latency) and a large one
# (bandwidth): 256 KiB crosses a 100 Mbit/s link in 21 ms, a 1 Gbit/s one in 2 ms, so
# on a fast link the large probe is run again scaled to take PROBE_SECONDS (at most
# PROBE_SCALE_MAX times larger: 16 MiB), where latency no longer swamps bandwidth.
PROBE_SMALL, PROBE_LARGE = 256, 256 << 10
PROBE_SECONDS = 0.01
PROBE_SCALE_MAX = 64
PROBE_REPEATS = 3  # timed calls of each probe after one warm-up; the fastest counts
# The clock a decided call's time is observed by (a test stands a fake one in)
clock = time.perf_counter
# Elements a row of the codec's probes (2 rows): a small call (its fixed cost, ~50-200
# us on CPU) and a large one (its cost an element), a few ms on one core.
CODEC_SMALL, CODEC_LARGE = 1 << 10, 1 << 17
# Decided calls of a kind before its first agreed refresh of the model, twice as many
# before each next one up to REFRESH (the model corrects itself early, then rarely: a
# refresh is one all-reduce of 1 KiB); the furthest one refresh may move a path's
# predictions (a factor of 4 either way); the size classes corrected apart (factors of
# 4 of a call's bytes: up to 2^64). Early enough that a size called ~30 times (a
# benchmark's point) is decided by what it did: its other path tried from call 5, both
# corrected after call 12 (measured at 1 Gbit/s: 64 KiB all-gathers then went exact,
# 0.3 ms, where a first refresh after 16 calls left them compressed, 1.3 ms).
FIRST_REFRESH = 4
REFRESH = 128
CLASSES = 32
# Calls of a size class on a path before their times correct its predictions (fewer
# wait for the next refresh): one noisy call does not flip a class.
MIN_OBSERVED = 4
# A class's correction is the median of its calls' observed/predicted ratios, not the
# mean: on 2 busy cores a call that blocks now and then waits a scheduler tick (4 ms at
# HZ=250) more, whichever its path (plain gloo reduce-scatters of 64 KiB on loopback,
# 2-core Xeon: median 0.30-0.68 ms, mean 1.2-1.8, max 7-8: docs/design.md's snippet),
# and the mean of the 4-16 calls a correction sees follows those ticks.
# After a refresh, a size class observed on one path only sends its next MIN_OBSERVED
# calls the other way (enough to correct that path at the next refresh), where the two
# predictions are within this factor: once a class, each such call up to 2x its better
# prediction; a path the raw model underrates still gets observed, and corrected
# (measured: on an unshaped veth the model sent 74% of FSDP2's calls exact, and so kept
# gloo's step, where 8 bits ran 0.83x of it).
EXPLORE_WITHIN = 2.0
# Compression must be predicted this much faster than exact to be chosen: near a tie
# exact costs little and loses nothing, and a class does not flip back and forth on
# noise (measured on loopback, 2 cores: one run's steps swung by 10-25% seed to seed).
MARGIN = 1.1
MAX_CORRECTION = 4.0
DECISIONS_MAX = 4096  # cached decisions kept, at most (one small tuple each)
# CUDA calls timed by events not yet read, at most: read once complete, never waited for
# (a sync on the hot path would stall FSDP's overlap); the oldest dropped beyond
PENDING_MAX = 256


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
    # per config: quantize, decode and decode-sum, each a Line of (seconds a call,
    # seconds an element: its per_byte) over the elements of one codec call
    codec: dict[QuantConfig, tuple[Line, Line, Line]]
    # whether every call is agreed before it moves (a CPU group: its descriptor, which an
    # exact call pays too, its bytes riding in the envelope where they fit)
    agreed: bool = False
    # observed over predicted, agreed at refreshes: per (kind, compressed?, size class)
    correction: dict[tuple, float] = field(default_factory=dict)
    # what measuring this model took (calibrate), on this rank, and of it the codec's
    # calls: their first in a process pays its set-up (a compile, torch._inductor's
    # import: seconds), which the first compressed call would pay otherwise
    seconds: float = 0.0
    codec_seconds: float = 0.0
    decisions: dict[tuple, tuple[bool, float, float]] = field(default_factory=dict)
    # per kind: committed calls since the last refresh and refreshes so far; per (kind,
    # compressed?, size class) the calls' observed over predicted seconds (synchronous
    # or not) since the class was last corrected on that path (this rank's): fewer than
    # MIN_OBSERVED, or the calls since the last refresh (at most REFRESH), which
    # corrects the class and empties its list
    since: dict[str, int] = field(default_factory=dict)
    refreshes: dict[str, int] = field(default_factory=dict)
    observed: dict[tuple, list[float]] = field(default_factory=dict)
    # (kind, compressed?, size class) -> the calls that went that way: agreed (every
    # rank commits the same calls, :meth:`commit`), so what it steers is the same on
    # every rank: a class's first call on a path is not observed (it pays one-time
    # set-up: buffers, the codec's first call at its size), a trial's length
    taken: dict[tuple, int] = field(default_factory=dict)
    # (kind, size class) -> [path, calls left]: its next calls go that way (refresh)
    explore: dict[tuple, list] = field(default_factory=dict)
    # CUDA calls timed by a pair of events, read when complete (:meth:`time_later`)
    pending: list = field(default_factory=list)

    def corrected(self, kind: str, compressed: bool, cls: int, seconds: float) -> float:
        """``seconds`` times the path's agreed correction for the size class (1 where
        none: the raw model's)."""
        return seconds * self.correction.get((kind, compressed, cls), 1.0)

    def predict(self, kind: str, numel: int, dtype: torch.dtype,
                q: QuantConfig) -> tuple[float, float]:
        """(exact, compressed) seconds of one call of ``numel`` elements a rank (an
        all-gather's input, a reduce-scatter's output, an all-reduce's tensor)."""
        size = dtype.itemsize
        exact = self.exact[kind](numel * size)
        if self.agreed:  # the descriptor's exchange, the exact bytes riding where they fit
            body = numel * size  # a peer's: the shard, the chunk, the whole tensor
            if body <= envelope_cap(self.world):
                exact = self.exchange(DESC_NBYTES + body)
            else:
                exact += self.exchange(DESC_NBYTES)
        # a config the group was not calibrated for (a direct call's own): the codec's
        # cost an element hardly depends on the bits; the first config's stands in
        codec = self.codec.get(q) or next(iter(self.codec.values()))
        if kind == "all_reduce":  # a reduce-scatter of chunks, then their all-gather
            chunk = -(-numel // self.world)
            compressed = self._rs(chunk, q, size, codec) + self._ag(chunk, q, codec)
        elif kind == "reduce_scatter":
            compressed = self._rs(numel, q, size, codec)
        else:
            compressed = self._ag(numel, q, codec)
        cls = size_class(numel * size)
        return (self.corrected(kind, False, cls, exact),
                self.corrected(kind, True, cls, compressed))

    def _pipelined(self, n: int, q: QuantConfig, codec_calls, wire: Line,
                   per_peer: int) -> float:
        """One pipeline over the pieces of ``n`` elements: ``codec_calls`` ((Line, elements
        a piece) of each codec call a piece makes), ``wire`` the exchange each piece makes,
        ``per_peer`` the payload bytes of the whole call. A one-piece call whose payload
        fits the envelope rides in it (the descriptor's exchange, no other); otherwise
        the descriptor's exchange overlaps the first quantize (not counted)."""
        parts = pieces(n, q)
        k = len(parts)
        codec = sum(k * line.latency + count * n * line.per_byte for line, count in codec_calls)
        flat = self.intra_gather is None  # a two-level call never rides
        if flat and envelope_body(n, q) and per_peer <= envelope_cap(self.nodes):
            return codec + self.exchange(DESC_NBYTES + per_peer)
        transfer = k * wire.latency + per_peer * wire.per_byte
        return max(codec, transfer) + min(codec, transfer) / k

    def _ag(self, n: int, q: QuantConfig, codec) -> float:
        """An all-gather of ``n``-element payloads (two-level: across nodes, then the
        node gathers them, exact bytes)."""
        quant, decode, _ = codec
        payload = packed_nbytes(n, q)
        if self.intra_gather is None:
            return self._pipelined(n, q, [(quant, 1), (decode, self.world)], self.gather,
                                   payload)
        across = self._pipelined(n, q, [(quant, 1)], self.gather, payload)
        return across + self.intra_gather(self.nodes * payload) + decode(self.world * n)

    def _rs(self, n: int, q: QuantConfig, size: int, codec) -> float:
        """A reduce-scatter into ``n`` elements (two-level: an exact all-to-all inside the
        node and its fp32 sum, then the compressed one across nodes)."""
        quant, _, dsum = codec
        k = self.nodes
        across = self._pipelined(n, q, [(quant, k - 1), (dsum, k)], self.exchange,
                                 packed_nbytes(n, q))
        if self.intra_exchange is None:
            return across
        # the node's fp32 sum counted as a decode-sum of its rows
        return across + self.intra_exchange(k * n * size) + dsum(self.world * n)

    def predicted(self, kind: str, numel: int, dtype: torch.dtype,
                  q: QuantConfig) -> tuple[bool, float, float]:
        """(compress?, predicted exact s, predicted compressed s) by the model alone,
        cached per call shape until the next refresh."""
        key = (kind, numel, dtype, q)
        got = self.decisions.get(key)
        if got is None:
            if len(self.decisions) >= DECISIONS_MAX:
                self.decisions.clear()
            exact, compressed = self.predict(kind, numel, dtype, q)
            got = self.decisions[key] = (compressed * MARGIN < exact, exact, compressed)
        return got

    def choose(self, kind: str, numel: int, dtype: torch.dtype,
               q: QuantConfig) -> tuple[bool, float, float]:
        """The way one call goes, with both predictions: the model's choice, or the
        path its size class's trial tries (:func:`refresh`) where the two predictions
        are within :data:`EXPLORE_WITHIN`. Changes nothing: a call counts once every
        rank agreed on it (:meth:`commit`), so a refused call leaves the model as it
        was."""
        got = self.predicted(kind, numel, dtype, q)
        if not self.explore:
            return got
        trial = self.explore.get((kind, size_class(numel * dtype.itemsize)))
        if trial is not None and got[0] is not trial[0] and not _far(got):
            return (trial[0], got[1], got[2])
        return got

    def commit(self, kind: str, numel: int, dtype: torch.dtype, q: QuantConfig,
               compress: bool) -> None:
        """Count one call every rank agreed on, sent ``compress``-wise: its trial's calls
        left (one fewer where the trial turned it; none where the predictions are far
        apart), the calls since the last refresh, and the calls taken on its path and
        size class. Every rank commits the same calls, so all of it is agreed."""
        cls = size_class(numel * dtype.itemsize)
        trial = self.explore.get((kind, cls)) if self.explore else None
        if trial is not None:
            got = self.predicted(kind, numel, dtype, q)
            if _far(got):
                trial[1] = 0
            elif got[0] is not trial[0]:
                trial[1] -= 1
            if trial[1] <= 0:
                del self.explore[(kind, cls)]
        key = (kind, compress, cls)
        self.taken[key] = self.taken.get(key, 0) + 1
        self.since[kind] = self.since.get(kind, 0) + 1

    def decide(self, kind: str, numel: int, dtype: torch.dtype,
               q: QuantConfig) -> tuple[bool, float, float]:
        """:meth:`choose` and :meth:`commit` at once, for a call that cannot be refused
        (a CUDA group's: it exchanges no descriptor)."""
        got = self.choose(kind, numel, dtype, q)
        self.commit(kind, numel, dtype, q, got[0])
        return got

    def observe(self, kind: str, compressed: bool, numel: int, dtype: torch.dtype,
                seconds: float, predicted: float) -> None:
        """A committed call's time on this rank (synchronous or not: the whole call),
        beside its prediction; not the first call of its kind, path and size class
        (:attr:`taken`: it pays one-time set-up)."""
        key = self._observable(kind, compressed, numel, dtype)
        if key is not None:
            self._observed(key, seconds, predicted)

    def _observable(self, kind: str, compressed: bool, numel: int,
                    dtype: torch.dtype) -> tuple | None:
        """A committed call's (kind, path, size class), or None for the first call of
        its class on its path (:attr:`taken`: it pays one-time set-up)."""
        key = (kind, compressed, size_class(numel * dtype.itemsize))
        return key if self.taken.get(key, 0) > 1 else None

    def _observed(self, key: tuple, seconds: float, predicted: float) -> None:
        self.observed.setdefault(key, []).append(seconds / predicted if predicted > 0 else 1.0)

    def time_later(self, start, end, kind: str, compressed: bool, numel: int,
                   dtype: torch.dtype, predicted: float) -> None:
        """A committed CUDA call between two timing events on its stream: observed as
        :meth:`observe` would, once ``end`` has completed (:meth:`collect`)."""
        key = self._observable(kind, compressed, numel, dtype)
        if key is None:
            return
        if len(self.pending) >= PENDING_MAX:
            del self.pending[0]
        self.pending.append((start, end, key, predicted))

    def collect(self) -> None:
        """Observe every pending CUDA call whose end event has completed (``query()``:
        no wait); the others stay pending."""
        waiting = []
        for start, end, key, predicted in self.pending:
            if end.query():
                self._observed(key, start.elapsed_time(end) / 1e3, predicted)
            else:
                waiting.append((start, end, key, predicted))
        self.pending = waiting

    def due(self, kind: str) -> bool:
        """Whether ``kind``'s agreed refresh is due: after :data:`FIRST_REFRESH`
        committed calls, twice as many each time up to :data:`REFRESH` (the same call on
        every rank)."""
        return self.since.get(kind, 0) >= min(REFRESH,
                                               FIRST_REFRESH << self.refreshes.get(kind, 0))

    def describe(self) -> dict:
        """The model's measured inputs and corrections, as plain data
        (:func:`qcomm.auto_model`)."""
        return {"world": self.world, "nodes": self.nodes, "calibration_s": self.seconds,
                "link_calibration_s": self.seconds - self.codec_seconds,
                "exact": {k: {"latency_s": v.latency, "bandwidth_Bps": v.bandwidth}
                          for k, v in self.exact.items()},
                "gather": {"latency_s": self.gather.latency,
                           "bandwidth_Bps": self.gather.bandwidth},
                "exchange": {"latency_s": self.exchange.latency,
                             "bandwidth_Bps": self.exchange.bandwidth},
                "codec": {repr(q): {name: {"call_s": line.latency, "element_s": line.per_byte}
                                    for name, line in zip(("quantize", "decode", "decode_sum"),
                                                          v, strict=True)}
                          for q, v in self.codec.items()},
                "correction": {f"{k}/{'compressed' if p else 'exact'}/4^{c}B": v
                               for (k, p, c), v in sorted(self.correction.items())}}


def _far(got: tuple[bool, float, float]) -> bool:
    """Whether a call's two predictions are :data:`EXPLORE_WITHIN` apart or more: no
    trial sends it the way predicted slower."""
    _, exact, compressed = got
    return max(exact, compressed) >= EXPLORE_WITHIN * min(exact, compressed)


def size_class(nbytes: int) -> int:
    """The size class of a call of ``nbytes`` a rank (factors of 4: 0..CLASSES - 1), by
    which observed times correct predictions."""
    return min(nbytes.bit_length() // 2, CLASSES - 1)


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
    """The inner calls of one calibration or refresh: each timed (:func:`_timed`), the
    agreement of their results (:meth:`agree`), and the bytes every call hands its peers
    counted per group (:meth:`record`: control bytes, each against the link it crossed)."""

    def __init__(self, kind: str, device: torch.device) -> None:
        self.kind, self.device = kind, device
        self.sent: dict[int, list] = {}  # id(group) -> [group, bytes handed to its peers]

    def _count(self, group, nbytes: int) -> None:
        self.sent.setdefault(id(group), [group, 0])[1] += nbytes

    def record(self, state) -> None:
        """Count the bytes in ``state``'s stats as the kind's control bytes, each group's
        against its own link (:meth:`qcomm.driver.GroupState.record_control`)."""
        for group, nbytes in self.sent.values():
            state.record_control(self.kind, nbytes, group)

    def _time(self, fn, group, *args, to_peers: int) -> float:
        rank, what = group.rank(), "auto's probe of the link"

        def call():
            I.wait(I.start(fn, self.kind, what, rank, group, *args), self.kind, what, rank)

        self._count(group, (PROBE_REPEATS + 1) * to_peers)
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
        self._count(group, 2 * (group.size() - 1) * -(-len(times) // group.size()) * 8)
        return t.tolist()


def _codec_costs(configs, codec: dict, device: torch.device) -> list[float]:
    """Seconds of quantize, decode and decode-sum calls, per config, at
    :data:`CODEC_SMALL` and :data:`CODEC_LARGE` elements a row (2 rows), on this rank's
    codec path (``codec``: the group's keywords)."""
    from .codec import dequantize_rows, dequantize_sum, quantize_rows

    times = []
    for n in (CODEC_SMALL, CODEC_LARGE):
        x = torch.randn(2, n, device=device)
        out = torch.empty(2, n, device=device)
        for q in configs:
            rows = torch.empty(2, packed_nbytes(n, q), dtype=torch.uint8, device=device)
            times += [
                _timed(quantize_rows, x, q, [1, 2], out=rows, **codec),
                _timed(dequantize_rows, rows, n, torch.float32, q, out=out, check=False,
                       **codec),
                _timed(dequantize_sum, rows, n, torch.float32, q, own=x[0], out=out[1],
                       skip=0, check=False, **codec)]
    return times


def calibrate(state, kind: str, device: torch.device, configs) -> Model:
    """Measure the model of ``state``'s group for the QuantConfigs ``configs`` of its
    auto kinds (every rank at the same call: collective). Each probe runs at
    :data:`PROBE_SMALL` and :data:`PROBE_LARGE` bytes a rank; where the large one is
    over in under :data:`PROBE_SECONDS` (a fast link: latency would swamp the
    bandwidth), once more at the size that takes about that long, by the agreed
    times. The probes' bytes are counted as ``kind``'s control bytes."""
    began = time.perf_counter()
    inner, world = state.inner, state.world
    two_level = state.plan == "two_level"
    levels = list(state.subgroups.get(state.topology))[::-1] if two_level else [inner]
    kinds = KINDS  # every kind: a call's own config may make any kind auto (DDP's hook)
    probes = _Probes(kind, device)

    def measure(nbytes: int) -> list[float]:
        times = probes.exact(inner, kinds, nbytes)
        for g in levels:
            times += probes.payloads(g, nbytes)
        return times

    configs = list(dict.fromkeys(configs))
    links = measure(PROBE_SMALL) + measure(PROBE_LARGE)
    began_codec = time.perf_counter()
    codec = _codec_costs(configs, state.codec_for(device), device)
    codec_s = time.perf_counter() - began_codec
    agreed = probes.agree(inner, links + codec)
    m = len(links) // 2
    small, large, codec = agreed[:m], agreed[m:2 * m], agreed[2 * m:]
    large_bytes = PROBE_LARGE
    if max(large) < PROBE_SECONDS:  # fast: again at the size that takes PROBE_SECONDS
        scale = min(PROBE_SECONDS / max(max(large), 1e-6), PROBE_SCALE_MAX)
        large_bytes = int(PROBE_LARGE * scale) // 4 * 4
        large = probes.agree(inner, measure(large_bytes))
    probes.record(state)
    lines = [Line.fit((PROBE_SMALL, s), (large_bytes, t)) for s, t in zip(small, large,
                                                                          strict=True)]
    exact = dict(zip(kinds, lines, strict=False))
    level = [lines[len(kinds) + 2 * j: len(kinds) + 2 * j + 2] for j in range(len(levels))]
    return Model(seconds=time.perf_counter() - began, codec_seconds=codec_s,
                 world=world, exact=exact, gather=level[0][0], exchange=level[0][1],
                 intra_gather=level[1][0] if two_level else None,
                 intra_exchange=level[1][1] if two_level else None,
                 nodes=state.topology.nodes if two_level else world,
                 codec={q: _codec_lines(codec, i, len(configs)) for i, q in enumerate(configs)},
                 agreed=device.type == "cpu")


def _codec_lines(times: list[float], i: int, configs: int) -> tuple[Line, Line, Line]:
    """Config ``i``'s quantize, decode and decode-sum lines from :func:`_codec_costs`'
    agreed times (each: seconds a call, seconds an element). Quantize and decode go
    over both rows, decode-sum decodes one."""
    small, large = times[3 * i: 3 * i + 3], times[3 * (configs + i): 3 * (configs + i) + 3]
    rows = (2, 2, 1)
    return tuple(Line.fit((r * CODEC_SMALL, a), (r * CODEC_LARGE, b))
                 for r, a, b in zip(rows, small, large, strict=True))


def refresh(state, model: Model, kind: str, device: torch.device) -> None:
    """The agreed refresh of ``kind`` (collective: every rank after the same committed
    call). Per path and size class, the median of the calls' observed over
    predicted seconds and their count since the class was last corrected on that path,
    the slowest rank's (one all-reduce MAX of a fixed number of values, whatever each
    rank observed); a class with at least :data:`MIN_OBSERVED` calls on a path scales
    that path's predictions for it by that median (at most :data:`MAX_CORRECTION` a
    refresh); fewer calls wait for the next refresh. A class observed on one path only,
    its other path never corrected, tries that path for the calls it lacks
    (:meth:`Model.choose`)."""
    keys = [(kind, path, cls) for path in (False, True) for cls in range(CLASSES)]
    local = []
    for key in keys:
        ratios = model.observed.get(key, ())
        local += [statistics.median(ratios) if ratios else 0.0, float(len(ratios))]
    probes = _Probes(kind, device)
    t = probes.agree(state.inner, local)
    probes.record(state)
    seen = {key: (t[2 * i], int(t[2 * i + 1])) for i, key in enumerate(keys)}
    # a class seen on one path only: its next calls try the other, as many as it lacks
    # to be corrected (where the two predictions are within EXPLORE_WITHIN), or a path
    # predicted slower than it is would never be seen, and never corrected
    for key in [key for key in model.explore if key[0] == kind]:
        del model.explore[key]
    for cls in range(CLASSES):
        for path in (False, True):
            known = seen[(kind, path, cls)][1] > 0 or (kind, path, cls) in model.correction
            other = (kind, not path, cls)
            lacking = MIN_OBSERVED - seen[other][1] + (model.taken.get(other, 0) == 0)
            if known and other not in model.correction and lacking > 0:
                model.explore[(kind, cls)] = [not path, lacking]
    for key in keys:
        ratio, count = seen[key]
        if count >= MIN_OBSERVED and ratio > 0:  # fewer: kept for the next refresh
            step = min(max(ratio, 1 / MAX_CORRECTION), MAX_CORRECTION)
            model.correction[key] = model.correction.get(key, 1.0) * step
            model.observed.pop(key, None)
    model.since[kind] = 0
    model.refreshes[kind] = model.refreshes.get(kind, 0) + 1
    model.decisions.clear()

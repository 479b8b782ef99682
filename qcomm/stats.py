"""Per-group counters: how many collectives went compressed or exact, and their bytes.

Bytes are counted from one rank's point of view as *what leaves this rank for its
peers* under a direct exchange, whatever the inner algorithm (ring, tree) does with
them:

- all-gather: this rank's shard goes to ``world - 1`` peers;
- reduce-scatter: ``world - 1`` chunks go one to each peer;
- all-reduce: a reduce-scatter followed by an all-gather of the reduced chunk
  (``2 (world - 1)`` chunks; what a ring all-reduce moves too).

``logical_bytes`` is what the exact collective would send; ``wire_bytes`` is every byte
qcomm handed to its inner groups for peers: payloads, the exact calls' tensors, and the
control traffic of compressed calls (each call's descriptor in its envelope, with any
room a call did not fill, and a group's one config agreement), which ``control_bytes``
counts again on its own. ``ratio`` is ``logical / wire``: what really left the rank.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from .config import KINDS


@dataclass
class CollectiveStats:
    """Counters of one collective kind on one group (this rank)."""

    calls_compressed: int = 0  # calls sent as packed payloads
    calls_exact: int = 0  # calls passed through to the inner group unchanged
    logical_bytes: int = 0  # bytes the exact collective would send (see module doc)
    wire_bytes: int = 0  # every byte handed to the inner groups for peers (see module doc)
    control_bytes: int = 0  # of them: descriptors, unfilled envelope room, config agreement
    # The bytes this rank sent (payloads and exact), split by where the peer is: on this
    # rank's node, or on another node (what crossed the slow link). Without node
    # information (a group of one node, or flat) every peer counts as on another node.
    intra_node_bytes: int = 0
    inter_node_bytes: int = 0
    # bits=auto (qcomm.auto): the calls its model sent each way (of calls_exact and
    # calls_compressed), and why: its predicted seconds of both paths, summed over them
    auto_exact: int = 0
    auto_compressed: int = 0
    predicted_exact_s: float = 0.0
    predicted_compressed_s: float = 0.0

    @property
    def ratio(self) -> float:
        """``logical / wire`` (1.0 when nothing was sent)."""
        return self.logical_bytes / self.wire_bytes if self.wire_bytes else 1.0


class Stats:
    """The counters of one group, per kind; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_kind = {k: CollectiveStats() for k in KINDS}

    def record(self, kind: str, *, compressed: bool, logical: int, wire: int,
               intra: int = 0, predicted: tuple[float, float] | None = None) -> None:
        """One call: ``wire`` bytes sent to peers, ``intra`` of them to peers on this
        rank's node; ``predicted``: auto's (exact, compressed) seconds where it decided."""
        with self._lock:
            s = self._by_kind[kind]
            if compressed:
                s.calls_compressed += 1
            else:
                s.calls_exact += 1
            if predicted is not None:
                if compressed:
                    s.auto_compressed += 1
                else:
                    s.auto_exact += 1
                s.predicted_exact_s += predicted[0]
                s.predicted_compressed_s += predicted[1]
            s.logical_bytes += logical
            s.wire_bytes += wire
            s.intra_node_bytes += intra
            s.inter_node_bytes += wire - intra

    def record_control(self, kind: str, nbytes: int, intra: int = 0) -> None:
        """Control bytes sent to peers (``intra`` of them on this rank's node): part of
        the wire too."""
        with self._lock:
            s = self._by_kind[kind]
            s.control_bytes += nbytes
            s.wire_bytes += nbytes
            s.intra_node_bytes += intra
            s.inter_node_bytes += nbytes - intra

    def snapshot(self) -> dict[str, CollectiveStats]:
        with self._lock:
            return {k: CollectiveStats(**vars(v)) for k, v in self._by_kind.items()}

    def reset(self) -> None:
        with self._lock:
            self._by_kind = {k: CollectiveStats() for k in KINDS}


def format_table(snapshot: dict[str, CollectiveStats]) -> str:
    """A small text table of a :func:`stats` snapshot (what the demo prints)."""
    rows = [f"{'collective':<15}{'compressed':>11}{'exact':>7}{'uncompressed':>15}"
            f"{'on the wire':>15}{'of it control':>15}{'ratio':>8}"]
    total = CollectiveStats()
    for kind, s in snapshot.items():
        rows.append(_row(kind, s))
        for f in ("calls_compressed", "calls_exact", "logical_bytes", "wire_bytes",
                  "control_bytes"):
            setattr(total, f, getattr(total, f) + getattr(s, f))
    rows.append(_row("total", total))
    return "\n".join(rows)


def _row(name: str, s: CollectiveStats) -> str:
    return (f"{name:<15}{s.calls_compressed:>11}{s.calls_exact:>7}{_mib(s.logical_bytes):>15}"
            f"{_mib(s.wire_bytes):>15}{_mib(s.control_bytes):>15}{s.ratio:>7.2f}x")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"

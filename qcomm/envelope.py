"""The envelope: how a CPU group's call descriptor travels, and the payloads that ride
with it.

Every compressed call of a CPU group exchanges one descriptor per rank before its
payloads move (:mod:`qcomm.handshake` compares them). The exchange is an all-to-all of
``[world, size]`` rows: row j of a rank's send buffer goes to rank j (its own row stays
local), so every rank receives every peer's descriptor, and a small call's payloads can
ride in the same exchange, one round trip instead of two::

    row j of a rank's envelope (size = DESC_NBYTES + room bytes)
    +--------------------------+------------------------------------+-----------------+
    | descriptor (48 bytes)    | body: the payload for rank j       | zeros up to     |
    |  qcomm/layout.py         |  all-gather: this rank's payload   | room            |
    |                          |  (every row the same)              |                 |
    |                          |  reduce-scatter / the all-reduce's |                 |
    |                          |  first step: the chunk for rank j  |                 |
    +--------------------------+------------------------------------+-----------------+

A rank sends ``(world - 1) * size`` bytes: each peer gets exactly its own payload, never
another rank's (an all-gather of reduce-scatter slots would send every rank all of
them: ``(world - 1)^2`` slots where ``world - 1`` are needed).

**The room must be the same on every rank before anything is compared** (gloo aborts
the process when a peer sends a size it does not expect), so it follows only from what
every rank has already agreed on: the history of calls that passed the descriptor check,
identical on every rank. :class:`Envelope` predicts the next call from that history:
training repeats one step's sequence of calls (an FSDP2 step: one all-gather per module
in forward and backward, one reduce-scatter per module), so once the history ends with
a repetition of a period P (:func:`window`), the next call is the one P calls back, and
the room is exactly that call's body: a predicted call rides with no padding at all. Until a
period is confirmed, and for a call whose body is 0 (too big to ride, two-level), the
room is 0: a bare 48-byte descriptor. A call that does not match the prediction sends
the room it was given (zeros where its payload would not fit) and its payloads on their
own after; every such byte is counted in the group's ``control_bytes`` and
``wire_bytes`` (:mod:`qcomm.stats`). A pattern that breaks (an eval step between
training steps) costs one such room, then the period is found again.
"""

from __future__ import annotations

import torch

from . import inner as I
from .layout import DESC_NBYTES

# The most body bytes a peer's row carries, and the most a rank receives (room x world):
# a 2^16-element 8-bit reduce-scatter slot (66 080 bytes) rides at any world size up to
# 4, an all-gather of 2^16 elements up to 4 too. Bigger calls run as pipelines of pieces,
# whose first quantize hides the bare descriptor's exchange anyway.
ENVELOPE_ROOM_MAX = 136 * 1024
ENVELOPE_TOTAL_MAX = 272 * 1024
# The longest period looked for (calls of one training step): an FSDP2 step of M
# modules makes ~3 M compressed calls, so 1024 covers ~340 FSDP modules.
MAX_PERIOD = 1024
KEY_NBYTES = 40  # the descriptor without its call index: what recurs call after call
# The period search's budget, in window compares (a slice compare of at most 32 keys,
# ~0.5 us): each agreed call adds SEARCH_CREDIT, up to SEARCH_CREDIT_MAX, and a search
# spends one a candidate period it examines, so a sequence with no period (calls drawn
# at random from a few keys: hundreds of candidates a call, 80-490 us a call unbounded)
# costs ~2 us a call amortized, while a training step whose period breaks (an eval
# step) finds it again at once from the credit the periodic calls saved. The budget
# is a function of the agreed history alone: every rank searches alike.
SEARCH_CREDIT = 4
SEARCH_CREDIT_MAX = 4 * MAX_PERIOD


def envelope_cap(world: int) -> int:
    """The most body bytes an envelope row of a ``world``-rank group carries (16-byte
    multiples: payload rows stay aligned)."""
    return min(ENVELOPE_ROOM_MAX, ENVELOPE_TOTAL_MAX // max(world, 1)) // 16 * 16


class Envelope:
    """A group's agreed call history and the room it predicts for the next call.

    ``agreed(key, body)`` records a call that passed the descriptor check (``key``: its
    descriptor without the call index; ``body``: what it carries to each peer when it
    rides, 0 when it never does). :meth:`room` is the predicted next call's body, or 0.
    The period is checked call by call at no cost while it holds; when a call breaks it,
    the smallest period whose last repetition matches the history is looked for among the
    distances back to earlier calls of the same key (a slice compare each), within a
    budget of compares the agreed calls earn (:data:`SEARCH_CREDIT`)."""

    def __init__(self) -> None:
        self.keys: list[bytes] = []  # the agreed calls' keys, the last ones
        self.start = 0  # the call number of keys[0]
        self.seen: dict[bytes, list[int]] = {}  # key -> its calls' numbers, the last ones
        self.bodies: dict[bytes, int] = {}
        self.period = 0  # 0: no period confirmed
        self.credit = SEARCH_CREDIT_MAX  # window compares the period search may spend

    def room(self) -> int:
        if not self.period:
            return 0
        return self.bodies[self.keys[-self.period]]

    def agreed(self, key: bytes, body: int) -> None:
        keys, p = self.keys, self.period
        keys.append(key)
        self.bodies[key] = body
        self.credit = min(self.credit + SEARCH_CREDIT, SEARCH_CREDIT_MAX)
        if not (p and len(keys) > p and keys[-1 - p] == key):
            self.period = self._find_period(key)
        now = self.start + len(keys) - 1
        seen = self.seen.setdefault(key, [])
        seen.append(now)
        if len(seen) > 2 * MAX_PERIOD:
            del seen[:-MAX_PERIOD]
        if len(keys) > 4 * MAX_PERIOD:  # keep the last 2 periods' worth
            drop = len(keys) - 2 * MAX_PERIOD
            del keys[:drop]
            self.start += drop
            self.seen = {k: [c for c in v if c >= self.start] for k, v in self.seen.items()}
            self.seen = {k: v for k, v in self.seen.items() if v}
            self.bodies = {k: v for k, v in self.bodies.items() if k in self.seen
                           or k == key}

    def _find_period(self, key: bytes) -> int:
        """The smallest p (a distance back to an earlier call of ``key``) whose last
        :func:`window` calls repeat the ones p before them; 0 if none, or none among
        the candidates the search credit pays for (smallest first)."""
        keys = self.keys
        now = self.start + len(keys) - 1
        for call in reversed(self.seen.get(key, ())):
            p = now - call
            v = window(p)
            if p > MAX_PERIOD or p + v > len(keys) or self.credit <= 0:
                break
            self.credit -= 1
            # the call before first: most candidates of a sequence without a period
            # fail there, at the cost of one compare, not two slices
            if keys[-2] == keys[-2 - p] and keys[-v:] == keys[-p - v:-p]:
                return p
        return 0


def window(period: int) -> int:
    """Calls that must repeat for a period to count: at least 8 (a period of 1 needs 8
    equal calls in a row, so 4 identical FSDP blocks do not pass for one), one full
    repetition up to 32, and 32 for longer periods (a step of 300 calls that an eval
    step interrupted is found again within 32 calls, not two steps)."""
    return min(max(period, 8), 32)


class Exchange:
    """One envelope exchange: the descriptor to every peer, and (when the call rides)
    a payload per peer after it.

    ``history``: the group's agreed calls, which give the room; ``state`` lends its
    buffers and counters. ``body``: the bytes of payload for each peer the call would
    carry (0: it never rides). Where it fits the agreed room (:attr:`rides`), the caller writes its
    payloads into :meth:`payloads` and calls :meth:`start`; otherwise the exchange
    starts at once, before the codec runs. :meth:`wait` waits; then :meth:`descriptors`
    are every rank's and :meth:`received` the riding payloads."""

    def __init__(self, inner, state, history: Envelope, kind: str, desc: bytes,
                 device: torch.device, body: int) -> None:
        self.kind, self.desc, self.state, self.history = kind, desc, state, history
        self.inner, self.rank, self.world = inner, inner.rank(), inner.size()
        self.body = body
        self.cap = envelope_cap(self.world)
        room = history.room()
        room = room if room <= self.cap else 0
        self.size = DESC_NBYTES + room
        self.rides = 0 < body <= room
        send = state.buffers.get("env_send", self.world * self.size, torch.uint8, device)
        self.send = send.view(self.world, self.size)
        self.send[:, :DESC_NBYTES].copy_(
            torch.frombuffer(bytearray(desc), dtype=torch.uint8).expand(self.world, -1))
        # zeros where no payload goes: no bytes of an earlier call on the wire (a riding
        # call's payloads fill the body: only the room past it, 0 bytes when predicted)
        self.send[:, DESC_NBYTES + (body if self.rides else 0):].zero_()
        recv = state.buffers.get("env_recv", self.world * self.size, torch.uint8, device)
        self.recv = recv.view(self.world, self.size)
        self.work = None
        if not self.rides:
            self.start()

    def payloads(self) -> torch.Tensor:
        """[world, body] rows: row j is what rank j gets (this rank's own row stays
        local; an all-gather writes row 0 and :meth:`start` copies it to the others)."""
        return self.send[:, DESC_NBYTES:DESC_NBYTES + self.body]

    def start(self, *, same_for_all: bool = False) -> None:
        """Send the envelope (``same_for_all``: row 0's payload goes to every peer)."""
        if same_for_all and self.world > 1:
            rows = self.payloads()
            rows[1:].copy_(rows[0].expand(self.world - 1, -1))
        self.work = I.start(I.all_to_all, self.kind, "the descriptor exchange", self.rank,
                            self.inner, self.recv.view(-1), self.send.view(-1))
        control = self.size - (self.body if self.rides else 0)
        self.state.record_control(self.kind, (self.world - 1) * control)

    def wait(self) -> list[bytes]:
        """Wait for the exchange; every rank's descriptor, in rank order."""
        if self.work is None:
            raise RuntimeError("qcomm: a riding envelope was waited for before it was sent")
        I.wait(self.work, self.kind, "the descriptor exchange", self.rank)
        got = self.recv[:, :DESC_NBYTES].cpu().contiguous().numpy().tobytes()
        return [got[r * DESC_NBYTES:(r + 1) * DESC_NBYTES] for r in range(self.world)]

    def refused(self) -> None:
        """The call was refused: the payloads that rode in its envelope were handed to
        the inner group all the same, and count as control bytes (:meth:`start` counted
        the rest of the envelope)."""
        if self.rides:
            self.state.record_control(self.kind, (self.world - 1) * self.body)

    def agreed(self) -> None:
        """Record this call in the group's history (every rank saw the same
        descriptors)."""
        self.history.agreed(self.desc[:KEY_NBYTES], self.body if self.body <= self.cap else 0)

    def received(self, offset: int, nbytes: int) -> torch.Tensor:
        """[world, nbytes] rows: bytes ``[offset, offset + nbytes)`` of the body each
        rank sent this one, in rank order (a strided view of the envelopes received)."""
        return self.recv[:, DESC_NBYTES + offset:DESC_NBYTES + offset + nbytes]

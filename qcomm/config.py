"""Frozen, validated configuration for the codec and the process group, and the one
place that reads the environment.

Every knob lives here: :func:`comm_config_from_env` maps the ``QCOMM_*`` variables of a
group onto a :class:`CommConfig` (a bad value fails at group creation naming the
variable), the codec's switches included (``QCOMM_COMPILE``: compiled or eager torch
path; ``QCOMM_TRITON_WARPS``: warps per kernel program), which the group's calls hand
to the codec explicitly (:func:`qcomm.codec.codec_options`). :func:`env_config` is the
environment's config read once per process, the default of direct codec calls that
name no path. :func:`triton_interpreted` says how Triton itself was started, not a
qcomm setting. No other module reads ``os.environ``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal, get_args

from . import layout
from .layout import KINDS  # here too: stats, auto and the docs read qcomm.config.KINDS

# For type checkers, which cannot read a Literal off the table: checked against it below.
Scheme = Literal["minmax", "maxnorm", "nuq"]
Norm = Literal["max", "l2"]
Rounding = Literal["stochastic", "nearest"]

# The scheme names, in qcomm.layout.SCHEMES' order (the table every path reads).
SCHEMES: tuple[str, ...] = tuple(s.name for s in layout.SCHEMES)
if get_args(Scheme) != SCHEMES:
    raise ValueError(f"qcomm.config.Scheme {get_args(Scheme)} differs from "
                     f"qcomm.layout.SCHEMES {SCHEMES}")
NORMS: tuple[str, ...] = ("max", "l2")
ROUNDINGS: tuple[str, ...] = ("stochastic", "nearest")
TOPOLOGIES: tuple[str, ...] = ("auto", "flat")
INTRA_NODE: tuple[str, ...] = ("exact", "compress")

# One Triton program quantizes one whole bucket out of registers, so the bucket is
# bounded: 32768 fp32 values are 128 KiB, the most that still compiles to a
# spill-free kernel at 8 warps (64 registers/thread for the values alone).
MAX_BUCKET_SIZE = 32768

# Warps per Triton program CommConfig.triton_warps may force (0: by bucket size).
WARPS = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class QuantConfig:
    """How one tensor is quantized onto the wire.

    Levels per scheme (``b`` = bits, ``s`` = the bucket's scale):

    - ``"minmax"``: ``2^b`` uniform levels from the bucket's min to its max (CGX).
    - ``"maxnorm"``: ``2^b - 1`` uniform levels symmetric about 0 in ``[-s, s]``
      (QSGDinf; ``s`` = max ``|x|`` or the L2 norm); 1 bit is ``{-s, +s}``.
    - ``"nuq"``: a sign bit and ``2^(b-1)`` exponentially spaced magnitudes
      ``0, 2^-(M-1), ..., 1/2, 1`` times ``s``, ``M = 2^(b-1) - 1`` (NUQSGD);
      1 bit leaves no level bits and is ``{-s, +s}`` like ``"maxnorm"``.
    """

    bits: int = 8
    # 1024 elements per scale: at 8 bits the fp32 scale adds 4 B per 1 KiB of codes
    # (0.4%), and it is CGX's and the NUQSGD code's default; smaller buckets track
    # outliers better but the metadata grows (128 elements: 3% at 8 bits, 6% at 4).
    bucket_size: int = 1024
    scheme: Scheme = "minmax"
    # Scale of "maxnorm" and "nuq": the bucket's max |x| (what works in practice,
    # QSGDinf) or its L2 norm (the papers' theory). Ignored by "minmax".
    norm: Norm = "max"
    # "stochastic" is unbiased (E[Q(x)] = x); "nearest" has the lowest error per call.
    rounding: Rounding = "stochastic"
    # Base of the counter-based RNG; quantize(seed=...) overrides it per call.
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int):
            raise TypeError(f"QuantConfig.bits must be an int, got {self.bits!r}")
        if not 1 <= self.bits <= 8:
            raise ValueError(f"QuantConfig.bits must be in 1..8, got {self.bits}")
        if isinstance(self.bucket_size, bool) or not isinstance(self.bucket_size, int):
            raise TypeError(f"QuantConfig.bucket_size must be an int, got {self.bucket_size!r}")
        if not 8 <= self.bucket_size <= MAX_BUCKET_SIZE or self.bucket_size % 8:
            raise ValueError(
                "QuantConfig.bucket_size must be a multiple of 8 in "
                f"8..{MAX_BUCKET_SIZE} (so each bucket's codes fill whole bytes), "
                f"got {self.bucket_size}"
            )
        if self.scheme not in SCHEMES:
            raise ValueError(f"QuantConfig.scheme must be one of {SCHEMES}, got {self.scheme!r}")
        if self.norm not in NORMS:
            raise ValueError(f"QuantConfig.norm must be one of {NORMS}, got {self.norm!r}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(
                f"QuantConfig.rounding must be one of {ROUNDINGS}, got {self.rounding!r}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"QuantConfig.seed must be an int, got {self.seed!r}")

    def replace(self, **changes) -> QuantConfig:
        return replace(self, **changes)


@dataclass(frozen=True)
class CommConfig:
    """What a qcomm process group compresses, and how.

    ``None`` for a collective sends it exact (uncompressed through the inner group).
    Defaults follow QSDP: 8-bit weights (all-gather) and gradients (reduce-scatter,
    all-reduce), bucket 1024, stochastic rounding.
    """

    all_gather: QuantConfig | None = field(default_factory=QuantConfig)
    reduce_scatter: QuantConfig | None = field(default_factory=QuantConfig)
    all_reduce: QuantConfig | None = field(default_factory=QuantConfig)
    # Tensors (per rank's contribution) below this many elements go exact: their
    # payload would be dominated by latency and metadata. 1024 as CGX's minimal size.
    min_numel: int = 1024
    # Base seed for the per-call seeds (advanced identically on every rank).
    seed: int = 0
    # Inner backend name ("gloo", "nccl"); None picks by device at init.
    inner: str | None = None
    # "auto": groups inside one node send exact, groups spanning nodes with several
    # ranks per node run two-level collectives (exact inside each node, compressed
    # across); "flat": every member treated alike (one level, compressed).
    topology: str = "auto"
    # Under "auto", what a group whose members share one node does: "exact" (its links
    # are NVLink or shared memory: compression only costs kernel time and accuracy)
    # or "compress" anyway.
    intra_node: str = "exact"
    # Whether an async_op=True compressed call returns at once (True: it runs on the
    # group's worker thread on CPU, its stream on CUDA) or completes first (False).
    asynchronous: bool = True
    # The codec's data path on CPU: True compiles the torch path (torch.compile, ~10-25 s
    # at the first call of each signature), False runs it eagerly (slower per call), None
    # as the process's QCOMM_COMPILE says (read once; unset: compiled), so a config
    # built in code still honours the variable. The same bytes either way; CUDA tensors
    # take the Triton kernels regardless.
    compile: bool | None = None
    # Warps per Triton program: 0 picks by bucket size (qcomm.kernels.common.num_warps),
    # else one of WARPS (bench/device_check.sh compares settings). The same bytes.
    triton_warps: int = 0
    # The kinds whose calls are sent exact or compressed (in their QuantConfig) by what
    # the group's measured costs predict faster (qcomm.auto; QCOMM_BITS=auto): a tuple
    # of KINDS, or True for every kind, False for none.
    auto: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.auto is True or self.auto is False:
            object.__setattr__(self, "auto", KINDS if self.auto else ())
        if (not isinstance(self.auto, (tuple, list, frozenset, set))
                or any(k not in KINDS for k in self.auto)):
            raise ValueError(f"CommConfig.auto must be True, False or a tuple of {KINDS}, "
                             f"got {self.auto!r}")
        object.__setattr__(self, "auto", tuple(k for k in KINDS if k in self.auto))
        for name in KINDS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, QuantConfig):
                raise TypeError(
                    f"CommConfig.{name} must be a QuantConfig or None, got {value!r}"
                )
        if isinstance(self.min_numel, bool) or not isinstance(self.min_numel, int):
            raise TypeError(f"CommConfig.min_numel must be an int, got {self.min_numel!r}")
        if self.min_numel < 0:
            raise ValueError(f"CommConfig.min_numel must be >= 0, got {self.min_numel}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"CommConfig.seed must be an int, got {self.seed!r}")
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"CommConfig.topology must be one of {TOPOLOGIES}, "
                             f"got {self.topology!r}")
        if self.intra_node not in INTRA_NODE:
            raise ValueError(f"CommConfig.intra_node must be one of {INTRA_NODE}, "
                             f"got {self.intra_node!r}")
        if not isinstance(self.asynchronous, bool):
            raise TypeError(f"CommConfig.asynchronous must be a bool, got {self.asynchronous!r}")
        if self.inner is not None and not isinstance(self.inner, str):
            raise TypeError(f"CommConfig.inner must be a backend name or None, got {self.inner!r}")
        if self.compile is not None and not isinstance(self.compile, bool):
            raise TypeError(f"CommConfig.compile must be a bool or None, got {self.compile!r}")
        if isinstance(self.triton_warps, bool) or not isinstance(self.triton_warps, int):
            raise TypeError(f"CommConfig.triton_warps must be an int, got {self.triton_warps!r}")
        if self.triton_warps and self.triton_warps not in WARPS:
            raise ValueError(f"CommConfig.triton_warps must be 0 (by bucket size) or one of "
                             f"{WARPS}, got {self.triton_warps}")

    def replace(self, **changes) -> CommConfig:
        return replace(self, **changes)

    def shared(self) -> CommConfig:
        """What every rank of a group must hold alike: all but ``compile`` and
        ``triton_warps``, which choose how this rank computes the same bytes (a CPU rank
        and a GPU rank, or two GPU kinds tuned apart, may differ in them)."""
        return replace(self, compile=None, triton_warps=0)

    def compiles(self) -> bool:
        """Whether this config's CPU codec runs compiled: ``compile``, or where it is None
        the process's ``QCOMM_COMPILE`` (:func:`env_config`; unset: compiled)."""
        if self.compile is not None:
            return self.compile
        return env_config().compile is not False


def as_comm_config(config, fn: str) -> CommConfig | None:
    """A group's config as a public entry point takes it (``fn`` names the entry point
    in the error): a :class:`CommConfig` as it is; a :class:`QuantConfig` for every
    collective (all-gather, reduce-scatter, all-reduce), the rest from ``QCOMM_*``;
    None stays None (the ``QCOMM_*`` environment's, read where the group is made)."""
    if config is None or isinstance(config, CommConfig):
        return config
    if isinstance(config, QuantConfig):
        return comm_config_from_env().replace(all_gather=config, reduce_scatter=config,
                                              all_reduce=config)
    raise TypeError(f"{fn}: config must be a qcomm.CommConfig, a qcomm.QuantConfig (every "
                    f"collective) or None (QCOMM_*), got {config!r}")


# The environment's prefix of each kind's variables (QCOMM_AG_BITS, ...), in KINDS' order.
PREFIXES: tuple[str, ...] = ("AG", "RS", "AR")

# (variable suffix, QuantConfig field) of the codec settings the environment can set.
_CODEC_VARS = (("BUCKET", "bucket_size"), ("SCHEME", "scheme"), ("NORM", "norm"),
               ("ROUNDING", "rounding"))


def _parse_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw.strip(), 0)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


AUTO = "auto"


def _parse_bits(env: Mapping[str, str], name: str, default):
    """``name``'s bits: 1..8, None (``off``), :data:`AUTO`, or ``default`` if unset."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    if raw.strip().lower() in ("off", "none", "0", "exact"):
        return None
    if raw.strip().lower() == AUTO:
        return AUTO
    try:
        bits = int(raw.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected 1..8, 'off' or 'auto'") from None
    if not 1 <= bits <= 8:
        raise ValueError(f"{name}={raw!r}: expected 1..8, 'off' or 'auto'")
    return bits


def comm_config_from_env(
    env: Mapping[str, str] | None = None, base: CommConfig | None = None
) -> CommConfig:
    """Map ``QCOMM_*`` environment variables onto a :class:`CommConfig`.

    ``QCOMM_BITS`` (1-8, ``off`` or ``auto``, all three collectives), ``QCOMM_AG_BITS``,
    ``QCOMM_RS_BITS``, ``QCOMM_AR_BITS`` (one collective's, over ``QCOMM_BITS``;
    ``auto``: :attr:`CommConfig.auto` for it, in the bits ``QCOMM_BITS`` names if it is
    a number, else the base config's, else 8),
    ``QCOMM_BUCKET``, ``QCOMM_SCHEME``, ``QCOMM_NORM``, ``QCOMM_ROUNDING``,
    ``QCOMM_MIN_NUMEL``, ``QCOMM_SEED``, ``QCOMM_INNER``, ``QCOMM_TOPOLOGY``
    (``auto``/``flat``), ``QCOMM_INTRA_NODE`` (``exact``/``compress``), ``QCOMM_ASYNC``
    (``0``/``1``), ``QCOMM_COMPILE`` (``0``/``1``), ``QCOMM_TRITON_WARPS`` (``0`` or one
    of :data:`WARPS`); ``QCOMM_AG_BUCKET``,
    ``QCOMM_RS_SCHEME``, ... (``AG``/``RS``/``AR`` x ``BUCKET``/``SCHEME``/``NORM``/
    ``ROUNDING``) set one collective and win over the common one. Unset variables keep
    ``base`` (default: :class:`CommConfig()`). A bad value raises ``ValueError``
    naming the variable.
    """
    env = os.environ if env is None else env
    _warn_unknown(env)
    base = CommConfig() if base is None else base
    template = next(
        (q for q in (base.all_gather, base.reduce_scatter, base.all_reduce) if q is not None),
        QuantConfig(),
    )

    def settings(prefix: str) -> dict[str, tuple[str, object]]:
        """{field: (variable, value)}: QCOMM_<PREFIX>_<KEY> over QCOMM_<KEY>."""
        found = {}
        for key, field_ in _CODEC_VARS:
            for var in (f"QCOMM_{key}", f"QCOMM_{prefix}_{key}"):  # the specific one wins
                raw = env.get(var, "").strip()
                if raw:
                    value = _parse_int(env, var, 0) if field_ == "bucket_size" else raw.lower()
                    if field_ == "scheme":  # an unknown name is QuantConfig's to refuse
                        value = getattr(layout.SCHEME_BY_ENV.get(value), "name", value)
                    found[field_] = (var, value)
        return found

    auto = set(base.auto)

    def one(prefix: str, kind: str, current: QuantConfig | None) -> QuantConfig | None:
        var = f"QCOMM_{prefix}_BITS"
        common = _parse_bits(env, "QCOMM_BITS", None)
        bits = _parse_bits(env, var, _parse_bits(env, "QCOMM_BITS", ""))
        if bits == "":  # neither variable set: the base config's, auto or not
            bits = None if current is None else current.bits
        elif bits == AUTO:  # the bits a number would give: QCOMM_BITS's, else the base's
            auto.add(kind)
            bits = (common if isinstance(common, int) else
                    current.bits if current is not None else template.bits)
        else:
            auto.discard(kind)
        if bits is None:
            return None
        start = current if current is not None else template
        given = settings(prefix)
        try:
            return start.replace(bits=bits, **{k: v for k, (_, v) in given.items()})
        except (ValueError, TypeError) as err:
            names = ", ".join(f"{name}={value!r}" for name, value in given.values()) or var
            raise ValueError(f"bad qcomm environment ({names}): {err}") from None

    inner = env.get("QCOMM_INNER", "").strip() or base.inner
    choice = {}
    for var, field_, allowed in (("QCOMM_TOPOLOGY", "topology", TOPOLOGIES),
                                 ("QCOMM_INTRA_NODE", "intra_node", INTRA_NODE)):
        raw = env.get(var, "").strip().lower()
        if raw and raw not in allowed:
            raise ValueError(f"{var}={raw!r}: expected one of {allowed}")
        choice[field_] = raw or getattr(base, field_)
    for var, field_ in (("QCOMM_ASYNC", "asynchronous"), ("QCOMM_COMPILE", "compile")):
        raw = env.get(var, "").strip()
        if raw not in ("", "0", "1"):
            raise ValueError(f"{var}={raw!r}: expected 0 or 1")
        choice[field_] = getattr(base, field_) if not raw else raw == "1"
    warps = _parse_int(env, "QCOMM_TRITON_WARPS", base.triton_warps)
    if warps and warps not in WARPS:
        raise ValueError(f"QCOMM_TRITON_WARPS={env['QCOMM_TRITON_WARPS']!r}: expected 0 "
                         f"(by bucket size) or one of {WARPS}")
    per_kind = {kind: one(prefix, kind, getattr(base, kind))
                for prefix, kind in zip(PREFIXES, KINDS, strict=True)}
    return CommConfig(
        **choice,
        **per_kind,
        triton_warps=warps,
        min_numel=_parse_int(env, "QCOMM_MIN_NUMEL", base.min_numel),
        seed=_parse_int(env, "QCOMM_SEED", base.seed),
        inner=inner,
        auto=tuple(auto),
    )


def comm_config_or_error(env: Mapping[str, str] | None = None) -> tuple[CommConfig, str | None]:
    """(:func:`comm_config_from_env`, None), or (the default config, why the environment
    gives none): a group's members agree on their configs, and a rank that cannot read
    its own posts the reason in its place, so that every rank names it at once
    (:mod:`qcomm.handshake`) rather than waiting out a timeout for this one."""
    try:
        return comm_config_from_env(env), None
    except ValueError as err:
        return CommConfig(), str(err)


# Every variable comm_config_from_env reads, the source of the keys env_from_keys takes.
VARIABLES: tuple[str, ...] = (
    "QCOMM_BITS", "QCOMM_BUCKET", "QCOMM_SCHEME", "QCOMM_NORM", "QCOMM_ROUNDING",
    *(f"QCOMM_{p}_{k}" for p in PREFIXES
      for k in ("BITS", "BUCKET", "SCHEME", "NORM", "ROUNDING")),
    "QCOMM_MIN_NUMEL", "QCOMM_SEED", "QCOMM_INNER", "QCOMM_TOPOLOGY", "QCOMM_INTRA_NODE",
    "QCOMM_ASYNC", "QCOMM_COMPILE", "QCOMM_TRITON_WARPS",
)


# QCOMM_* variables qcomm reads elsewhere than its config: this process's node
# (node_key), and those of its own benchmarks and test harness (bench/, tests/).
OTHER_VARIABLES: tuple[str, ...] = ("QCOMM_NODE", "QCOMM_BENCH_CPUS", "QCOMM_SUITE_AS_GLOO",
                                    "QCOMM_TEST_PARENT")
OTHER_PREFIXES: tuple[str, ...] = ("QCOMM_CHECK_",)  # bench/device_check.sh's settings
_warned: set = set()


def _warn_unknown(env: Mapping[str, str]) -> None:
    """Warn once a process for each ``QCOMM_*`` variable qcomm does not read (a typo
    would otherwise be ignored without a word), naming the closest one it does."""
    import difflib
    import warnings

    for name in env:
        if (not name.startswith("QCOMM_") or name in _warned or name in VARIABLES
                or name in OTHER_VARIABLES or name.startswith(OTHER_PREFIXES)):
            continue
        _warned.add(name)
        close = difflib.get_close_matches(name, VARIABLES + OTHER_VARIABLES, n=1, cutoff=0.6)
        warnings.warn(f"{name} is not a qcomm variable and is ignored" + (
            f": did you mean {close[0]}?" if close else
            " (qcomm.config.VARIABLES lists those it reads)"), UserWarning, stacklevel=3)


def env_from_keys(text: str) -> dict[str, str]:
    """A config written as keys, ``"bits=4,scheme=nuq,ag_rounding=nearest"``, as the
    ``QCOMM_*`` variables it stands for (key = the variable's name after ``QCOMM_``,
    any case); ``"exact"`` is ``bits=off``. The benchmarks take their variants in this
    form, so a variant is spelled as the environment that configures a real job.
    Raises ``ValueError`` naming an unknown key or a bad value."""
    if text.strip() == "exact":
        return {"QCOMM_BITS": "off"}
    env = {}
    for item in (t.strip() for t in text.split(",")):
        key, sep, value = item.partition("=")
        var = "QCOMM_" + key.strip().upper()
        if not sep or not value.strip() or var not in VARIABLES:
            keys = ", ".join(v[len("QCOMM_"):].lower() for v in VARIABLES)
            raise ValueError(f"bad config {text!r}: {item!r} is not KEY=VALUE with KEY one of "
                             f"{keys} (or the whole config 'exact')")
        env[var] = value.strip()
    comm_config_from_env(env)  # a bad value raises here, naming its variable
    return env


@functools.cache
def env_config() -> CommConfig:
    """The environment's :class:`CommConfig`, read once per process (at its first use;
    a bad ``QCOMM_*`` value raises then, naming the variable): what a direct codec call
    that names no path (``impl=None``) runs on CPU, compiled or eager
    (``QCOMM_COMPILE``), so a process started with ``QCOMM_COMPILE=0`` (the test
    workers, the demo) runs the codec eagerly without a group. Groups read their own
    config at creation and pass it explicitly."""
    return comm_config_from_env()


# ---------------------------------------------------------------------------------
# How Triton was started (not a qcomm setting)


def triton_interpreted(env: Mapping[str, str] | None = None) -> bool:
    """Whether Triton runs its interpreter (``TRITON_INTERPRET=1``, set before triton is
    imported): the kernels then run on CPU tensors, how CI tests them."""
    env = os.environ if env is None else env
    return env.get("TRITON_INTERPRET", "").strip() == "1"


def node_key(env: Mapping[str, str] | None = None) -> str:
    """This process's node, as the members of a group compare it: ``QCOMM_NODE`` if
    set, else the hostname, with torchrun's node rank (``GROUP_RANK``) where torchrun
    set it (several torchrun agents on one host are several nodes)."""
    import socket

    env = os.environ if env is None else env
    override = env.get("QCOMM_NODE", "").strip()
    if override:
        return override
    host = socket.gethostname()
    group_rank = env.get("GROUP_RANK", "").strip()
    return f"{host}/{group_rank}" if group_rank else host

"""Ranks as separate processes, on loopback or as two "hosts" behind a shaped link.

:class:`ShapedLink` builds two network namespaces joined by a veth pair, each end
shaped by ``tc tbf`` to the rate::

    netns qcb<pid>a                          netns qcb<pid>b
    [ranks 0 .. w/2-1] qva 198.18.0.1/24 <-veth+tbf RATE each way-> qvb 198.18.0.2/24 [ranks w/2 ..]

Nodes: every rank is told its node (``QCOMM_NODE=node<i>``, and torchrun's
``GROUP_RANK=<i>``), so that qcomm's topology sees what the harness built.
Without a layout (:func:`node_layout`) each rank on loopback is a node of its own and,
behind a link, each namespace is one node (its ranks as above). With ``--nodes 2
--ranks-per-node P`` the ``2 P`` ranks are two nodes of P: a node is one namespace with
its own hostname (``unshare --uts``), the ranks of a node talk to each other over the
node's own address (delivered locally, never through the veth's ``tbf``) and to the
other node over the shaped veth. Only two namespaces are built, so a link takes two
nodes; on loopback any number of nodes can be simulated (node ids only, no shaping).

Addresses come from 198.18.0.0/15 (RFC 2544, benchmarking) and only these two
namespaces' own addresses are ever a target; the namespaces have no route out. Both
namespaces are deleted on exit, on an error, on Ctrl-C and on SIGTERM/SIGHUP (which
this module turns into an exception while a link is up), and once more at interpreter
exit in case the process was torn down another way.

:func:`run_ranks` starts the ranks itself (no torchrun needed), bounded by a timeout:
on expiry, or as soon as one rank fails, every rank's process group is killed.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

_RATE = re.compile(r"(\d+(?:\.\d+)?)([kmg]?)(bit|bps)", re.IGNORECASE)
_UNIT = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
# tc tbf bucket: 2 ms of the rate, at least 64 KiB (one veth GSO packet). A 1 MB
# bucket let a whole 0.5 MB payload through unshaped at 100 Mbit/s (an all-gather 10x
# faster than exact at 4x fewer bytes); 2 ms of rate keeps that error under 2% for
# messages >= 16 MiB.
TBF_BURST_S = 0.002
TBF_MIN_BURST = 64 << 10
# Queue before drops. Both directions carry data at once, so each side's ACKs wait
# behind that queue: measured here (8 MiB/rank gloo all-gather, 2 ranks) 100 Mbit/s gave
# 63 Mbit/s at 5 ms, 91 at 20 ms, 71 at 100 ms; 1 Gbit/s ~730 at each
# (CPU-bound on 2 cores).
TBF_LATENCY = "20ms"
ADDRS = ("198.18.0.1", "198.18.0.2")


class LinkError(RuntimeError):
    """The shaped link could not be set up (not root, no iproute2, ...)."""


def parse_rate(text: str | None) -> tuple[str, int] | None:
    """``"1gbit"`` -> ``("1gbit", 10**9)``; ``None``/``"loopback"``/``"none"`` -> None."""
    if text is None or text.strip().lower() in ("", "loopback", "lo", "none"):
        return None
    m = _RATE.fullmatch(text.strip())
    if not m:
        raise ValueError(f"bad link rate {text!r}: use e.g. 100mbit, 1gbit, 2.5gbit or loopback")
    bits = float(m[1]) * _UNIT[m[2].lower()] * (8 if m[3].lower() == "bps" else 1)
    if not 10**5 <= bits <= 10**11:
        raise ValueError(f"link rate {text!r} out of range 100kbit..100gbit")
    return text.strip().lower(), int(bits)


@dataclass(frozen=True)
class Host:
    netns: str | None  # namespace name; None is the machine itself (loopback)
    ifname: str  # the interface gloo binds (GLOO_SOCKET_IFNAME)
    addr: str  # this host's address
    hostname: str | None = None  # set in a UTS namespace of the rank's own (needs root)

    def wrap(self, argv: list[str]) -> list[str]:
        if self.netns is None:
            return argv
        if self.hostname and shutil.which("unshare") and shutil.which("hostname"):
            argv = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                    self.hostname, *argv]
        return ["ip", "netns", "exec", self.netns, *argv]


LOOPBACK = Host(None, "lo", "127.0.0.1")


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode:
        raise LinkError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")


def _tc(netns: str, *args: str) -> None:
    proc = subprocess.run(["ip", "netns", "exec", netns, "tc", *args],
                          capture_output=True, text=True, timeout=30)
    if proc.returncode:
        raise LinkError(f"`tc {' '.join(args)}` in {netns} failed: {proc.stderr.strip()}")


def _netns_exists(name: str) -> bool:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return any(line.split()[0] == name for line in out.stdout.splitlines() if line.strip())


def _raise_signal(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def link_shaping(rate: str, nodes: list[int]) -> dict:
    """What a :class:`ShapedLink` of ``rate`` (or :data:`UNSHAPED`) sets up (for the run
    header); ``nodes``: each rank's node (namespace a is node 0)."""
    ranks = {"ab"[n]: [r for r, m in enumerate(nodes) if m == n] for n in sorted(set(nodes))}
    if rate == UNSHAPED:
        return {"rate_bit_s": None, "qdisc": None, "addresses": list(ADDRS), "ranks": ranks}
    _, bits = parse_rate(rate)
    return {"rate_bit_s": bits, "qdisc": "tbf", "burst_bytes": _burst(bits),
            "latency": TBF_LATENCY, "addresses": list(ADDRS), "ranks": ranks}


def _burst(bits_per_s: int) -> int:
    return max(TBF_MIN_BURST, int(bits_per_s / 8 * TBF_BURST_S))


UNSHAPED = "unshaped"  # two hosts with no tc shaping: what counting bytes needs


def parse_link(text: str) -> str | None:
    """``--link``: :data:`UNSHAPED` or a rate (:func:`parse_rate`, its canonical text);
    None: loopback. ValueError naming a bad one."""
    if text.strip().lower() == UNSHAPED:
        return UNSHAPED
    try:
        parsed = parse_rate(text)
    except ValueError as err:
        raise ValueError(f"{err}, or {UNSHAPED}") from None
    return parsed and parsed[0]


class ShapedLink:
    """Two namespaces joined by a veth pair shaped to ``rate`` each way (a context
    manager); ``rate`` :data:`UNSHAPED`: the same hosts, the link at the veth's speed."""

    def __init__(self, rate: str):
        if rate == UNSHAPED:
            self.rate = self.burst_bytes = None
        else:
            parsed = parse_rate(rate)
            if parsed is None:
                raise ValueError("ShapedLink needs a rate; run on loopback without one")
            self.rate, self.burst_bytes = parsed[0], _burst(parsed[1])
        tag = f"qcb{os.getpid()}"
        self.hosts = (Host(f"{tag}a", "qva", ADDRS[0], f"{tag}a"),
                      Host(f"{tag}b", "qvb", ADDRS[1], f"{tag}b"))
        self._old_handlers: dict = {}

    def __enter__(self) -> ShapedLink:
        if os.geteuid() != 0:
            raise LinkError("--link needs root (network namespaces and tc); run as root, or "
                            "drop --link to run the ranks on loopback")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise LinkError(f"--link needs `{tool}` (iproute2), not found on PATH")
        for host in self.hosts:
            if _netns_exists(host.netns):
                raise LinkError(f"network namespace {host.netns} already exists")
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, _raise_signal)
        atexit.register(self.teardown)
        try:
            self._setup()
        except BaseException:
            self.teardown()
            raise
        return self

    def _setup(self) -> None:
        a, b = self.hosts
        _ip("netns", "add", a.netns)
        _ip("netns", "add", b.netns)
        _ip("link", "add", a.ifname, "netns", a.netns, "type", "veth",
            "peer", "name", b.ifname, "netns", b.netns)
        for host in self.hosts:
            _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", host.ifname)
            _ip("-n", host.netns, "link", "set", host.ifname, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
            if self.rate is None:
                continue
            _tc(host.netns, "qdisc", "add", "dev", host.ifname, "root", "tbf",
                "rate", self.rate, "burst", str(self.burst_bytes), "latency", TBF_LATENCY)

    def teardown(self) -> None:
        """Delete both namespaces (and with them the veth pair); safe to call twice."""
        for host in self.hosts:
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True, timeout=30)
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()
        atexit.unregister(self.teardown)

    def __exit__(self, *exc) -> None:
        self.teardown()


def default_nodes(world: int, linked: bool) -> list[int]:
    """Each rank's node without ``--nodes``: behind a link the first half of the ranks
    on node 0 (host a), the rest on node 1; else each rank a node of its own (one-level
    qcomm groups: what the benchmarks measured before qcomm knew of nodes)."""
    if not linked:
        return list(range(world))
    return [0 if rank < (world + 1) // 2 else 1 for rank in range(world)]


RANK_ORDERS = ("node-major", "round-robin")


def node_layout(nodes: int | None, ranks_per_node: int | None, world: int | None,
                order: str = "node-major", *, link: bool = False) -> list[int] | None:
    """Each rank's node for ``--nodes N --ranks-per-node P`` (world ``N P``):
    node-major (ranks ``i P .. i P + P - 1`` on node i, torchrun's order) or round-robin
    (rank r on node ``r % N``); None without ``--nodes`` (the caller's default layout).
    ValueError on a layout this harness cannot build."""
    if nodes is None:
        if ranks_per_node is not None:
            raise ValueError("--ranks-per-node needs --nodes")
        if order != "node-major":
            raise ValueError("--rank-order needs --nodes")
        return None
    per = 1 if ranks_per_node is None else ranks_per_node
    if nodes < 1 or per < 1:
        raise ValueError(f"--nodes and --ranks-per-node must be >= 1, got {nodes} x {per}")
    if nodes * per < 2:
        raise ValueError("a layout needs at least 2 ranks")
    if link and nodes != 2:
        raise ValueError(f"--link joins two namespaces: --nodes must be 2 with a link rate, "
                         f"got {nodes} (on loopback any number of nodes works)")
    if world is not None and world != nodes * per:
        raise ValueError(f"--world {world} but --nodes {nodes} x --ranks-per-node {per} is "
                         f"{nodes * per}: drop --world")
    if order not in RANK_ORDERS:
        raise ValueError(f"--rank-order {order!r} not in {RANK_ORDERS}")
    if order == "node-major":
        return [r // per for r in range(nodes * per)]
    return [r % nodes for r in range(nodes * per)]


def layout_name(nodes: list[int] | None) -> str | None:
    """``"2x2"`` for two nodes of two ranks (``"2x2-rr"`` round-robin); None: no layout."""
    if nodes is None:
        return None
    count = len(set(nodes))
    name = f"{count}x{len(nodes) // count}"
    return name if nodes == sorted(nodes) else f"{name}-rr"


def add_layout_arguments(p) -> None:
    """``--nodes``, ``--ranks-per-node``, ``--rank-order`` (collectives and train)."""
    p.add_argument("--nodes", type=int, default=None,
                   help="simulate N nodes (node ids QCOMM_NODE per rank; with --link each node "
                        "a namespace: N must be 2); world = N x --ranks-per-node")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="ranks on each node (default 1; needs --nodes); the ranks of a node "
                        "talk over the node's own address, unshaped")
    p.add_argument("--rank-order", choices=RANK_ORDERS, default="node-major",
                   help="node-major: ranks 0..P-1 on node 0 (torchrun's order); round-robin: "
                        "rank r on node r %% N")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def run_ranks(argv: list[str], world: int, *, link: ShapedLink | None = None,
              nodes: list[int] | None = None, timeout_s: float = 1800,
              env: dict | None = None) -> None:
    """Run ``python <argv...>`` as ``world`` ranks (env RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT, GLOO_SOCKET_IFNAME, QCOMM_NODE, GROUP_RANK); raise on the first failing
    rank or at the timeout. ``nodes``: each rank's node (behind a link node i is host i);
    default one node per rank on loopback, the two halves behind a link.

    Rank 0's stderr (progress) goes to this process's stderr; the other ranks' output is
    kept in files and shown when a rank fails.
    """
    if nodes is None:
        nodes = default_nodes(world, link is not None)
    if len(nodes) != world:
        raise ValueError(f"{len(nodes)} node ids for {world} ranks")
    if link and not set(nodes) <= {0, 1}:
        raise ValueError(f"a link has two hosts (nodes 0 and 1), got nodes {sorted(set(nodes))}")
    master = link.hosts[nodes[0]] if link else LOOPBACK
    port = 29511 if link else free_port()  # a fresh namespace has every port free
    cpus = sorted(os.sched_getaffinity(0))
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="qcomm-bench-") as tmp:
        try:
            for rank in range(world):
                host = link.hosts[nodes[rank]] if link else LOOPBACK
                # Each rank its own slice of the cores, as on separate hosts (more ranks
                # than cores: neighbouring ranks share one).
                mine = (cpus[rank * len(cpus) // world:(rank + 1) * len(cpus) // world]
                        or [cpus[rank * len(cpus) // world]])
                # LOCAL_RANK stays the rank: the GPU index on this one machine.
                rank_env = dict(os.environ, **(env or {}), RANK=str(rank),
                                LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                                MASTER_ADDR=master.addr, MASTER_PORT=str(port),
                                GLOO_SOCKET_IFNAME=host.ifname,
                                QCOMM_NODE=f"node{nodes[rank]}",
                                GROUP_RANK=str(nodes[rank]),
                                QCOMM_BENCH_CPUS=",".join(map(str, mine)),
                                OMP_NUM_THREADS=str(len(mine)))
                if link:  # NCCL too over the shaped veth: sockets only, no shm/P2P/IB
                    rank_env.update(NCCL_SOCKET_IFNAME=host.ifname, NCCL_IB_DISABLE="1",
                                    NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1")
                log = Path(tmp) / f"rank{rank}.log"
                logs.append(log)
                # fd 2: rank 0's progress and prints go to this process's stderr.
                sink = 2 if rank == 0 else log.open("w")
                procs.append(subprocess.Popen(
                    host.wrap([sys.executable, *argv]), env=rank_env, cwd=os.getcwd(),
                    stdout=sink, stderr=sink, start_new_session=True))
            deadline = time.monotonic() + timeout_s
            while True:
                codes = [p.poll() for p in procs]
                failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    time.sleep(1)  # let the others print their side of the failure
                    r = failed[0]
                    raise RuntimeError(
                        f"rank {r} exited with {codes[r]}"
                        + "".join(f"\n--- rank {i} ---\n{_tail(logs[i])}"
                                  for i in range(1, world)))
                if all(c == 0 for c in codes):
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"ranks still running after {timeout_s:.0f} s (--timeout); killed"
                        + "".join(f"\n--- rank {i} ---\n{_tail(logs[i])}"
                                  for i in range(1, world)))
                time.sleep(0.2)
        finally:
            _kill(procs)


def run_spec(module: str, spec: dict, world: int, *, timeout_s: float,
             env: dict | None = None, link: ShapedLink | None = None,
             nodes: list[int] | None = None) -> list:
    """Run ``python -m module --worker SPEC`` as ``world`` ranks on loopback (or behind
    ``link``; ``nodes`` as :func:`run_ranks`), ``spec`` (a dict, JSON) handed over in a
    file with ``spec["result"]`` set, the repository on their path; returns each rank's
    result, what it gave :func:`worker_done`."""
    import json

    root = str(Path(__file__).resolve().parents[1])
    env = dict(env or {})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="qcomm-ranks-") as tmp:
        spec = {**spec, "result": str(Path(tmp) / "rank")}
        path = Path(tmp) / "spec.json"
        path.write_text(json.dumps(spec))
        run_ranks(["-m", module, "--worker", str(path)], world, link=link, nodes=nodes,
                  timeout_s=timeout_s, env=env)
        return [json.loads(Path(spec["result"] + str(r)).read_text()) for r in range(world)]


def worker_done(spec: dict, rank: int, result) -> None:
    """In a :func:`run_spec` rank: write ``result``, leave the process group and the
    process, without the interpreter's teardown: there a C++ thread of torch's still
    joinable at exit aborts a rank now and then ("terminate called without an active
    exception", exit -6), after everything has completed (bench collectives: about one
    2-rank --link run in six before; once in a clean-clone suite in a two-rank benchmark)."""
    import json

    import torch.distributed as dist

    Path(spec["result"] + str(rank)).write_text(json.dumps(result))
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def pin_this_rank() -> None:
    """In a rank: keep to the cores :func:`run_ranks` gave it (a host of its own)."""
    import torch

    cpus = os.environ.get("QCOMM_BENCH_CPUS")
    if cpus:
        mine = {int(c) for c in cpus.split(",")}
        os.sched_setaffinity(0, mine)
        torch.set_num_threads(len(mine))

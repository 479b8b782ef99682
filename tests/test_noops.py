"""Nothing does nothing silently: every way of installing qcomm that compresses nothing
says so once, in words that name the fix; a config handed to a hook applies whole."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from conftest import make, run_ranks

import qcomm


def _one_node_body(rank, world):
    """Both ranks on one node (the default topology sends exact inside a node): a new
    qcomm group, a wrap and a plain group's first call each warn once, naming
    QCOMM_INTRA_NODE=compress, and their calls go exact; with intra_node="compress"
    nothing warns and the calls compress."""
    import os

    said = {}

    def caught(fn) -> list[str]:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            group = fn()
            out = torch.empty(world * 4096)
            qcomm.all_gather_into_tensor(out, make(rank, 4096), group)
        s = qcomm.stats(group)["all_gather"]
        return [str(w.message) for w in got if issubclass(w.category, UserWarning)
                and "share one node" in str(w.message)], (s.calls_exact, s.calls_compressed)

    said["new_group"] = caught(lambda: dist.new_group(backend="qcomm"))
    said["wrap"] = caught(lambda: qcomm.wrap(dist.group.WORLD))
    said["plain"] = caught(lambda: dist.new_group(backend="gloo"))
    os.environ["QCOMM_INTRA_NODE"] = "compress"
    said["compress"] = caught(lambda: dist.new_group(backend="qcomm"))
    return said


def test_a_group_on_one_node_says_it_sends_everything_exact():
    env = {"QCOMM_NODE": "one-host"}
    for said in run_ranks(_one_node_body, 2, backend="gloo", env=env):
        for name in ("new_group", "wrap", "plain"):
            words, calls = said[name]
            assert calls == (1, 0), (name, calls)
            assert len(words) == 1 and "QCOMM_INTRA_NODE=compress" in words[0], (name, words)
            assert "'one-host'" in words[0], words
        assert said["compress"] == ([], (0, 1)), said["compress"]


def _fsdp_noops_body(rank, world):
    """``compress`` on FSDP2 over a 1-rank mesh dimension (the data-parallel one left at
    1) warns that nothing will be compressed; on a DDP model it names what it found and
    what to use instead."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from qcomm.fsdp import compress, quantize_weight_deltas

    said = {}
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("tp", "dp"))
    for fn in (compress, quantize_weight_deltas):
        model = fully_shard(torch.nn.Linear(64, 64), mesh=mesh["dp"])
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            fn(model)
        said[fn.__name__] = [str(w.message) for w in got if "1 rank" in str(w.message)]
    ddp = DistributedDataParallel(torch.nn.Linear(8, 8))
    with pytest.raises(ValueError) as info:
        compress(ddp)
    said["ddp"] = str(info.value)
    return said


def test_fsdp_hooks_say_when_they_compress_nothing():
    for said in run_ranks(_fsdp_noops_body, 2, backend="gloo"):
        for fn in ("compress", "quantize_weight_deltas"):
            assert len(said[fn]) == 1 and "nothing to compress" in said[fn][0], said
        assert "DistributedDataParallel is DDP" in said["ddp"], said["ddp"]
        assert "qcomm.ddp_comm_hook" in said["ddp"], said["ddp"]


def _ddp_config_body(rank, world):
    """DDP's hook given a CommConfig runs the default group on all of it: both ranks on
    one node, ``intra_node="compress"`` compresses every bucket (the environment's
    default, exact, would send them as they are); a hook given another config on the
    same group is refused, naming both."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(64, 64))
    config = qcomm.CommConfig(intra_node="compress")
    model.register_comm_hook(config, qcomm.ddp_comm_hook)
    for _ in range(3):
        model(torch.randn(8, 64)).sum().backward()
    s = qcomm.stats()["all_reduce"]
    other = DistributedDataParallel(torch.nn.Linear(64, 64))
    other.register_comm_hook(qcomm.CommConfig(intra_node="compress", min_numel=8),
                             qcomm.ddp_comm_hook)
    with pytest.raises(ValueError) as info:
        other(torch.randn(8, 64)).sum().backward()
    return {"calls": (s.calls_exact, s.calls_compressed), "refused": str(info.value)}


def test_ddp_hook_applies_a_comm_config_whole():
    env = {"QCOMM_NODE": "one-host"}
    for r in run_ranks(_ddp_config_body, 2, backend="gloo", env=env):
        assert r["calls"] == (0, 3), r
        assert "already runs" in r["refused"] and "min_numel=8" in r["refused"], r


def test_an_unknown_qcomm_variable_is_named_once(monkeypatch):
    import qcomm.config as config

    monkeypatch.setattr(config, "_warned", set())
    with pytest.warns(UserWarning, match="QCOMM_BTIS is not a qcomm variable.*QCOMM_BITS"):
        got = config.comm_config_from_env({"QCOMM_BTIS": "4"})
    assert got == qcomm.CommConfig()  # ignored, as the warning says
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once a process: no second warning
        config.comm_config_from_env({"QCOMM_BTIS": "4", "QCOMM_NODE": "a",
                                     "QCOMM_CHECK_ONLY": "x"})

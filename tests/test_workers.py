"""The kept worker processes of ``run_ranks`` (tests/conftest.py): a call sees what a
fresh process would, whatever the call before it changed."""

from __future__ import annotations

import os

from conftest import run_ranks

import qcomm


def _change_everything(rank, world):
    import qcomm.handshake as H
    import qcomm.pieces as P
    import qcomm.purpose as purpose

    P.PIECE = 7  # a module global
    H.Agreement.check_call = lambda *a, **k: None  # a class attribute
    H.NEW_NAME = 1  # an added global
    purpose._twins["a group"] = "its twin"  # a registry filled in place
    os.environ["QCOMM_BITS"] = "2"
    return os.getpid()


def _look(rank, world):
    import torch

    import qcomm.handshake as H
    import qcomm.pieces as P
    import qcomm.purpose as purpose

    return {"pid": os.getpid(), "piece": P.PIECE, "patched": H.Agreement.check_call.__name__,
            "added": hasattr(H, "NEW_NAME"), "twins": dict(purpose._twins),
            "bits": os.environ.get("QCOMM_BITS"), "parent": os.environ.get("QCOMM_TEST_PARENT"),
            "rng": torch.rand(1).item(), "config": qcomm.comm_config_from_env().all_gather}


def test_a_kept_worker_leaves_no_trace_of_the_call_before(monkeypatch):
    first = run_ranks(_look, 2)
    pids = run_ranks(_change_everything, 2)
    monkeypatch.setenv("QCOMM_TEST_PARENT", "now")  # the parent's environment at the call
    after = run_ranks(_look, 2)
    assert [a["pid"] for a in after] == pids  # the same processes, kept
    for a, b in zip(first, after, strict=True):
        assert a["piece"] == b["piece"] == qcomm.pieces.PIECE != 7
        assert b["patched"] == "check_call" and not b["added"] and b["twins"] == a["twins"]
        assert b["bits"] is None and b["parent"] == "now"
        assert b["rng"] == a["rng"] and b["config"] == a["config"]

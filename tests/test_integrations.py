"""qcomm in the trainers people run, for real: Lightning (DDP and FSDP2 through
``ModelParallelStrategy``) and Accelerate (DDP from ``prepare``, and FSDP2 sharded by
the user) each train 20 steps on 2 CPU processes through :mod:`qcomm.integrations`, the
two ranks on one host told ``intra_node="compress"``: compressed calls, the bytes cut,
and the loss within 1% of the same run without qcomm. Lightning launches its second
process itself; Accelerate's runs go through torchrun (``accelerate launch --cpu``
starts one process). torchtitan needs torch >= 2.14: docs/frameworks.md."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

LIGHTNING = """\
import json, sys, warnings
import torch
try:
    import lightning.pytorch as L
    from lightning.pytorch.strategies import ModelParallelStrategy
except ImportError:
    import pytorch_lightning as L
    from pytorch_lightning.strategies import ModelParallelStrategy
import qcomm
import qcomm.integrations.lightning as ql

mode, use, out = sys.argv[1], sys.argv[2] == "qcomm", sys.argv[3]


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(),
                                       torch.nn.Linear(128, 1))
        self.losses = []

    def configure_model(self):
        if mode == "fsdp2":
            from torch.distributed.fsdp import fully_shard
            mesh = self.device_mesh["data_parallel"]
            fully_shard(self.net[0], mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


g = torch.Generator().manual_seed(1)
x = torch.randn(640, 32, generator=g)
y = x[:, :1] * 2 - x[:, 1:2] + 0.1 * torch.randn(640, 1, generator=g)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
strategy = "ddp" if mode == "ddp" else ModelParallelStrategy(data_parallel_size=2,
                                                             tensor_parallel_size=1)
callback = ql.Compress(qcomm.CommConfig(intra_node="compress"))
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=20,
                    callbacks=[callback] if use else [], logger=False,
                    enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
model = Model()
trainer.fit(model, data)
if trainer.global_rank == 0:
    group = None if mode == "ddp" else model.device_mesh["data_parallel"].get_group()
    s = qcomm.stats(group) if use else {}
    installed = type(callback.installed).__name__ if use else None
    json.dump({"loss": sum(model.losses[-5:]) / 5, "installed": installed,
               "stats": {k: [v.calls_compressed, v.calls_exact, v.ratio]
                         for k, v in s.items()}}, open(out, "w"))
"""

ACCELERATE = """\
import json, sys
import torch
from accelerate import Accelerator
import qcomm
import qcomm.integrations.accelerate as qa

mode, use, out = sys.argv[1], sys.argv[2] == "qcomm", sys.argv[3]
accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
g = torch.Generator().manual_seed(1)
x = torch.randn(640, 32, generator=g)
y = x[:, :1] * 2 - x[:, 1:2] + 0.1 * torch.randn(640, 1, generator=g)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
config = qcomm.CommConfig(intra_node="compress")
if mode == "ddp":
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt, data = accelerator.prepare(model, opt, data)
else:  # sharded by the user: fully_shard, then prepare the rest
    from torch.distributed.fsdp import fully_shard
    fully_shard(model[0])
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt, data = accelerator.prepare(opt, data)
installed = qa.compress(accelerator, model, config) if use else None
losses = []
for step, (xb, yb) in enumerate(data):
    loss = torch.nn.functional.mse_loss(model(xb), yb)
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
    if step == 19:
        break
if accelerator.process_index == 0:
    s = qcomm.stats() if use else {}
    json.dump({"loss": sum(losses[-5:]) / 5, "type": type(model).__name__,
               "installed": type(installed).__name__,
               "stats": {k: [v.calls_compressed, v.calls_exact, v.ratio] for k, v in s.items()}},
              open(out, "w"))
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path, script: str, mode: str, use: str, torchrun: bool) -> dict:
    path = tmp_path / "train.py"
    path.write_text(script)
    out = tmp_path / f"{mode}-{use}.json"
    argv = [str(path), mode, use, str(out)]
    if torchrun:
        argv = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(_port())] + argv
    env = {**os.environ, "QCOMM_COMPILE": "0", "OMP_NUM_THREADS": "1"}
    env.pop("QCOMM_NODE", None)  # both ranks on this one host
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def _check(got: dict, plain: dict, installed: str, kinds: tuple) -> None:
    assert got["installed"] == installed, got
    for kind in kinds:
        compressed, exact, ratio = got["stats"][kind]
        assert compressed > 0 and ratio > 3.0, (kind, got)
    assert abs(got["loss"] - plain["loss"]) <= 0.01 * plain["loss"], (got, plain)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_lightning_trains_through_the_callback(tmp_path, mode):
    got = _run(tmp_path, LIGHTNING, mode, "qcomm", torchrun=False)
    plain = _run(tmp_path, LIGHTNING, mode, "plain", torchrun=False)
    kinds = ("all_reduce",) if mode == "ddp" else ("all_gather", "reduce_scatter")
    _check(got, plain, "str" if mode == "ddp" else "Compression", kinds)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_accelerate_trains_through_one_call(tmp_path, mode):
    got = _run(tmp_path, ACCELERATE, mode, "qcomm", torchrun=True)
    plain = _run(tmp_path, ACCELERATE, mode, "plain", torchrun=True)
    assert got["type"] == ("DistributedDataParallel" if mode == "ddp" else "FSDPSequential")
    kinds = ("all_reduce",) if mode == "ddp" else ("all_gather", "reduce_scatter")
    _check(got, plain, "str" if mode == "ddp" else "Compression", kinds)


def test_install_refuses_what_it_cannot_compress():
    """A plain module (no DDP, no FSDP2 unit) is refused, naming its type."""
    import torch

    from qcomm.integrations import install

    with pytest.raises(ValueError, match="found a Linear, neither a DistributedDataParallel"):
        install(torch.nn.Linear(2, 2))


def test_torchtitan_parallelize_fn_is_wrapped(monkeypatch):
    """The wrapper runs torchtitan's parallelize_fn, then installs on what it returns."""
    import qcomm.integrations.torchtitan as qt

    seen = []
    monkeypatch.setattr(qt, "install", lambda model, config: seen.append((model, config)))

    def parallelize(model, dims, job):
        return ("parallelized", model, dims, job)

    wrapped = qt.compressed(parallelize, config="cfg")
    assert wrapped("m", "d", job="j") == ("parallelized", "m", "d", "j")
    assert seen == [(("parallelized", "m", "d", "j"), "cfg")] and wrapped.__name__ == "parallelize"

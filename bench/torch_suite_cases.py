"""torch's DistributedTest, as torch's ``test/distributed/test_distributed_spawn.py``
runs it, for :mod:`bench.torch_suite` (``BACKEND``, ``WORLD_SIZE``, ``TEMP_DIR`` and
``INIT_METHOD`` come from the environment; ``import qcomm`` registers the backend in
every spawned rank, which imports this module).

``QCOMM_SUITE_AS_GLOO=1`` (with ``BACKEND=gloo``): the suite believes it runs gloo, so
the tests it keeps for gloo run too, but every group it creates as gloo is a qcomm one.
"""

import os

import torch.distributed as dist
from torch.testing._internal.distributed.distributed_test import (
    DistributedTest,
    TestDistBackend,
)

import qcomm  # noqa: F401 (registers the "qcomm" backend)

if os.environ.get("QCOMM_SUITE_AS_GLOO") == "1":
    _init, _new_group = dist.init_process_group, dist.new_group

    def _as_qcomm(backend):
        return "qcomm" if backend in ("gloo", dist.Backend.GLOO) else backend

    def init_process_group(backend=None, *args, **kwargs):
        return _init(_as_qcomm(backend), *args, **kwargs)

    def new_group(*args, backend=None, **kwargs):
        return _new_group(*args, backend=_as_qcomm(backend), **kwargs)

    dist.init_process_group, dist.new_group = init_process_group, new_group


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()

"""The tuned torch path of the codec: the CPU's data path (``impl="torch"``, compiled
with ``torch.compile``; ``impl="eager"`` or ``QCOMM_COMPILE=0`` runs it uncompiled).

It computes exactly the bytes of :mod:`qcomm.oracle` (tests/test_kernels.py checks
oracle == this path == the Triton kernels byte for byte), but its shape is chosen for
the C++ Inductor writes from it on AVX2 and AVX-512, and every such choice carries the
measurement that made it. What it optimises:

- one pass over memory per op: bucket statistics and codes in one loop where Inductor
  fuses them (min-max), per-bucket values stored once where it would recompute them;
- graphs over ``[buckets, B]`` views whose only dynamic size is the bucket count, and
  fixed-size graphs for a partial last bucket, so a new tensor length never compiles;
- one hash per two elements, int32 lanes, fp32 codes converted to bytes in one
  instruction, counters passed in as data (Inductor's AVX2 arange is 17 instructions);
- word-wise decodes whose lane groups match Inductor's vectors (:func:`~qcomm.cpu.
  dequantize.lane_group`), chunked byte buffers under glibc's mmap threshold;
- repeated calls of one signature skip Dynamo (:mod:`qcomm.cpu.compiled`).

Files, one op each as in ``qcomm.kernels``: :mod:`~qcomm.cpu.quantize`,
:mod:`~qcomm.cpu.dequantize`; shared pieces (hash, rounding, packing, bucket splits)
in :mod:`~qcomm.cpu.common`; the compile cache in :mod:`~qcomm.cpu.compiled`.
Design notes and the measurements behind them: ``docs/cpu-path.md``.
"""

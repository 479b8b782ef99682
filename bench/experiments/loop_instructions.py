"""Instruction counts of the loops in the C++ kernels Inductor compiles for one CPU
quantize configuration: compiles it into a fresh Inductor cache and disassembles every
kernel there (``objdump -d``), printing each backward branch's loop body length (loops
of more than 20 instructions; ``*``: the loop hashes (vpmulld), a code loop; ``+``: it
floors (vroundps): min-max and maxnorm code loops, and a graph without the hash, as in
the dropped dither-table experiment, docs/cpu-path.md). The full-bucket graph's code
loop is the first starred one of the kernel with the reductions (one iteration: 16 fp32
or 32 bf16 elements); that count is what docs/cpu-path.md and ``qcomm/cpu/`` quote.

    loop_instructions.py SCHEME BITS DTYPE     e.g. minmax 8 float32
"""

import os
import re
import subprocess
import sys
import tempfile


def loops(so: str) -> list[str]:
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", so], check=True,
                         capture_output=True, text=True).stdout
    if "<kernel>:" not in asm:  # a .so of another kind (a cached wrapper)
        return []
    asm = asm[asm.index("<kernel>:"):]
    addr, ins = [], []
    for line in asm.splitlines():
        m = re.match(r"\s*([0-9a-f]+):\s+(\S.*)", line)
        if m:
            addr.append(int(m.group(1), 16))
            ins.append(m.group(2))
    out = []
    for i, text in enumerate(ins):
        m = re.match(r"j\w+\s+([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr[i] and int(m.group(1), 16) in addr:
            n = i - addr.index(int(m.group(1), 16)) + 1
            if n > 20:  # marks: * the loop hashes (vpmulld), + it floors (vroundps)
                body = ins[i - n + 1:i + 1]
                marks = "*" * any("vpmulld" in t for t in body)
                marks += "+" * any("vroundps" in t for t in body)
                out.append(f"{n}{marks}")
    return out


def main(scheme: str, bits: str, dtype: str) -> None:
    cache = tempfile.mkdtemp(prefix="qcomm-loops-")
    code = ("import torch; from qcomm import QuantConfig, quantize; torch.set_num_threads(1); "
            f"quantize(torch.randn(1 << 20).to(torch.{dtype}), "
            f"QuantConfig(bits={int(bits)}, scheme='{scheme}'))")
    subprocess.run([sys.executable, "-c", code], check=True,
                   env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
    for root, _, files in os.walk(cache):
        for f in files:
            if f.endswith(".so"):
                print(f[:8], *loops(os.path.join(root, f)))


if __name__ == "__main__":
    main(*sys.argv[1:])

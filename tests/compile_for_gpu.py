"""Compile qcomm's Triton kernels for a GPU that this machine need not have.

``python tests/compile_for_gpu.py [ARCH]`` (default 90, Hopper) lowers each kernel of
every case in :data:`CASES` through the installed Triton's full pipeline (TTIR, TTGIR,
LLVM IR, PTX, cubin) and prints their sizes; ``--digest`` prints a digest of each
kernel's PTX instead (source lines left out), to diff before and after a change that
should leave the GPU code alone; ``--sass`` the instruction counts of one case. The
Triton interpreter, how CI runs the kernels, skips that pipeline, and it is where
version differences bite: triton 3.6 (the GPU image's) refused a global written as
``X: tl.constexpr = ...`` that triton 3.9 and the interpreter accept. Run in its own
process: ``TRITON_INTERPRET=1`` must not be set.
"""

import os
import sys

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("compile_for_gpu.py: unset TRITON_INTERPRET (the interpreter compiles nothing)")

import triton  # noqa: E402
from qcomm.kernels.common import num_warps, scheme_args, tile_args  # noqa: E402
from qcomm.kernels.dequantize import _dequantize_kernel  # noqa: E402
from qcomm.kernels.dequantize_sum import OPS, _dequantize_sum_kernel  # noqa: E402
from qcomm.kernels.quantize import _quantize_kernel  # noqa: E402
from qcomm.kernels.update_state import _update_state_kernel  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from qcomm.config import QuantConfig  # noqa: E402
from qcomm.layout import effective_scheme_id, levels  # noqa: E402

DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
# (scheme, bits, dtype, bucket, l2, stochastic, accumulate): each code path of the kernels
CASES = [
    ("minmax", 8, "float32", 1024, False, True, False),
    ("minmax", 4, "bfloat16", 128, False, False, True),
    ("maxnorm", 3, "float16", 256, True, True, False),
    ("nuq", 2, "bfloat16", 1024, False, True, False),
    ("nuq", 7, "float32", 2048, True, False, True),
    ("minmax", 1, "float32", 64, False, True, False),
]
# update_state's differences: another configuration than any case's state
DELTA = QuantConfig(bits=4, bucket_size=128, scheme="maxnorm")


def compile_case(scheme, bits, dtype, bucket, l2, stochastic, accumulate, arch, warps=None,
                 aligned=False, many=False):
    """(quantize, dequantize, dequantize_sum, update_state) of one case compiled for
    ``arch``; ``many``: the quantize of payload rows (a launch over a (bucket, row)
    grid). update_state's state is the case's configuration, its differences
    :data:`DELTA`."""
    target = GPUTarget("cuda", arch, 32)
    sid = effective_scheme_id(scheme, bits)
    config = QuantConfig(bits=bits, bucket_size=bucket, scheme=scheme)
    elem = {"float32": 4}.get(dtype, 2)
    warps = warps or num_warps(bucket)
    # aligned: pointers and sizes divisible by 16, as Triton specializes a real launch
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(5)} if aligned else None
    options = dict(num_warps=warps, enable_fp_fusion=False)

    def constexprs(elem=elem, **kw):  # the launchers' tile arguments, not the runtime ones
        args = dict(tile_args(config, 1 << 20, elem, **kw), SCHEME=sid, LEVELS=levels(sid, bits))
        del args["n_rows"], args["num_warps"]
        return args

    q = dict(constexprs(halves=True), L2=l2, STOCHASTIC=stochastic, MANY=many)
    sig = dict(x_ptr="*" + DTYPES[dtype], meta_ptr="*fp32", codes_ptr="*u8", n="i64",
               n_rows="i64", key="i32", keys_ptr="*i32", skip="i32", x_row="i64",
               meta_row="i64", codes_row="i64", **{k: "constexpr" for k in q})
    kq = triton.compile(ASTSource(_quantize_kernel, sig, constexprs=q, attrs=attrs),
                        target=target, options=options)
    d = dict(constexprs(), ACCUMULATE=accumulate)
    out = "*fp32" if accumulate else "*" + DTYPES[dtype]
    sig = dict(meta_ptr="*fp32", codes_ptr="*u8", out_ptr=out, n="i64", n_rows="i64",
               meta_row="i64", codes_row="i64", out_row="i64", **{k: "constexpr" for k in d})
    kd = triton.compile(ASTSource(_dequantize_kernel, sig, constexprs=d, attrs=attrs),
                        target=target, options=options)
    s = dict(constexprs(), OP=OPS["avg" if accumulate else "sum"])
    sig = dict(meta_ptr="*fp32", codes_ptr="*u8", own_ptr="*" + DTYPES[dtype], out_ptr=out,
               n="i64", n_rows="i64", rows="i32", skip="i32", meta_row="i64",
               codes_row="i64", factor="fp32", **{k: "constexpr" for k in s})
    ks = triton.compile(ASTSource(_dequantize_sum_kernel, sig, constexprs=s, attrs=attrs),
                        target=target, options=options)
    u = dict(constexprs(elem=4), L2=l2, DBITS=DELTA.bits, DB=DELTA.bucket_size,
             **scheme_args(DELTA, "D"))
    sig = dict(s_meta_ptr="*fp32", s_codes_ptr="*u8", d_meta_ptr="*fp32", d_codes_ptr="*u8",
               out_ptr="*" + DTYPES[dtype], n="i64", n_rows="i64", s_meta_row="i64",
               s_codes_row="i64", d_meta_row="i64", d_codes_row="i64", out_row="i64",
               **{k: "constexpr" for k in u})
    ku = triton.compile(ASTSource(_update_state_kernel, sig, constexprs=u, attrs=attrs),
                        target=target, options=options)
    return kq, kd, ks, ku


def sass_count(kernel) -> int:
    """Static SASS instructions of a compiled kernel (Triton's bundled cuobjdump)."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True,
                             check=True).stdout
    return sum(1 for line in out.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line))


def sass_table() -> int:
    """``--sass``: static SASS instructions per element of the 8-bit min-max fp32
    kernels (bucket 1024, stochastic) at 1, 2, 4 and 8 warps: the counts the warps
    comment in kernels/common.py quotes."""
    for warps in (1, 2, 4, 8):
        kq, kd, _, _ = compile_case("minmax", 8, "float32", 1024, False, True, False,
                                    arch=90, warps=warps, aligned=True)
        per = 1024 / (32 * warps)  # elements per thread
        print(f"{warps} warps: quantize {sass_count(kq) / per:.1f}, "
              f"dequantize {sass_count(kd) / per:.1f} SASS instructions per element")
    return 0


def ptx_digest(kernel) -> str:
    """A kernel's PTX without what names source lines (comments, ``.loc``/``.file``
    directives, debug sections and their labels), hashed: equal digests before and
    after a change mean the GPU runs the same code."""
    import hashlib
    import re

    ptx = re.sub(r"//.*", "", kernel.asm["ptx"]).split(".section")[0]
    code = [line for line in ptx.splitlines()
            if not line.strip().startswith((".loc", ".file", "$L__"))]
    return hashlib.sha256("\n".join(code).encode()).hexdigest()[:16]


def main() -> int:
    if "--sass" in sys.argv:
        return sass_table()
    digest = "--digest" in sys.argv  # PTX digests, for a diff across a change
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    arch = int(args[0]) if args else 90
    for i, case in enumerate(CASES):  # every other case's quantize over payload rows
        kernels = compile_case(*case, arch=arch, many=i % 2 == 1)
        sizes = ", ".join(
            f"{name} {ptx_digest(k) if digest else str(len(k.asm['cubin'])) + ' B'}"
            for name, k in zip((f"quantize{' rows' if i % 2 else ''}", "dequantize",
                                "dequantize_sum", "update_state"), kernels, strict=True))
        print(f"sm_{arch} {case}: {'PTX digests' if digest else 'cubins'} {sizes}")
    print(f"triton {triton.__version__}: {4 * len(CASES)} kernels compiled for sm_{arch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

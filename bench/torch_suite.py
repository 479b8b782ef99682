"""``python -m bench.torch_suite``: torch's own DistributedTest collective tests, on
gloo and on qcomm groups with compression off, side by side.

torch's wheel ships its multi-process distributed suite
(``torch.testing._internal.distributed.distributed_test``): the same ``_DistTestBase``
tests torch's CI runs per backend (``test/distributed/test_distributed_spawn.py``).
This runs the collective families qcomm serves (all_gather, all_reduce,
reduce_scatter, broadcast, barrier, all_to_all, gather, scatter, send_recv) with
``BACKEND=gloo`` and with ``BACKEND=qcomm`` (``QCOMM_*_BITS=off``: every call exact, so
the values must be gloo's), 2 ranks, and reports every test whose outcome differs.
Tests the suite limits to named backends (``require_backend_is_available``) are
skipped under ``qcomm`` by the suite itself; a third pass, ``qcomm-as-gloo``, tells the
suite gloo and makes every group it creates a qcomm one, so those run on qcomm too
(tests that assert the backend's name then differ by design).

    pip install expecttest                       # what torch's test utilities import
    python -m bench.torch_suite                  # ~13 min on 2 cores
    python -m bench.torch_suite -k all_gather    # a narrower selection

Writes ``bench/results/<machine>/torch-suite.json`` (``python -m bench report`` shows it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from . import common

FAMILIES = ("all_gather", "all_reduce", "reduce_scatter", "broadcast", "barrier",
            "all_to_all", "gather", "scatter", "send_recv")
CASES = Path(__file__).with_name("torch_suite_cases.py")
OFF = {"QCOMM_AG_BITS": "off", "QCOMM_RS_BITS": "off", "QCOMM_AR_BITS": "off"}


def run_backend(backend: str, select: str, timeout: float) -> dict[str, str]:
    """{test name: passed | failed | skipped} for one backend: ``gloo``, ``qcomm``, or
    ``qcomm-as-gloo`` (the suite told gloo, every group it makes a qcomm one, so the
    tests it keeps for gloo run on qcomm too)."""
    with tempfile.TemporaryDirectory(prefix="qcomm-suite-") as tmp:
        xml = Path(tmp) / "junit.xml"
        as_gloo = backend == "qcomm-as-gloo"
        env = dict(os.environ, BACKEND="gloo" if as_gloo else backend, WORLD_SIZE="2",
                   TEMP_DIR=tmp, QCOMM_SUITE_AS_GLOO="1" if as_gloo else "0",
                   INIT_METHOD=f"file://{tmp}/init", QCOMM_COMPILE="0",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(common.ROOT),
                                                            os.environ.get("PYTHONPATH")])),
                   **(OFF if backend != "gloo" else {}))
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        str(CASES), "-k", select, f"--junitxml={xml}"],
                       env=env, cwd=common.ROOT, timeout=timeout, check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        outcomes = {}
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = case.get("name")
            if case.find("skipped") is not None:
                outcomes[name] = "skipped"
            elif case.find("failure") is not None or case.find("error") is not None:
                node = case.find("failure") if case.find("failure") is not None \
                    else case.find("error")
                outcomes[name] = "failed: " + (node.get("message") or "")[:200]
            else:
                outcomes[name] = "passed"
        return outcomes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.torch_suite", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-k", default=" or ".join(f"test_{f}" for f in FAMILIES),
                   help="pytest -k selection (default: the collective families)")
    p.add_argument("--timeout", type=float, default=2400, help="per backend, seconds")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    try:
        import expecttest  # noqa: F401 (torch's test utilities import it)
    except ImportError:
        print("python -m bench.torch_suite: torch's test suite needs `expecttest` "
              "(pip install expecttest)", file=sys.stderr)
        return 2
    header = common.run_header("torch-suite", device="cpu (gloo)",
                               command="python -m bench.torch_suite" +
                               ("" if argv is None and len(sys.argv) == 1 else
                                " " + " ".join(sys.argv[1:] if argv is None else argv)))
    print(common.format_header(header), flush=True)
    results, seconds = {}, {}
    for backend in ("gloo", "qcomm", "qcomm-as-gloo"):
        start = time.monotonic()
        results[backend] = run_backend(backend, args.k, args.timeout)
        seconds[backend] = time.monotonic() - start
        counts = {k: sum(v.startswith(k) for v in results[backend].values())
                  for k in ("passed", "failed", "skipped")}
        print(f"# {backend}: {len(results[backend])} tests, {counts} "
              f"({seconds[backend]:.0f} s)", flush=True)
    gloo = results["gloo"]
    names = sorted(set(gloo) | set(results["qcomm"]) | set(results["qcomm-as-gloo"]))
    lines = [f"# selection: -k {args.k!r}, 2 ranks, qcomm with {OFF}"]
    real, suite_skips = [], []
    for backend in ("qcomm", "qcomm-as-gloo"):
        other = results[backend]
        differ = [(n, gloo.get(n, "absent"), other.get(n, "absent"))
                  for n in names if gloo.get(n) != other.get(n)]
        # the suite's own backend lists skip tests under any backend not named there
        skips = [n for n, g, q in differ if g == "passed" and q == "skipped"]
        found = [(n, g, q) for n, g, q in differ if n not in skips]
        real += [(backend, *d) for d in found]
        if backend == "qcomm":
            suite_skips = skips
        lines.append(f"# {backend} vs gloo: {len(names)} tests; same outcome: "
                     f"{len(names) - len(differ)}; skipped by the suite's backend lists: "
                     f"{len(skips)}; other differences: {len(found)}")
        lines += [f"#   {n}: gloo {g} / {backend} {q}" for n, g, q in found]
    print("\n".join(lines))
    header["selection"] = args.k
    folder = common.results_dir(args.out, header)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "torch-suite.json").write_text(json.dumps(
        {"header": header, "results": results, "seconds": seconds,
         "suite_skips": suite_skips, "differences": real}, indent=1))
    print(f"# wrote {folder}/torch-suite.json", file=sys.stderr)
    return 1 if real else 0


if __name__ == "__main__":
    sys.exit(main())

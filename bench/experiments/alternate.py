"""Side-by-side quantize throughput of several trees on a noisy VM: runs
``side_by_side.py grid`` once per tree and grid, alternating trees, ROUNDS times (a
fresh process each, from /tmp with ``PYTHONPATH`` = the tree), then prints the median
and max G elements/s per point and tree and writes every run as JSON.

    alternate.py ROUNDS OUT.json LABEL=TREE ... -- "DTYPE LOG2 BITS SCHEMES" ...
    alternate.py ROUNDS OUT.json LABEL=TREE ... -- "latency DTYPE LOG2S BITS SCHEMES" ...

(the second runs ``side_by_side.py latency``: us per call, lower is better).
``alternate.py --print OUT.json`` prints the medians of such a file again. An OUT.json
without a folder goes to ``bench/results/cpu-amd-epyc-2c-avx2/`` (the figures of this
machine), a path with one where it says.

e.g. ``alternate.py 3 out.json base=/tmp/base new=$PWD -- "float32 24 2,4,8
minmax,maxnorm,nuq"``. On this 2-core VM one run of a point drifts 10-20% between
calls; the median of alternating rounds is what docs/cpu-path.md quotes.
"""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "results" / "cpu-amd-epyc-2c-avx2"


def result_path(name: str) -> Path:
    """A bare file name lands in RESULTS; a path with a folder is used as given."""
    return Path(name) if "/" in name else RESULTS / name


def main(argv: list[str]) -> None:
    rounds, out = int(argv[0]), argv[1]
    split = argv.index("--")
    trees = dict(a.split("=", 1) for a in argv[2:split])
    grids = argv[split + 1:]
    runs: dict[str, dict[str, list[float]]] = {}
    for _ in range(rounds):
        for grid in grids:
            for label, tree in trees.items():
                env = dict(os.environ, PYTHONPATH=tree)
                proc = subprocess.run(
                    [sys.executable, str(HERE / "side_by_side.py"),
                     *(grid.split() if grid.startswith("latency") else ["grid", *grid.split()])],
                    env=env, cwd="/tmp", capture_output=True, text=True, check=True)
                for key, rate in json.loads(proc.stdout.strip().splitlines()[-1]).items():
                    runs.setdefault(key, {}).setdefault(label, []).append(rate)
    result_path(out).write_text(json.dumps({"trees": trees, "rounds": rounds, "runs": runs},
                                    indent=1) + "\n")
    summarize(out)


def summarize(path: str) -> None:
    """Print the medians of a file ``main`` wrote (``alternate.py --print OUT.json``)."""
    data = json.loads(result_path(path).read_text())
    runs, first = data["runs"], next(iter(data["trees"]))
    for key, by in runs.items():
        med = {label: statistics.median(v) for label, v in by.items()}
        cells = [f"{label} {med[label]:.3f} (max {max(v):.3f})" for label, v in by.items()]
        ratios = [f"{label}/{first} {med[label] / med[first]:.2f}x" for label in by
                  if label != first]
        print(f"{key:26s}", "  ".join(cells), " ", "  ".join(ratios))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--print"]:
        summarize(sys.argv[2])
    else:
        main(sys.argv[1:])

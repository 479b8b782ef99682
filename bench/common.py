"""What every benchmark shares: timing, the run header, one table format, result files.

- :func:`time_calls` / :func:`plan_iters`: the one timing helper (median of N timed
  calls after warm-up, N cut down so one point stays within a time budget).
- :func:`run_header`: device (GPU via nvidia-ml-py, else CPU), versions, link rate.
- :class:`Column` + :func:`format_table`: the one table format, on stdout.
- :func:`write_results`: JSON (header + rows) and CSV in a results folder, and PNG
  plots through :func:`plot_lines` when matplotlib is installed (extra ``plot``).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import hashlib
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

# --------------------------------------------------------------------------- timing


def sync_fn(device: torch.device | str) -> Callable[[], None]:
    """What makes a timed region end when the device's work ends."""
    if torch.device(device).type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def time_calls(
    fn: Callable[[], object],
    iters: int,
    *,
    sync: Callable[[], None] = lambda: None,
    before: Callable[[], None] | None = None,
) -> list[float]:
    """Seconds of each of ``iters`` calls of ``fn``; ``before`` runs untimed before each."""
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def plan_iters(estimate_s: float, iters: int, budget_s: float | None) -> int:
    """``iters`` timed calls, or fewer (never under 3) to fit ``budget_s``."""
    if budget_s is None or estimate_s <= 0:
        return iters
    return max(min(3, iters), min(iters, int(budget_s / estimate_s)))


def measure(
    fn: Callable[[], object],
    *,
    iters: int = 10,
    budget_s: float | None = None,
    device: torch.device | str = "cpu",
) -> float:
    """Median seconds per call of ``fn`` after an untimed call; on a CUDA ``device``
    through ``triton.testing.do_bench`` (CUDA events, L2 flushed)."""
    if torch.device(device).type == "cuda":
        import triton.testing

        # 100 ms of repetitions at most: a full GPU sweep has ~1,400 points.
        rep_ms = 1000 * min(budget_s, 0.1) if budget_s else 100
        return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") / 1e3
    warm = time_calls(fn, 1)
    n = plan_iters(min(warm), iters, budget_s)
    return statistics.median(time_calls(fn, n))


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def target_line(name: str, want: str, shown: str | None, met: bool = False) -> str:
    """One target's line for ``bench/device_check.sh``'s summary: ``TARGET name: shown;
    want: met`` (or ``NOT met``); ``shown`` None: not measured, NOT met."""
    if shown is None:
        return f"TARGET {name}: not measured; {want}: NOT met"
    return f"TARGET {name}: {shown}; {want}: {'met' if met else 'NOT met'}"


# --------------------------------------------------------------------------- sizes


def parse_sizes(text: str) -> list[int]:
    """``"16..26"`` (powers of two, inclusive; ``"16..26:2"`` every other one),
    ``"2^20,2^24"`` or plain element counts ``"1000,4096"``."""
    sizes: list[int] = []
    for token in (t.strip() for t in text.split(",")):
        if not token:
            continue
        m = re.fullmatch(r"(?:2\^)?(\d+)\.\.(?:2\^)?(\d+)(?::(\d+))?", token)
        if m:
            lo, hi, step = int(m[1]), int(m[2]), int(m[3] or 1)
            if lo > hi or step < 1 or hi > 40:
                raise ValueError(f"bad size range {token!r}: want LO..HI[:STEP] exponents <= 40")
            sizes += [1 << e for e in range(lo, hi + 1, step)]
        elif re.fullmatch(r"2\^\d+", token):
            sizes.append(1 << int(token[2:]))
        elif re.fullmatch(r"\d+", token) and int(token) > 0:
            sizes.append(int(token))
        else:
            raise ValueError(f"bad size {token!r}: use LO..HI (exponents), 2^K or a count")
    if not sizes:
        raise ValueError(f"no sizes in {text!r}")
    return sizes


def arg(fn: Callable) -> Callable:
    """An argparse ``type=`` that keeps ``fn``'s ValueError message in the usage error."""
    def parse(text: str):
        try:
            return fn(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parse.__name__ = fn.__name__
    return parse


def parse_list(text: str, allowed: Sequence[str], what: str) -> list[str]:
    """Comma list of names from ``allowed``; ``"all"`` is every one."""
    if text.strip() == "all":
        return list(allowed)
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in allowed]
    if bad or not items:
        raise ValueError(f"{what}: {bad or text!r} not in {list(allowed)}")
    return items


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def parse_config(text: str) -> tuple[str, dict[str, str]]:
    """One ``--config SPEC`` in the library's keys (``"bits=4,scheme=nuq"``, ``"exact"``):
    ``(SPEC, the QCOMM_* variables it sets)``, :func:`qcomm.config.env_from_keys`."""
    from qcomm.config import env_from_keys

    return text.strip(), env_from_keys(text)


def flat_twin(spec: str) -> str | None:
    """``"bits=8,topology=auto"`` -> ``"bits=8,topology=flat"``, the config an auto run
    is compared with (``vs_flat``); None without ``topology=auto``."""
    keys = [k.strip() for k in spec.split(",")]
    if "topology=auto" not in keys:
        return None
    return ",".join("topology=flat" if k == "topology=auto" else k for k in keys)


# --------------------------------------------------------------------------- header


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_isa() -> str | None:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return None


def _mem_total_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _gpus() -> list[dict]:
    """Every NVIDIA GPU through nvidia-ml-py; [] where there is none (or no driver)."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver, no device: a CPU machine
        return []
    gpus = []
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else driver
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            gpu = {
                "index": i,
                "name": name.decode() if isinstance(name, bytes) else name,
                "driver": driver,
                "memory_gib": round(pynvml.nvmlDeviceGetMemoryInfo(h).total / 2**30, 1),
            }
            for key, call in (("pcie_gen", "nvmlDeviceGetCurrPcieLinkGeneration"),
                              ("pcie_width", "nvmlDeviceGetCurrPcieLinkWidth")):
                try:
                    gpu[key] = getattr(pynvml, call)(h)
                except Exception:
                    pass
            links = 0
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    links += pynvml.nvmlDeviceGetNvLinkState(h, link) == pynvml.NVML_FEATURE_ENABLED
                except Exception:
                    break
            gpu["nvlinks_active"] = links
            gpus.append(gpu)
    finally:
        pynvml.nvmlShutdown()
    return gpus


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return None


def _git_commit() -> str | None:
    """The commit the results came from; a tree with uncommitted changes is named by
    the sha256 of its ``git diff HEAD`` too (``<commit>-dirty-<12 hex>``), so that a
    result can be traced to the exact code that made it."""
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "describe", "--always", "--dirty", "--abbrev=10"],
            capture_output=True, text=True, timeout=10,
        )
        commit = out.stdout.strip() or None
        if commit and commit.endswith("-dirty"):
            diff = subprocess.run(["git", "-C", str(ROOT), "diff", "HEAD"],
                                  capture_output=True, timeout=30).stdout
            commit += "-" + hashlib.sha256(diff).hexdigest()[:12]
        return commit
    except (OSError, subprocess.SubprocessError):
        return None


def run_header(what: str, *, device: str, link: str | None = None,
               command: str | None = None) -> dict:
    """The facts every result carries: device, machine, versions, link, command, time."""
    import qcomm

    cores = os.cpu_count()
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = cores
    header = {
        "benchmark": what,
        "command": command or " ".join(["python", "-m", "bench", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "gpus": _gpus(),
        # isa: the vector instructions torch (and Inductor's CPU code) use: the CPU
        # codec's speed depends on it (AVX2 vs AVX-512: different loops, see
        # qcomm/cpu/), so two machines of one model name differ by it.
        "cpu": {"model": _cpu_model(), "cores": cores, "usable_cores": usable,
                "memory_gib": _mem_total_gib(), "isa": _cpu_isa()},
        "host": platform.node(),
        # Other work on the machine skews CPU timings: the 1/5/15-minute load at the start.
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "link": link or "loopback",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "triton": _version("triton"),
            "qcomm": qcomm.__version__,
            "qcomm_git": _git_commit(),
        },
    }
    header["machine"] = machine_name(header)  # the results folder it belongs in
    return header


def start_local(what: str, args, sweep: dict) -> dict:
    """The header of a one-process benchmark on ``args.device`` (its torch threads and
    ``sweep`` recorded), printed; returns it."""
    header = run_header(what, device=str(torch.device(args.device)), command=args.command)
    header["cpu"]["torch_threads"] = torch.get_num_threads()
    header["sweep"] = sweep
    print(format_header(header), flush=True)
    return header


def machine_name(header: dict) -> str:
    """Folder name for committed results: the GPU, else the CPU model and core count."""
    if header["gpus"]:
        g = header["gpus"][0]
        base = f"{len(header['gpus'])}x-{g['name']}" if len(header["gpus"]) > 1 else g["name"]
    else:
        base = f"cpu-{header['cpu']['model']}-{header['cpu']['cores']}c"
        if header["cpu"].get("isa") not in (None, "DEFAULT"):
            base += f"-{header['cpu']['isa']}"
    return re.sub(r"[^a-z0-9]+", "-", base.lower()).strip("-")


def format_header(h: dict) -> str:
    v = h["versions"]
    lines = [f"# qcomm bench {h['benchmark']}   {h['date']}   {h['command']}"]
    for g in h["gpus"]:
        pcie = f", PCIe gen{g.get('pcie_gen', '?')} x{g.get('pcie_width', '?')}"
        lines.append(
            f"# GPU {g['index']}: {g['name']}, {g['memory_gib']} GiB, driver {g['driver']}"
            f"{pcie}, {g['nvlinks_active']} NVLinks active"
        )
    c = h["cpu"]
    lines.append(f"# CPU: {c['model']}, {c['cores']} cores ({c['usable_cores']} usable), "
                 f"{c['memory_gib']} GiB, {c.get('isa') or 'ISA ?'}, "
                 f"load {' '.join(map(str, h['load_avg']))}; "
                 f"device {h['device']}")
    lines.append(f"# torch {v['torch']}, triton {v['triton']}, qcomm {v['qcomm']} "
                 f"({v['qcomm_git']}), python {v['python']}; link {h['link']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- tables


@dataclass(frozen=True)
class Column:
    key: str  # the row dict's key (and the JSON/CSV field name)
    title: str  # the table heading
    fmt: str = "{}"  # how the table prints a value (files keep full precision)


def _cell(col: Column, row: dict) -> str:
    value = row.get(col.key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return col.fmt.format(value)


def format_table(columns: Sequence[Column], rows: Sequence[dict]) -> str:
    cells = [[_cell(c, r) for c in columns] for r in rows]
    widths = [max([len(c.title)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    out = ["  ".join(c.title.rjust(w) for c, w in zip(columns, widths, strict=True))]
    out += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(out)


# --------------------------------------------------------------------------- files


def results_dir(out: str | None, header: dict) -> Path:
    path = Path(out) if out else RESULTS / machine_name(header)
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_results(
    folder: Path, stem: str, header: dict, columns: Sequence[Column], rows: Sequence[dict]
) -> list[Path]:
    """``<stem>.json`` (header, columns, rows) and ``<stem>.csv`` (rows) in ``folder``."""
    keys = [c.key for c in columns]
    extra = sorted({k for r in rows for k in r} - set(keys))
    json_path, csv_path = folder / f"{stem}.json", folder / f"{stem}.csv"
    json_path.write_text(json.dumps(
        {"header": header, "columns": keys + extra, "rows": list(rows)}, indent=1) + "\n")
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys + extra)
        writer.writeheader()
        writer.writerows(rows)
    return [json_path, csv_path]


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_lines(
    path: Path,
    panels: dict[str, dict[str, tuple[Sequence[float], Sequence[float]]]],
    *,
    xlabel: str,
    ylabel: str,
    suptitle: str,
    logy: bool = False,
    hline: float | None = None,
    ncols: int | None = None,
) -> Path | None:
    """One subplot per panel (``ncols`` to a row), one line per series
    ``{label: (xs, ys)}``, x on a log scale; None without matplotlib."""
    if not have_matplotlib() or not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = min(ncols or len(panels), len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 4.2 * nrows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (title, series) in zip(axes.flat, panels.items(), strict=False):
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o", markersize=3, label=label)
        ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        if hline is not None:
            ax.axhline(hline, color="gray", linestyle=":", linewidth=1)
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(suptitle, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(what: str, header: dict, columns: Sequence[Column], rows: Sequence[dict],
           out: str | None, stem: str) -> Path:
    """Print the table and write the files; returns the results folder."""
    print(format_table(columns, rows), flush=True)
    folder = results_dir(out, header)
    paths = write_results(folder, stem, header, columns, rows)
    print(f"# wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    return folder

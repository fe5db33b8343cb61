"""Small helpers shared by the benchmark scripts.

Standard library only (torch is imported lazily): the scripts run in several
venvs (.venv, .venv-sglang, .venv-vllm, .venv-lmcache).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
#: CPU features that change the figures (bf16 is emulated without avx512_bf16 / AMX).
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


@dataclass(frozen=True, slots=True)
class MachineInfo:
    """Where a benchmark ran: recorded with every result so figures from different machines are never mixed."""

    cpu: str
    isa: tuple[str, ...]  # the ISA_FLAGS this CPU has
    cpus: int | None  # os.cpu_count()
    cpus_usable: int | None  # CPUs this process may run on (affinity)
    torch_threads: int | None  # torch.get_num_threads() when collected; None without torch
    python: str
    torch: str | None
    platform: str

    def __str__(self) -> str:
        cores = f"{self.cpus_usable} of {self.cpus} cores" if self.cpus_usable != self.cpus else f"{self.cpus} cores"
        torch = f"torch {self.torch} {self.torch_threads} threads" if self.torch else "no torch"
        isa = " ".join(self.isa) or "no avx2/avx512/amx"
        return " · ".join([self.cpu, isa, cores, f"python {self.python}", torch])

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "isa": list(self.isa), "summary": str(self)}


def _cpu_model_and_flags() -> tuple[str, set[str]]:
    """CPU model name and feature flags from /proc/cpuinfo (lscpu for the name where it has none)."""
    model, flags = "", set[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:  # x86, arm64
                flags = set(value.split())
    except OSError:
        pass
    if not model:
        try:
            out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
            model = next((v.strip() for k, _, v in (ln.partition(":") for ln in out.splitlines())
                          if k.strip() == "Model name"), "")
        except (OSError, subprocess.SubprocessError):
            pass
    return model or platform.processor() or platform.machine() or "unknown CPU", flags


def machine_info() -> MachineInfo:
    """Collect the machine description now (torch threads are read at call time, so call it after setting them)."""
    model, flags = _cpu_model_and_flags()
    try:
        import torch
    except ImportError:
        torch = None
    try:
        usable: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on every platform
        usable = os.cpu_count()
    return MachineInfo(cpu=model, isa=tuple(f for f in ISA_FLAGS if f in flags), cpus=os.cpu_count(),
                       cpus_usable=usable, torch_threads=torch.get_num_threads() if torch else None,
                       python=platform.python_version(), torch=torch.__version__ if torch else None,
                       platform=platform.platform())


def print_header() -> None:
    """Print the one-line machine description; each benchmark calls it once, after setting its threads."""
    print(f"machine: {machine_info()}", flush=True)


def median_time(fn: Callable[[], object], repeats: int, setup: Callable[[], object] | None = None) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs (``setup`` runs untimed before each)."""
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def print_table(title: str, header: list[str], rows: list[list[object]]) -> None:
    cells = [header] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for j, r in enumerate(cells):
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)))
        if j == 0:
            print("  " + "  ".join("-" * w for w in widths))


def write_json(name: str | Path, data: dict[str, Any]) -> Path:
    """Write ``data`` under results/ (or to ``name`` if it is an absolute path), atomically.

    Always records a ``"machine"`` key: :func:`machine_info`, plus any fields the caller put under
    ``data["machine"]`` (load averages, library versions, ...).
    """
    path = RESULTS / name
    path.parent.mkdir(parents=True, exist_ok=True)
    out = {"machine": {**machine_info().as_dict(), **data.get("machine", {})},
           **{k: v for k, v in data.items() if k != "machine"}}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(out, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def drop_caches(files: list[Path]) -> str:
    """Evict ``files`` from the page cache (all of it where allowed); returns the method that worked."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        return "fadvise_dontneed"


def snapshot(rev: str, into: Path) -> Path:
    """The repository's code at ``rev`` (``git archive``) in ``into``, laid out as it is imported: ``transports/``
    and ``integrations/`` inside ``kvengine/`` (for before/after runs of one benchmark against two revisions)."""
    into.mkdir(parents=True)
    root = Path(__file__).resolve().parent.parent
    archive = subprocess.run(["git", "archive", rev], cwd=root, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    for sub in ("transports", "integrations"):
        (into / sub).rename(into / "kvengine" / sub)
    return into

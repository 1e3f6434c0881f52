"""Run a benchmark inside its own virtual environment with pinned packages.

``ensure(requirements)`` creates ``benchmarks/.venv`` (once), installs the pinned packages and
ampdoctor itself into it, and re-executes the calling script there. Nothing outside
``benchmarks/.venv`` is changed.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VENV = HERE / ".venv"


def _python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def ensure(requirements: list[str]) -> None:
    if os.environ.get("AMPDOCTOR_BENCH_IN_VENV") == "1":
        return
    stamp = VENV / ".requirements"
    wanted = "\n".join(sorted(requirements))
    if not stamp.exists() or stamp.read_text() != wanted:
        if not _python().exists():
            subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        pip = [str(_python()), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        torch_pins = [r for r in requirements if r.startswith("torch==")]
        if torch_pins:  # first, so that nothing else pulls another torch build
            subprocess.run(pip + torch_pins, check=True)
        subprocess.run(pip + [r for r in requirements if not r.startswith("torch==")], check=True)
        subprocess.run(pip + ["--no-deps", "-e", str(ROOT)], check=True)
        subprocess.run(pip + ["libcst", "click", "rich", "pathspec"], check=True)
        stamp.write_text(wanted)
    env = dict(os.environ, AMPDOCTOR_BENCH_IN_VENV="1")
    os.execve(str(_python()), [str(_python()), *sys.argv], env)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(next(l for l in Path("/proc/meminfo").read_text().splitlines() if l.startswith("MemTotal")).split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        pass
    return f"{cpu}, {os.cpu_count()} cores{mem}, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def write_results(section: str, text: str) -> None:
    """Replace one section of benchmarks/RESULTS.md (and keep the others)."""
    path = HERE / "RESULTS.md"
    start, end = f"<!-- {section}:start -->", f"<!-- {section}:end -->"
    body = path.read_text() if path.exists() else "# Benchmark results\n\n"
    block = f"{start}\n{text.rstrip()}\n{end}"
    if start in body and end in body:
        body = body[: body.index(start)] + block + body[body.index(end) + len(end):]
    else:
        body = body.rstrip() + "\n\n" + block + "\n"
    path.write_text(body)

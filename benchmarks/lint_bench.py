"""Lint speed, side by side, on a corpus of real code rebuilt from pinned PyPI packages.

    python benchmarks/lint_bench.py [--runs 3] [--slow-sample 20]

Runs inside benchmarks/.venv (created on first use, with the peers installed). The corpus is the
Python files of torch, transformers, timm and diffusers at pinned versions, unpacked (no
dependencies) into benchmarks/.corpus. In one run it times, cold and best-of-N:

- ampdoctor with no cache, one process and all cores; ampdoctor with a warm cache;
- ruff check --select ALL --no-cache;
- the floors: libcst parse only and ast.parse only, of the same files;
- TorchFix 0.7.0 and Fixit (built-in rules), which check a few files per second, on an evenly
  spaced sample of the corpus (every Nth file, --slow-sample N); their files/s are measured on
  that sample and their full-corpus time is extrapolated (marked as such).

It prints a table (files/s, lines/s, time relative to ampdoctor, peak RSS) and writes it to
benchmarks/RESULTS.md with a description of the machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_env  # noqa: E402

PACKAGES = ["torch==2.13.0", "transformers==5.24.0", "timm==1.0.31", "diffusers==0.42.1"]
PEERS = ["torchfix==0.7.0", "fixit==2.2.1", "ruff==0.17.5"]

bench_env.ensure(["torch==2.13.0", *PEERS])

HERE = Path(__file__).resolve().parent
CORPUS = HERE / ".corpus"


def build_corpus() -> list[Path]:
    stamp = CORPUS / ".packages"
    if not stamp.exists() or stamp.read_text() != "\n".join(PACKAGES):
        shutil.rmtree(CORPUS, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                        "--target", str(CORPUS), *PACKAGES], check=True)
        stamp.write_text("\n".join(PACKAGES))
    roots = [CORPUS / p.split("==")[0] for p in PACKAGES]
    files = sorted(p for r in roots for p in r.rglob("*.py"))
    return files


def run_child(cmd: list[str], cwd: Path, env=None) -> tuple[float, int, int]:
    """(seconds, peak RSS in KiB, exit code) of one child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - t0
    return elapsed, usage.ru_maxrss, os.waitstatus_to_exitcode(status)


def best(cmd, cwd, runs, prepare=None, env=None) -> tuple[float, float, int]:
    """(cold seconds, best seconds, peak RSS KiB) over ``runs`` runs."""
    times, rss = [], 0
    for _ in range(runs):
        if prepare:
            prepare()
        t, r, _ = run_child(cmd, cwd, env)
        times.append(t)
        rss = max(rss, r)
    return times[0], min(times), rss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--slow-sample", type=int, default=20, help="TorchFix/Fixit check every Nth file")
    args = ap.parse_args()
    files = build_corpus()
    lines = sum(p.read_bytes().count(b"\n") for p in files)
    work = HERE / ".work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    listing = work / "files.txt"
    listing.write_text("\n".join(str(p) for p in files))
    sample = files[:: args.slow_sample]
    # outside the repository: Fixit skips files that a .gitignore above them ignores
    sample_dir = Path(tempfile.mkdtemp(prefix="ampdoctor-bench-sample-"))
    for i, p in enumerate(sample):
        dst = sample_dir / f"{i:05d}_{p.name}"
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(p, dst)
    sample_lines = sum(p.read_bytes().count(b"\n") for p in sample)
    py = sys.executable
    bindir = Path(py).parent
    roots = [str(CORPUS / p.split("==")[0]) for p in PACKAGES]
    cache = work / "cache"

    def clear_cache():
        shutil.rmtree(cache, ignore_errors=True)

    rows = []
    amp = [str(bindir / "ampdoctor"), "lint", "--select", "ALL", "--exit-zero", "-q", "--format", "concise"]
    cold, b, rss = best(amp + ["--no-cache", "-j", "1", *roots], work, args.runs)
    rows.append(("ampdoctor, no cache, 1 process", len(files), lines, cold, b, rss, False))
    cold, b, rss = best(amp + ["--no-cache", *roots], work, args.runs)
    rows.append((f"ampdoctor, no cache, {os.cpu_count()} processes", len(files), lines, cold, b, rss, False))
    clear_cache()
    run_child(amp + ["--cache-dir", str(cache), *roots], work)
    cold, b, rss = best(amp + ["--cache-dir", str(cache), *roots], work, args.runs)
    rows.append(("ampdoctor, warm cache", len(files), lines, cold, b, rss, False))
    cold, b, rss = best([str(bindir / "ruff"), "check", "--select", "ALL", "--no-cache", "--exit-zero", "-q",
                         "--isolated", *roots], work, args.runs)
    rows.append(("ruff check --select ALL --no-cache", len(files), lines, cold, b, rss, False))
    # the floors collect cyclic garbage as rarely as ampdoctor does (see runner._rare_collections)
    floor = ("import gc, sys, {m}\ngc.freeze()\ngc.set_threshold(50000, 50, 100)\n"
             "for p in open(sys.argv[1]).read().split(chr(10)):\n"
             "    src = open(p, 'rb').read()\n    try:\n        {call}\n    except Exception:\n        pass\n")
    cold, b, rss = best([py, "-c", floor.format(m="libcst", call="libcst.parse_module(src)"), str(listing)], work,
                        max(1, args.runs - 2))
    rows.append(("floor: libcst parse only (1 process)", len(files), lines, cold, b, rss, False))
    cold, b, rss = best([py, "-c", floor.format(m="ast", call="ast.parse(src)"), str(listing)], work, args.runs)
    rows.append(("floor: ast.parse only (1 process)", len(files), lines, cold, b, rss, False))
    t, r, _ = run_child([str(bindir / "torchfix"), str(sample_dir)], work)
    rows.append((f"TorchFix 0.7.0 (every {args.slow_sample}th file)", len(sample), sample_lines, t, t, r, True))
    t, r, _ = run_child([str(bindir / "fixit"), "lint", str(sample_dir)], work)
    rows.append((f"Fixit 2.2.1, built-in rules (every {args.slow_sample}th file)", len(sample), sample_lines, t, t,
                 r, True))

    ref = rows[1][4] / rows[1][1]  # seconds per file of ampdoctor, all cores, cold best
    out = [f"## Lint speed ({date.today().isoformat()})", "",
           f"Machine: {bench_env.machine()}.",
           f"Corpus: the Python files of {', '.join(PACKAGES)}: {len(files):,} files, {lines:,} lines. "
           f"Best of {args.runs} runs (first run in brackets).", "",
           "| tool | files | files/s | lines/s | time (first run) | time per file vs ampdoctor | peak RSS |",
           "|---|---|---|---|---|---|---|"]
    for name, n, nl, cold, b, rss, sampled in rows:
        per_file = b / n
        extra = f" (full corpus ≈ {per_file * len(files):.0f} s)" if sampled else ""
        out.append(f"| {name} | {n:,} | {n / b:,.1f} | {nl / b:,.0f} | {b:.2f} s ({cold:.2f} s){extra} | "
                   f"{per_file / ref:.2f}x | {rss / 1024:.0f} MB |")
    text = "\n".join(out)
    print(text)
    bench_env.write_results("lint", text)


if __name__ == "__main__":
    main()

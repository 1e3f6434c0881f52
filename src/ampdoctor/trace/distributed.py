"""Tracing a job of several processes (torchrun, DDP, FSDP): each rank traces itself, writes its
report to a run folder when its script ends, and the reports are merged into one.

No collective is added to the job: a rank never waits on another while the script runs, and the
merge reads files once every rank has ended (or, under a bare ``torchrun -m ampdoctor trace``,
once rank 0 has waited a bounded time for the others). A rank that crashed or was killed loses
only its own report; the merged one says which ranks are missing. A rank killed by SIGTERM (what
torchrun sends to the others when one rank fails) still writes what it saw.

The run folder must be visible to the merging process: on one node it is a local folder; a job
over several nodes needs ``--run-dir`` on storage every node shares.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import tempfile
import time
from dataclasses import dataclass

from ampdoctor.trace.findings import param_order

RANK_FILE = "rank-{rank}.json"
_RANK_NAME = re.compile(r"rank-(\d+)\.json")
RUN_DIR_ENV = "AMPDOCTOR_RUN_DIR"
MERGE_ENV = "AMPDOCTOR_MERGE"  # "launcher": `ampdoctor trace --nproc-per-node` merges, not rank 0
_PHASE_ORDER = {"input": 0, "forward": 1, "loss": 2, "backward": 3, "param": 4}

GRADIENT_NOTE = ("Distributed run: the backward rows are the gradients each rank's own backward pass sent "
                 "between modules, before DDP/FSDP reduce anything (they differ across ranks); the parameter "
                 "gradients (.grad, read at the optimizer step) are after the all-reduce, the same on every "
                 "rank under DDP, so one rank's inf/NaN shows in every rank's parameter gradients.")


@dataclass
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    run_id: str


def rank_info(environ=os.environ) -> RankInfo | None:
    """This process's place in a job launched by torchrun (or any launcher setting ``RANK`` and
    ``WORLD_SIZE``), or None for a single process."""
    try:
        world = int(environ.get("WORLD_SIZE", "1"))
        rank = int(environ.get("RANK", "0"))
    except ValueError:
        return None
    if world <= 1 or "RANK" not in environ:
        return None
    return RankInfo(rank, world, int(environ.get("LOCAL_RANK", rank) or 0),
                    environ.get("TORCHELASTIC_RUN_ID", "none"))


def run_dir(info: RankInfo, given: str | None = None, environ=os.environ) -> str:
    """The folder this job's rank reports go to: ``--run-dir``, else ``AMPDOCTOR_RUN_DIR`` (set by
    ``ampdoctor trace --nproc-per-node``), else one per launcher process in the temp folder (the
    local ranks of one torchrun share their parent, the elastic agent)."""
    path = given or environ.get(RUN_DIR_ENV)
    if not path:
        path = os.path.join(tempfile.gettempdir(), f"ampdoctor-run-{info.run_id}-{os.getppid()}")
    os.makedirs(path, exist_ok=True)
    return path


def write_rank_report(folder: str, info: RankInfo, report: dict) -> str:
    """Write this rank's report atomically (a reader never sees half a file)."""
    report = dict(report, rank=info.rank, world_size=info.world_size, local_rank=info.local_rank,
                  host=os.uname().nodename if hasattr(os, "uname") else "", ended_at=time.time())
    final = os.path.join(folder, RANK_FILE.format(rank=info.rank))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".rank-", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(report, f)
    os.replace(tmp, final)
    return final


def _raise_terminated(signum, frame):
    from ampdoctor.trace.run import Terminated

    raise Terminated()


def stop_on_sigterm() -> None:
    """Turn SIGTERM into an exception in the main thread, so that the script stops, the hooks come
    off and the rank's report is still written. A script that installs its own handler keeps it."""
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _raise_terminated)


def hold_sigterm() -> None:
    """Once the script has ended, a SIGTERM (torchrun stopping the ranks after one failed) must
    not cut the writing of this rank's report short: it is ignored for the few seconds that takes
    (torchrun sends SIGKILL after its grace period anyway). A script's own handler is left alone."""
    if signal.getsignal(signal.SIGTERM) is _raise_terminated:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def ranks_written(folder: str) -> list[int]:
    """The ranks whose report is in ``folder``."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _RANK_NAME.fullmatch(n)))


def clear_rank_reports(folder: str) -> None:
    """Remove an earlier run's reports: they would pass for this run's."""
    for r in ranks_written(folder):
        os.unlink(os.path.join(folder, RANK_FILE.format(rank=r)))


def read_rank_reports(folder: str, world_size: int) -> dict[int, dict | None]:
    out: dict[int, dict | None] = {}
    for r in range(world_size):
        try:
            with open(os.path.join(folder, RANK_FILE.format(rank=r)), encoding="utf-8") as f:
                out[r] = json.load(f)
        except (OSError, ValueError):
            out[r] = None
    return out


def wait_for_ranks(folder: str, world_size: int, timeout: float) -> dict[int, dict | None]:
    """Rank 0's wait, under a bare torchrun, for the others' files (bounded by ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        if set(range(world_size)) <= set(ranks_written(folder)) or time.monotonic() >= deadline:
            return read_rank_reports(folder, world_size)
        time.sleep(0.2)


# -- merging ------------------------------------------------------------------------------------
def _first_key(first: dict, rank: int) -> tuple:
    return (first.get("step") if first.get("step") is not None else math.inf,
            _PHASE_ORDER.get(first.get("phase"), 9), rank)


def _max(values):
    vals = [v for v in values if v is not None]
    return max(vals) if vals else None


def _min(values):
    vals = [v for v in values if v is not None]
    return min(vals) if vals else None


def _merge_rows(per_rank: list[tuple[int, dict]]) -> dict:
    """One module row from each rank's row of the same (module, phase)."""
    rows = [r for _, r in per_rank]
    base = dict(rows[0])
    el = [r.get("elements") or 0.0 for r in rows]
    total = sum(el)

    def weighted(key):
        if not total:
            return max(r[key] for r in rows)
        return sum(r[key] * e for r, e in zip(rows, el)) / total

    absmax = {rank: r["absmax"] for rank, r in per_rank}
    nonfinite = {rank: sum(r["nonfinite"].values()) for rank, r in per_rank}
    bad = [rank for rank, n in nonfinite.items() if n]
    if bad:
        first_bad = {rank: r.get("first_nonfinite_step") for rank, r in per_rank}
        holder = min(bad, key=lambda k: (first_bad[k] if first_bad[k] is not None else math.inf, k))
    else:
        holder = max(absmax, key=lambda k: (absmax[k] if absmax[k] is not None else -1.0, -k))
    steps: dict[int, float] = {}
    for r in rows:
        for s, v in r.get("absmax_by_step") or []:
            cur = steps.get(s)
            steps[s] = v if cur is None else cur if v is None else max(cur, v)
    base.update(
        dtype=",".join(sorted({d for r in rows for d in (r["dtype"] or "").split(",") if d})),
        calls=sum(r["calls"] for r in rows),
        absmax=_max(absmax.values()),
        absmax_min=_min(absmax.values()),
        min_nonzero=_min(r["min_nonzero"] for r in rows),
        nonfinite={k: sum(r["nonfinite"][k] for r in rows) for k in rows[0]["nonfinite"]},
        overflow_fraction=weighted("overflow_fraction"),
        underflow_fraction=weighted("underflow_fraction"),
        zero_fraction=weighted("zero_fraction"),
        headroom_bits=_min(r["headroom_bits"] for r in rows),
        first_nonfinite_step=_min(r["first_nonfinite_step"] for r in rows),
        elements=total,
        absmax_by_step=sorted(steps.items()),
        rank=holder,
        ranks={str(rank): {"absmax": absmax[rank], "nonfinite": nonfinite[rank]} for rank, _ in per_rank},
        origin=False,
    )
    return base


def merge(reports: dict[int, dict | None], world_size: int) -> dict:
    """One report from the ranks' reports: which rank and step first went non-finite, which ranks
    skipped which steps, per-layer ranges over the ranks and the rank holding each maximum."""
    present = sorted(r for r, rep in reports.items() if rep is not None)
    missing = [r for r in range(world_size) if reports.get(r) is None]
    if not present:
        raise ValueError("no rank left a report")
    reps = {r: reports[r] for r in present}
    lead = reps[present[0]]

    # the first non-finite value over all ranks: earliest step, then forward before backward, then rank
    firsts = [(r, rep["first_nonfinite"]) for r, rep in reps.items() if rep.get("first_nonfinite")]
    first = None
    if firsts:
        frank, f = min(firsts, key=lambda x: _first_key(x[1], x[0]))
        first = dict(f, rank=frank)

    findings = []
    seen: dict[tuple, dict] = {}
    for r, rep in reps.items():
        for f in rep["findings"]:
            key = (f["kind"], f.get("module"), f["phase"], f.get("step"), tuple(f.get("params") or ()))
            if key in seen:
                seen[key]["ranks"].append(r)
                continue
            g = dict(f, rank=r, ranks=[r])
            if g.get("origin") and first is not None and (r, f.get("module"), f["phase"], f.get("step")) != (
                    first["rank"], first.get("module"), first["phase"], first.get("step")):
                g["origin"] = False  # this rank's own origin follows the first one
                g["follows"] = {"rank": first["rank"], "step": first.get("step")}
            seen[key] = g
            findings.append(g)
    findings.sort(key=lambda g: (not g.get("origin"), g.get("step") if g.get("step") is not None else math.inf,
                                 g["rank"]))

    by_key: dict[tuple, list[tuple[int, dict]]] = {}
    order: list[tuple] = []
    for r, rep in reps.items():
        for row in rep["modules"]:
            k = (row["module"], row["phase"])
            if k not in by_key:
                by_key[k] = []
                order.append(k)
            by_key[k].append((r, row))
    modules = [_merge_rows(by_key[k]) for k in order]
    if first is not None:
        for row in modules:
            if (row["module"], row["phase"]) == (first.get("module"), first["phase"]):
                row["origin"] = True
                row["rank"] = first["rank"]

    params: dict[str, dict] = {}
    for r, rep in reps.items():
        for p in rep.get("params") or []:
            q = params.get(p["param"])
            if q is None:
                params[p["param"]] = dict(p, rank=r)
            else:
                q["absmax"] = _max([q["absmax"], p["absmax"]])
                q["nonfinite_steps"] = max(q["nonfinite_steps"], p["nonfinite_steps"])
                q["first_nonfinite_step"] = _min([q["first_nonfinite_step"], p["first_nonfinite_step"]])

    ranks = []
    for r in range(world_size):
        rep = reports.get(r)
        if rep is None:
            ranks.append({"rank": r, "status": "missing", "note": "no report: the process was killed or crashed "
                          "before its script ended"})
            continue
        script = rep.get("script") or {}
        scaler = rep.get("scaler") or {}
        ranks.append({
            "rank": r, "host": rep.get("host"), "local_rank": rep.get("local_rank"),
            "status": "raised" if script.get("error") else "ok" if not script.get("exit_code") else "failed",
            "exit_code": script.get("exit_code"), "error_summary": first_line(script.get("error_summary")),
            "ended_at": rep.get("ended_at"),
            "steps": rep["steps"], "optimizer_steps": rep["optimizer_steps"], "transfers": rep["transfers"],
            "first_nonfinite": rep.get("first_nonfinite"),
            "skipped_steps": [s["step"] for s in scaler.get("steps") or [] if s.get("skipped")],
            "scaler": rep.get("scaler"),
            "findings": len(rep["findings"]),
        })

    notes = []
    for rep in reps.values():
        for n in rep.get("notes") or []:
            if n not in notes:
                notes.append(n)
    dist_notes = [GRADIENT_NOTE]
    if missing:
        dist_notes.insert(0, f"Rank(s) {', '.join(map(str, missing))} left no report (killed or crashed before "
                          "the end of the script); the other ranks are reported.")
    origin_rep = reps[first["rank"]] if first is not None else lead
    loss = origin_rep.get("loss")
    out = {
        "version": lead["version"],
        "target_dtype": lead["target_dtype"],
        "dtypes_seen": sorted({d for rep in reps.values() for d in rep["dtypes_seen"]}),
        "steps": max(rep["steps"] for rep in reps.values()),
        "optimizer_steps": max(rep["optimizer_steps"] for rep in reps.values()),
        "transfers": max(rep["transfers"] for rep in reps.values()),
        "modules_ran": any(rep.get("modules_ran", True) for rep in reps.values()),
        "world_size": world_size,
        "ranks": ranks,
        "findings": findings,
        "first_nonfinite": first,
        "op_origin": origin_rep.get("op_origin"),
        "modules": modules,
        "params": sorted(params.values(), key=param_order),
        "loss": loss,
        "scaler": origin_rep.get("scaler"),
        "not_traced": sorted({m for rep in reps.values() for m in rep.get("not_traced") or []}),
        "skipped_tensors": _sum_counts(rep.get("skipped_tensors") or {} for rep in reps.values()),
        "notes": notes,
        "distributed": {"world_size": world_size, "missing_ranks": missing,
                        "module_gradients": "local, before the all-reduce",
                        "parameter_gradients": "after the all-reduce (.grad at the optimizer step)",
                        "notes": dist_notes},
    }
    return out


def first_failure(reports: dict[int, dict | None]) -> tuple[int, dict] | None:
    """The rank whose script failed first (by the time it ended) and its script section: the
    cause, where the others usually failed after it (a collective whose peer went away)."""
    failed = [(rep.get("ended_at") or math.inf, r, rep["script"]) for r, rep in reports.items()
              if rep is not None and (rep.get("script") or {}).get("error")]
    if not failed:
        return None
    _, r, script = min(failed, key=lambda x: (x[0], x[1]))
    return r, script


def first_line(text: str | None, limit: int = 160) -> str | None:
    """The first line of an error summary, cut to ``limit`` characters."""
    if not text:
        return text
    line = text.strip().splitlines()[0]
    return line if len(line) <= limit else line[:limit - 1] + "…"


def _sum_counts(dicts) -> dict:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items()))

"""Tracer overhead, side by side: untraced vs ampdoctor's Tracer vs HF DebugUnderflowOverflow vs
torch.autograd.detect_anomaly, on a GPT-like model with eager attention in two sizes, training,
and the small one in an evaluation loop (forward under no_grad).

    python benchmarks/trace_bench.py [--reps 15] [--block 5] [--device cpu|cuda]
                                     [--modes-reps 20] [--modes-block 20]
                                     [--only compute|overhead|ranks|modes]
                                     [--amp auto|fp16|bf16|off] [--ranks 2]

The modes section trains the overhead-bound model with every mode of the tracer (full, ``--watch``
and, under autocast, ``--compare fp32``) beside the peers, in float32 and under autocast (fp16 on
CUDA, bf16 on the CPU), in blocks long enough to reach the steady state of a long run; besides
the median step it gives the steady step (the median of the blocks' mean steps, each block's first
step left out), which counts what the tracer does only now and then. On a CPU whose bf16 matmuls
are slow, the autocast table uses ``--block``/``--reps``.

``--ranks N`` (default 2, 0 to skip) adds a DDP job of N processes over gloo on the CPU: each rank
times untraced and traced steps of the overhead-bound model, interleaved, and counts the
collectives issued from Python during its steps, next to one process timed the same way.

Runs inside benchmarks/.venv (created on first use). Times forward + backward + optimizer
step, interleaving the four configurations, and reports medians after warm-up, the ratio to
untraced, and host synchronisations per step (Python-level device-to-host reads for the hook
tools; for detect_anomaly, its C++ check of every backward node). Results go to RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import random
import statistics
import sys
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_env  # noqa: E402

bench_env.ensure(["torch==2.13.0", "transformers==5.24.0", "numpy"])

import torch  # noqa: E402
from torch import nn  # noqa: E402

from ampdoctor.trace import Tracer  # noqa: E402


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, seq: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.register_buffer("bias", torch.tril(torch.ones(seq, seq, dtype=torch.bool)).view(1, 1, seq, seq))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~self.bias[:, :, :t, :t], torch.finfo(att.dtype).min)
        att = torch.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, d, heads, seq):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads, seq)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, layers, d, heads, seq, vocab=2048):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.h = nn.ModuleList(Block(d, heads, seq) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


SIZES = {
    "compute-bound (6 layers, d=512, 8 heads, seq 256, batch 8)": dict(layers=6, d=512, heads=8, seq=256, batch=8),
    "overhead-bound (2 layers, d=128, 4 heads, seq 64, batch 2)": dict(layers=2, d=128, heads=4, seq=64, batch=2),
}


class SyncCounter:
    """Counts Python-level device-to-host reads (item, tolist, cpu, bool, float, format, numpy)."""

    NAMES = ("item", "tolist", "cpu", "__bool__", "__float__", "__format__", "numpy")

    def __init__(self):
        self.count = 0
        self.saved = {}

    def __enter__(self):
        for n in self.NAMES:
            orig = getattr(torch.Tensor, n)
            self.saved[n] = orig

            def wrap(*a, _orig=orig, **k):
                self.count += 1
                return _orig(*a, **k)
            setattr(torch.Tensor, n, wrap)
        return self

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)


def _syncer(dev):
    """Waits for the device (CUDA runs asynchronously; the CPU needs nothing)."""
    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()
    return sync


def _train_step(model, opt, idx, dev, amp_dtype):
    """One training step of the benchmark's GPT (autocast when amp_dtype is given)."""
    def step():
        with torch.autocast(dev.type, dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
            logits = model(idx)
        loss = nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), idx.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def _interleaved(configs, run, sync, n, warmup, reps, later=None) -> dict[str, list[float]]:
    """Per-call times of ``run`` under each configuration: blocks of n calls inside one context
    (its set-up and tear-down not timed), the configurations' blocks interleaved in a new order
    each round (seeded: a block runs after a different one each time, so what one leaves behind
    in the caches and the allocator is not always charged to the same one); the first ``warmup``
    rounds are not kept. ``later``, when given, also gets each configuration's blocks: the mean
    call of each, without its first call (the steady state of a long run)."""
    times = {k: [] for k in configs}
    if later is not None:
        later.update({k: [] for k in configs})
    shuffle = random.Random(0).shuffle
    for rep in range(warmup + reps):
        order = list(configs)
        shuffle(order)
        for name in order:
            gc.collect()  # the garbage of the block before is not this block's cost
            with configs[name]():
                for _ in range(n):
                    sync()
                    t0 = time.perf_counter()
                    run()
                    sync()
                    if rep >= warmup:
                        times[name].append(time.perf_counter() - t0)
            if rep >= warmup and later is not None and n > 1:
                later[name].append(statistics.mean(times[name][1 - n:]))
    return times


def _step_sync_cells(configs, step) -> dict[str, str]:
    """The 'host syncs per step' cells of a training table, counted over 3 steps."""
    cells = {name: str(round(v)) for name, v in _reads_per_call(configs, step, 3).items()}
    if cells.get("ampdoctor --watch", "0") != "0":
        # the watch reads the loss flag once it has reached the host (on CUDA through a
        # non-blocking copy into pinned memory): a read, not a wait for the device
        cells["ampdoctor --watch"] = f"0 waits ({cells['ampdoctor --watch']} read of the landed loss flag)"
    return cells


def _reads_per_call(configs, run, n) -> dict[str, float]:
    """Python-level device-to-host reads per call of ``run`` under each configuration."""
    out = {}
    for name, make in configs.items():
        c = SyncCounter()
        with make():
            for _ in range(n):
                with c:
                    run()
        out[name] = c.count / n
    return out


def backward_nodes(loss) -> int:
    seen, stack = set(), [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        stack.extend(f for f, _ in fn.next_functions)
    return len(seen)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--only", choices=["compute", "overhead", "ranks", "modes"], help="run one of the sections")
    ap.add_argument("--ranks", type=int, default=2, help="processes of the DDP (gloo) section; 0 skips it")
    ap.add_argument("--block", type=int, default=5, help="steps per block inside one context")
    ap.add_argument("--modes-block", type=int, default=20,
                    help="steps per block in the modes tables (long enough to reach the steady state)")
    ap.add_argument("--modes-reps", type=int, default=20, help="blocks per configuration in the modes tables")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads for torch (default: torch's choice)")
    ap.add_argument("--compute-reps", type=int, default=0,
                    help="blocks for the compute-bound model (default: --reps); a slow CPU wants fewer")
    ap.add_argument("--amp", choices=["auto", "fp16", "bf16", "off"], default="auto",
                    help="autocast dtype (auto: fp16 on CUDA; bf16 on a CPU with fast bf16 matmuls, else off)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    amp = args.amp if args.amp != "auto" else ("fp16" if dev.type == "cuda" else
                                              "bf16" if bf16_is_fast(dev) else "off")
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "off": None}[amp]
    try:
        from transformers.debug_utils import DebugUnderflowOverflow
    except Exception as exc:  # pragma: no cover
        DebugUnderflowOverflow = None
        print(f"HF DebugUnderflowOverflow unavailable: {exc}")

    lines = [f"## Tracer overhead ({date.today().isoformat()}, {args.device})", "",
             f"Machine: {bench_env.machine()}; torch {torch.__version__}"
             + (f", {torch.cuda.get_device_name()}" if dev.type == "cuda" else "")
             + f", {torch.get_num_threads()} torch thread{'' if torch.get_num_threads() == 1 else 's'}. "
               "Training: forward+backward+SGD step, fp32 weights"
             + (f" with {amp} autocast" if amp_dtype else " without autocast"
                + (" (this CPU's bf16 matmuls are slow enough to hide any overhead)" if args.amp == "auto" else ""))
             + ". Evaluation: the forward pass alone under no_grad, with no optimizer in the process. "
               f"Each tool's context is entered once per block of {args.block} steps and the steps are "
               f"timed inside it; the blocks of the configurations are interleaved in a new (seeded) order "
               f"each round, {args.reps} blocks each after {args.warmup} warm-up blocks, Python's garbage is "
               "collected before each block (untimed), and the table gives the median step.", ""]
    for label, cfg in SIZES.items():
        if args.only and not label.startswith(args.only):
            continue
        if args.only in ("ranks", "modes"):
            continue
        torch.manual_seed(0)
        model = GPT(cfg["layers"], cfg["d"], cfg["heads"], cfg["seq"]).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        idx = torch.randint(0, 2048, (cfg["batch"], cfg["seq"]), device=dev)

        step = _train_step(model, opt, idx, dev, amp_dtype)
        sync = _syncer(dev)

        configs = {"untraced": contextlib.nullcontext, "ampdoctor Tracer": Tracer,
                   "ampdoctor --watch": lambda: Tracer(mode="watch"),
                   "torch detect_anomaly": lambda: torch.autograd.detect_anomaly(check_nan=True)}
        if DebugUnderflowOverflow is not None:
            configs["HF DebugUnderflowOverflow"] = lambda: HFContext(model, DebugUnderflowOverflow)

        import warnings
        warnings.filterwarnings("ignore")
        reps = args.compute_reps if label.startswith("compute") and args.compute_reps else args.reps
        times = _interleaved(configs, step, sync, args.block, args.warmup, reps)
        syncs = _step_sync_cells(configs, step)
        with torch.autocast(dev.type, dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
            logits = model(idx)
        nodes = backward_nodes(nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), idx.view(-1)))
        syncs["torch detect_anomaly"] = f"{nodes} backward-node checks (C++)"
        base = statistics.median(times["untraced"])
        lines += [f"### {label}", ""] + ([f"{reps} blocks of each configuration.", ""] if reps != args.reps else []) + [
            "| configuration | median step | ratio to untraced | host syncs per step |", "|---|---|---|---|"]
        for name in configs:
            med = statistics.median(times[name])
            lines.append(f"| {name} | {med * 1000:.1f} ms | {med / base:.2f}x | {syncs[name]} |")
        lines.append("")
        print("\n".join(lines[-len(configs) - 4:]), flush=True)
        if label.startswith("overhead"):
            del opt
            lines += evaluation(model, idx, dev, amp_dtype, args, label, DebugUnderflowOverflow, sync)
            print("\n".join(lines[-8:]), flush=True)
    if args.only in (None, "modes"):
        section = modes_section(args, dev, DebugUnderflowOverflow)
        lines += section
        print("\n".join(section), flush=True)
        if args.only == "modes":  # its own section of RESULTS.md
            bench_env.write_results(f"trace-modes-{args.device}", "\n".join(
                [f"## Tracer modes ({date.today().isoformat()}, {args.device})", "",
                 f"Machine: {bench_env.machine()}; torch {torch.__version__}, {torch.get_num_threads()} torch "
                 f"thread(s). Interleaved blocks, in a new (seeded) order each round, after {args.warmup} "
                 "warm-up rounds; Python's garbage is collected before each block (untimed).", "", *section]))
    if args.ranks > 1 and args.only in (None, "ranks"):
        section = ranks_section(args, amp_dtype)
        lines += section
        print("\n".join(section), flush=True)
        if args.only == "ranks":  # its own section of RESULTS.md
            bench_env.write_results(f"trace-ranks-{args.device}", "\n".join(
                [f"## Tracer overhead per rank ({date.today().isoformat()})", "",
                 f"Machine: {bench_env.machine()}; torch {torch.__version__}. {args.reps} interleaved blocks of "
                 f"{args.block} steps per configuration after {args.warmup} warm-up blocks; median step.", "",
                 *section]))
    if not args.only:  # a partial run does not replace the recorded tables
        bench_env.write_results(f"trace-{args.device}", "\n".join(lines))


# -- a DDP job over gloo -----------------------------------------------------------------------
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "gather", "gather_object", "broadcast",
                "broadcast_object_list", "reduce", "scatter", "barrier", "all_to_all", "reduce_scatter")


def _rank_worker(rank: int, world: int, port: int, args, amp_dtype, out_dir: str) -> None:
    """One rank: the overhead-bound model in DDP, untraced and traced blocks interleaved."""
    import json
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    times, collectives = _timed_blocks(args, amp_dtype, wrap=DistributedDataParallel, rank=rank)
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
        json.dump({"times": times, "collectives": collectives}, f)


def _timed_blocks(args, amp_dtype, wrap=None, rank=0):
    """Median-ready step times of untraced and traced blocks (interleaved) of the overhead-bound
    model on the CPU, and the collectives issued from Python per step in each configuration."""
    import torch.distributed as dist

    cfg = SIZES["overhead-bound (2 layers, d=128, 4 heads, seq 64, batch 2)"]
    torch.manual_seed(0)
    model = GPT(cfg["layers"], cfg["d"], cfg["heads"], cfg["seq"])
    if wrap is not None:
        model = wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, 2048, (cfg["batch"], cfg["seq"]), generator=g)
    counts = {"untraced": 0, "ampdoctor Tracer": 0}
    current = ["untraced"]
    saved = {}
    if wrap is not None:
        for n in _COLLECTIVES:
            orig = getattr(dist, n, None)
            if orig is None:
                continue
            saved[n] = orig

            def counting(*a, _orig=orig, **k):
                counts[current[0]] += 1
                return _orig(*a, **k)
            setattr(dist, n, counting)

    def step():
        with torch.autocast("cpu", dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
            logits = model(idx)
        loss = nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), idx.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    configs = {"untraced": contextlib.nullcontext, "ampdoctor Tracer": Tracer}
    times = {k: [] for k in configs}
    steps = {k: 0 for k in configs}
    for rep in range(args.warmup + args.reps):
        for name in (list(configs) if rep % 2 == 0 else list(configs)[::-1]):
            current[0] = name
            gc.collect()
            with configs[name]():
                for _ in range(args.block):
                    t0 = time.perf_counter()
                    step()
                    if rep >= args.warmup:
                        times[name].append(time.perf_counter() - t0)
                        steps[name] += 1
    for n, f in saved.items():
        setattr(dist, n, f)
    return times, {k: counts[k] / max(1, steps[k] + args.warmup * args.block) for k in counts}


def ranks_section(args, amp_dtype) -> list[str]:
    import json
    import socket
    import tempfile

    import torch.multiprocessing as mp

    world = args.ranks
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    single, _ = _timed_blocks(args, amp_dtype)  # one process, one thread: the reference
    torch.set_num_threads(threads)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank_worker, args=(world, port, args, amp_dtype, out), nprocs=world, join=True)
        per_rank = [json.load(open(f"{out}/rank-{r}.json")) for r in range(world)]
    base = statistics.median(single["untraced"])
    ratio1 = statistics.median(single["ampdoctor Tracer"]) / base
    lines = [f"### DDP over gloo, {world} ranks on the CPU (overhead-bound model, one torch thread per rank)", "",
             "Each rank interleaves untraced and traced blocks of its own steps (DDP all-reduces the gradients "
             "in both); a single process of the same model, one thread, is timed the same way first. "
             "Collectives: calls of torch.distributed's Python collectives per step (DDP's own all-reduce runs "
             "in C++ and is not counted).", "",
             "| process | untraced step | traced step | ratio | Python collectives per step (untraced / traced) |",
             "|---|---|---|---|---|",
             f"| single process | {base * 1000:.1f} ms | {statistics.median(single['ampdoctor Tracer']) * 1000:.1f} ms "
             f"| {ratio1:.2f}x | - |"]
    for r, res in enumerate(per_rank):
        u, t = statistics.median(res["times"]["untraced"]), statistics.median(res["times"]["ampdoctor Tracer"])
        c = res["collectives"]
        lines.append(f"| rank {r} of {world} | {u * 1000:.1f} ms | {t * 1000:.1f} ms | {t / u:.2f}x "
                     f"| {c['untraced']:g} / {c['ampdoctor Tracer']:g} |")
    lines.append("")
    return lines


class HFContext:
    """DebugUnderflowOverflow for the length of a block (HF keeps its hooks forever)."""

    def __init__(self, model, debugger) -> None:
        self.model, self.debugger = model, debugger

    def __enter__(self):
        self.dbg = self.debugger(self.model, max_frames_to_save=21)

    def __exit__(self, *exc):
        for m in self.model.modules():
            m._forward_hooks.clear()


def bf16_is_fast(dev) -> bool:
    """Whether bf16 matmuls run at a useful speed here (CPUs without native bf16 emulate it)."""
    a = torch.randn(256, 256, device=dev)
    times = {}
    for dt in (torch.float32, torch.bfloat16):
        x = a.to(dt)
        x @ x
        t0 = time.perf_counter()
        for _ in range(5):
            x @ x
        times[dt] = time.perf_counter() - t0
    return times[torch.bfloat16] < 4 * times[torch.float32]


def modes_section(args, dev, DebugUnderflowOverflow) -> list[str]:
    """Every mode of the tracer side by side with the peers, interleaved block by block, on the
    overhead-bound model: trained in float32 (as in the table above), and under autocast (fp16 on
    CUDA, bf16 on the CPU), where --compare has low-precision calls to re-run."""
    out = []
    for amp_dtype in (None, torch.float16 if dev.type == "cuda" else torch.bfloat16):
        out += _modes_table(args, dev, DebugUnderflowOverflow, amp_dtype)
    return out


def _modes_table(args, dev, DebugUnderflowOverflow, amp_dtype) -> list[str]:
    cfg = SIZES["overhead-bound (2 layers, d=128, 4 heads, seq 64, batch 2)"]
    torch.manual_seed(0)
    model = GPT(cfg["layers"], cfg["d"], cfg["heads"], cfg["seq"]).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    idx = torch.randint(0, 2048, (cfg["batch"], cfg["seq"]), device=dev)

    sync = _syncer(dev)
    step = _train_step(model, opt, idx, dev, amp_dtype)

    configs = {"untraced": contextlib.nullcontext, "ampdoctor (full)": Tracer,
               "ampdoctor --watch": lambda: Tracer(mode="watch")}
    if amp_dtype is not None:
        configs["ampdoctor --compare fp32"] = lambda: Tracer(compare="float32")
    configs["torch detect_anomaly"] = lambda: torch.autograd.detect_anomaly(check_nan=True)
    if DebugUnderflowOverflow is not None:
        configs["HF DebugUnderflowOverflow"] = lambda: HFContext(model, DebugUnderflowOverflow)
    import warnings
    warnings.filterwarnings("ignore")
    slow = amp_dtype is not None and dev.type == "cpu" and not bf16_is_fast(dev)
    block, reps = (args.block, args.reps) if slow else (args.modes_block, args.modes_reps)
    steady: dict[str, list[float]] = {}
    times = _interleaved(configs, step, sync, block, args.warmup, reps, later=steady)
    syncs = _step_sync_cells(configs, step)
    base = statistics.median(times["untraced"])
    base_steady = statistics.median(steady["untraced"])
    how = "in float32, no autocast" if amp_dtype is None else \
        f"under {'fp16' if amp_dtype == torch.float16 else 'bf16'} autocast"
    out = [f"### modes, overhead-bound model trained {how} ({cfg['layers']} layers, d={cfg['d']}, "
           f"{cfg['heads']} heads, seq {cfg['seq']}, batch {cfg['batch']})", "",
           f"{reps} blocks of {block} steps per configuration. Median step: over every step. Steady step: "
           "the median, over the blocks, of a block's mean step without its first one (which pays the "
           "context's set-up); unlike the median step it counts what a long run pays only now and then, "
           "such as the tracer counting a block of samples.", "",
           "| configuration | median step | added per step | ratio to untraced | steady step | ratio "
           "| host syncs per step |",
           "|---|---|---|---|---|---|---|"]
    for name in configs:
        med, typical = statistics.median(times[name]), statistics.median(steady[name])
        out.append(f"| {name} | {med * 1000:.1f} ms | {(med - base) * 1000:+.1f} ms | {med / base:.2f}x | "
                   f"{typical * 1000:.1f} ms | {typical / base_steady:.2f}x | {syncs[name]} |")
    if slow:
        out += ["", "This CPU has no native 16-bit matmuls (autocast's run about 30 times slower than float32 "
                "ones here), so the untraced step is compute-bound and the ratios are small; the added "
                "milliseconds compare the modes."]
    out.append("")
    return out


def evaluation(model, idx, dev, amp_dtype, args, label, DebugUnderflowOverflow, sync) -> list[str]:
    """The forward pass alone under no_grad, as an eval loop runs it (no optimizer exists)."""
    gc.collect()
    model.eval()

    def forward():
        with torch.no_grad(), torch.autocast(dev.type, dtype=amp_dtype or torch.bfloat16,
                                             enabled=amp_dtype is not None):
            return model(idx)

    configs = {"untraced": contextlib.nullcontext, "ampdoctor Tracer": Tracer}
    if DebugUnderflowOverflow is not None:
        configs["HF DebugUnderflowOverflow"] = lambda: HFContext(model, DebugUnderflowOverflow)
    times = _interleaved(configs, forward, sync, args.block * 2, args.warmup, args.reps)
    syncs = {name: f"{v:.2g}" for name, v in _reads_per_call(configs, forward, Tracer.FORWARD_BATCH).items()}
    base = statistics.median(times["untraced"])
    out = [f"### evaluation, {label.split(' (')[0]} model ({label.split('(', 1)[1]}", "",
           "| configuration | median forward | ratio to untraced | host syncs per forward |", "|---|---|---|---|"]
    for name in configs:
        med = statistics.median(times[name])
        out.append(f"| {name} | {med * 1000:.1f} ms | {med / base:.2f}x | {syncs[name]} |")
    out.append("")
    return out


if __name__ == "__main__":
    main()

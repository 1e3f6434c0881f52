from __future__ import annotations

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint import helpers as h
from ampdoctor.lint.semantic import vocabulary as voc
from ampdoctor.lint.rule import FixSpec, Rule
from ampdoctor.lint.semantic import source
from ampdoctor.lint.semantic.facts import facts_of
from ampdoctor.lint.semantic.flow import flow_of

_EMPTY_CACHE = {"torch.cuda.empty_cache", "torch.cuda.memory.empty_cache", "torch.mps.empty_cache",
                "torch.xpu.empty_cache", "torch.npu.empty_cache"}
# reading the allocator's statistics: a loop that calls these measures memory
_MEMORY_STATS = {"torch.cuda.max_memory_allocated", "torch.cuda.memory_allocated", "torch.cuda.max_memory_reserved",
                 "torch.cuda.memory_reserved", "torch.cuda.reset_peak_memory_stats", "torch.cuda.mem_get_info",
                 "torch.cuda.memory_stats", "torch.cuda.reset_max_memory_allocated"}
_BATCHY = ("batch", "loader", "dataloader", "data", "sample", "step", "iter")
# methods trainers call once per batch (HF Trainer, Lightning, custom trainers)
_PER_STEP = {"training_step", "train_step", "train_batch", "training_step_end", "on_train_batch_start",
             "on_train_batch_end", "on_before_optimizer_step", "optimizer_step", "forward_backward",
             "compute_loss"}
_OOM = ("OutOfMemoryError", "RuntimeError", "MemoryError", "Exception")
# a comment next to the call naming who needs the memory outside PyTorch's caching allocator
# (collectives' buffers, a colocated inference engine, offloading): a decision, not a habit.
# "# free memory" is the habit itself and does not count.
_REASON = ("reduce_scatter", "reduce-scatter", "all_gather", "allgather", "nccl", "vllm", "sglang",
           "colocat", "co-locat", "other process", "another process", "offload", "deepspeed", "zero-3",
           "zero3", "fragmentation")


class EmptyCacheInLoop(Rule):
    """``torch.cuda.empty_cache()`` on every batch of a training loop."""

    code = "AMP401"
    name = "empty-cache-in-loop"
    severity = Severity.WARNING
    message = ("`{f}()` runs on every batch: it frees nothing PyTorch would not reuse, forces a device "
               "sync and makes the next allocations slow. Remove it, or call it only between epochs.")
    helper_message = ("`{call}` runs `{f}()` on every batch: `{helper}` empties the cache, which frees "
                      "nothing PyTorch would not reuse, forces a device sync and makes the next allocations slow. "
                      "Call it only between epochs, or drop the `empty_cache()` from it.")
    fix_title = "Remove the `empty_cache()` call"
    fix_availability = "unsafe"
    words = (b"empty_cache",)
    summary = "`torch.cuda.empty_cache()` inside the per-batch training loop."

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        # helpers of this file that empty the cache on every call: (the def, the function name)
        self.helpers: list[tuple[cst.FunctionDef, str]] = []

    def visit_Call(self, node: cst.Call) -> None:
        qn = self.ctx.names.call_name(node)
        if qn not in _EMPTY_CACHE:
            return
        loop = None
        for p in self.ctx.ancestors():
            if isinstance(p, (cst.If, cst.IfExp)):
                return  # guarded (every N steps, on low memory, behind a flag)
            if isinstance(p, (cst.ExceptHandler, cst.Finally)):
                return  # OOM handlers and cleanup
            if isinstance(p, h.LOOPS):
                loop = p
                break
            if isinstance(p, cst.FunctionDef) and p.name.value in _PER_STEP and self._in_class():
                loop = p  # a trainer's per-step method: the framework calls it on every batch
                break
            if isinstance(p, cst.FunctionDef) and not self._explained():
                # a helper (`def free_memory(self): torch.cuda.empty_cache()`): its callers decide
                self.helpers.append((p, qn.replace(".memory", "")))
                return
            if isinstance(p, h.SCOPES):
                return
        if loop is None or (not isinstance(loop, cst.FunctionDef) and not self._per_batch(loop)):
            return
        if self._shared_device() or self._explained():
            return
        self.report(node, self.message.format(f=qn.replace(".memory", "")), self._fix())

    def leave_Module(self, node: cst.Module) -> None:
        """A helper that empties the cache, called unconditionally on every batch of a training
        loop of this file (HALOs' `self.free_memory()` after each optimizer step)."""
        if not self.helpers or self._shared_device():
            return
        graph = facts_of(self.ctx).calls
        for fn_node, f in self.helpers:
            fn = graph.function(fn_node)
            if fn is None:
                continue
            for site in fn.sites:
                if site.caller is None or site.caller.node is fn_node:
                    continue
                loop = None
                for p in flow_of(self.ctx, site.caller.node).ancestors(site.call):
                    if isinstance(p, (cst.If, cst.IfExp, cst.ExceptHandler, cst.Finally)):
                        break
                    if isinstance(p, h.LOOPS):
                        loop = p
                        break
                if loop is not None and self._per_batch(loop):
                    self.report(site.call, self.helper_message.format(call=source.short(site.call, 40), f=f,
                                                                        helper=fn.qualname))

    def _shared_device(self) -> bool:
        """vLLM (or another engine with its own allocator) in the same process: the cached
        blocks PyTorch returns are what that engine allocates from."""
        return any(m == "vllm" or m.startswith("vllm.") for m in self.ctx.names.aliases.values())

    def _explained(self) -> bool:
        st = h.statement_of(self.ctx)
        if st is None:
            return False
        line = st[0]
        comments = [ll.comment.value for ll in line.leading_lines if ll.comment is not None]
        trailing = getattr(line, "trailing_whitespace", None)
        if trailing is not None and trailing.comment is not None:
            comments.append(trailing.comment.value)
        text = " ".join(comments).lower() + " "
        return any(w in text for w in _REASON)

    def _in_class(self) -> bool:
        fn_seen = False
        for p in self.ctx.ancestors():
            if isinstance(p, cst.FunctionDef):
                if fn_seen:
                    return False  # a def nested in the method
                fn_seen = True
            elif isinstance(p, cst.ClassDef):
                return fn_seen
        return False

    def _per_batch(self, loop: cst.CSTNode) -> bool:
        if h.epoch_loop(loop):
            return False
        header_names = [n for part in h.loop_header(loop) for n in h.names_in(part)]
        body_nodes = list(h.walk(loop.body))
        # `for train_batch in self.train_iterator:` iterates batches even when it loops over the
        # micro-batches of each inside
        over_batches = isinstance(loop, cst.For) and any("batch" in n for n in h.names_in(loop.target))
        if not over_batches and any(isinstance(n, h.LOOPS) for n in body_nodes):
            return False  # an outer loop (epochs, or items around an inner loop)
        if any(isinstance(n, cst.Call) and (self.ctx.names.qualified(n.func) or "") in _MEMORY_STATS
               for n in body_nodes):
            return False  # it measures memory per pass (an auto-batch probe): a clean cache is the point
        trains = any(h.method_call(n, "backward") for n in body_nodes)
        batchy = any(any(w in n for w in _BATCHY) for n in header_names)
        return trains or batchy and any(self._optimizer_call(n) for n in body_nodes)

    def _optimizer_call(self, n: cst.CSTNode) -> bool:
        """`optimizer.step()`, `opt.zero_grad()`, `scaler.step(opt)`; not a diffusion sampler's
        `scheduler.step(noise, t, latents)` in a denoising loop (inference, one call per step)."""
        mc = h.method_call(n, "step", "zero_grad")
        if mc is None:
            return False
        names = self.ctx.names
        return voc.is_optimizer(names, mc[0]) or voc.is_scaler(names, mc[0])

    def _fix(self) -> FixSpec | None:
        st = h.statement_of(self.ctx)
        if st is None:
            return None
        line, block = st
        if len(line.body) != 1:
            return None
        body = block.body
        rep = cst.RemoveFromParent() if len(body) > 1 else line.with_changes(body=[cst.Pass()])
        return FixSpec(((line, rep),), safe=False, title=self.fix_title)

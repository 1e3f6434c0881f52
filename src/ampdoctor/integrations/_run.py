"""What the framework callbacks share: open a Tracer for the run, and at its end merge the ranks'
reports (once, over the job's own process group) and write the report on rank zero."""

from __future__ import annotations

from ampdoctor.trace.tracer import Tracer


class TracedRun:
    def __init__(self, output: str, fmt: str | None, target: str | None, grads: bool, ops: bool,
                 width: int) -> None:
        self.output, self.fmt, self.width = output, fmt, width
        self.tracer = Tracer(target=target, grads=grads, ops=ops)
        self.report: dict | None = None

    def start(self) -> None:
        self.tracer.__enter__()

    def finish(self, is_writer: bool | None = None, gather: bool = True) -> dict:
        """Close the tracer and build the report; in a job of several processes, gather every
        rank's report on rank 0 (one ``gather_object`` at the end of training, when every rank
        has reached it) and merge them. The writer (rank zero by default) writes the file. Without
        ``gather`` (training failed: the other ranks may never get here), each rank keeps its own."""
        self.tracer.close()
        report = self.tracer.report()
        rank, world = _rank_world()
        if world > 1 and gather:
            import torch.distributed as dist

            from ampdoctor.trace import distributed as dist_trace

            gathered = [None] * world if rank == 0 else None
            dist.gather_object(report, gathered, dst=0)
            if rank == 0:
                report = dist_trace.merge(dict(enumerate(gathered)), world)
        self.report = report
        if is_writer if is_writer is not None else rank == 0:
            from ampdoctor.report import trace_files as output
            output.write(report, self.output, self.fmt, self.width)
        return report


def _rank_world() -> tuple[int, int]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:  # pragma: no cover - a build without distributed support
        pass
    return 0, 1

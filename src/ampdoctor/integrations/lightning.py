"""Trace a Lightning ``Trainer`` run: add the callback, fit as usual, read the report.

>>> from ampdoctor.integrations.lightning import AmpDoctorCallback
>>> trainer = L.Trainer(precision="16-mixed", callbacks=[AmpDoctorCallback("amp.html")])
>>> trainer.fit(model, loader)   # writes amp.html on global rank zero

Works with ``lightning`` (``lightning.pytorch``) or the older ``pytorch_lightning`` package. The
tracer is opened when fitting starts and closed when it ends; the report is written by global
rank zero, after every rank's report has been gathered and merged there once.
"""

from __future__ import annotations

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the older package name
    from pytorch_lightning.callbacks import Callback

from ampdoctor.integrations._run import TracedRun


class AmpDoctorCallback(Callback):
    """Write an ampdoctor trace report of the fit (same options as the transformers callback)."""

    def __init__(self, output: str = "ampdoctor-trace.json", *, format: str | None = None,
                 target: str | None = None, grads: bool = True, ops: bool = False, width: int = 100) -> None:
        super().__init__()
        self._run = TracedRun(output, format, target, grads, ops, width)
        self.report: dict | None = None

    def on_fit_start(self, trainer, pl_module):
        self._run.start()

    def on_fit_end(self, trainer, pl_module):
        self.report = self._run.finish(is_writer=trainer.is_global_zero)

    def on_exception(self, trainer, pl_module, exception):
        """The fit failed: take the hooks off and write what ran before (this rank's own report;
        no gather, as the other ranks may never reach one)."""
        if self.report is None:
            self.report = self._run.finish(is_writer=trainer.is_global_zero, gather=False)

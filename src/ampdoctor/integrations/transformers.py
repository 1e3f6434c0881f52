"""Trace a Hugging Face ``Trainer`` run: add the callback, train as usual, read the report.

>>> from ampdoctor.integrations.transformers import AmpDoctorCallback
>>> trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[AmpDoctorCallback("amp.html")])
>>> trainer.train()   # writes amp.html on the main process

The tracer is opened when training begins and closed when it ends; the report is written by the
process the Trainer calls world process zero. In a distributed run every rank's report is
gathered on rank 0 once, at the end of training, and merged (the ``ranks`` section of the JSON).
``ampdoctor trace train.py`` traces a Trainer script as it is, without the callback.
"""

from __future__ import annotations

from transformers import TrainerCallback

from ampdoctor.integrations._run import TracedRun


class AmpDoctorCallback(TrainerCallback):
    """Write an ampdoctor trace report of the training run.

    ``output``: the report file (``.json``, ``.html`` or text by its extension, or ``format``);
    ``target``: the format to judge values against (default: the low-precision dtype seen);
    ``grads``: collect gradient statistics; ``ops``: replay the first bad call to name the op.
    After training, ``callback.report`` holds the report as a dict.
    """

    def __init__(self, output: str = "ampdoctor-trace.json", *, format: str | None = None,
                 target: str | None = None, grads: bool = True, ops: bool = False, width: int = 100) -> None:
        self._run = TracedRun(output, format, target, grads, ops, width)
        self.report: dict | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self._run.start()

    def on_train_end(self, args, state, control, **kwargs):
        self.report = self._run.finish(is_writer=state.is_world_process_zero)

"""Runtime numerics tracer (needs torch: ``pip install 'ampdoctor[trace]'``).

>>> from ampdoctor.trace import Tracer
>>> with Tracer() as t:
...     train_one_epoch()
>>> t.report()["findings"]

``Tracer(mode="watch")`` (a ``Watcher``) checks only the loss and the GradScaler's skips until a
step goes wrong, then traces fully from that step on.
"""

from ampdoctor.trace.tracer import StopTracing, Tracer
from ampdoctor.trace.watch import Watcher

__all__ = ["StopTracing", "Tracer", "Watcher"]

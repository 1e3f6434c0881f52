"""Runtime numerics tracer (needs torch: ``pip install 'ampdoctor[trace]'``).

>>> from ampdoctor.trace import Tracer
>>> with Tracer() as t:
...     train_one_epoch()
>>> t.report()["findings"]
"""

from ampdoctor.trace.tracer import StopTracing, Tracer

__all__ = ["StopTracing", "Tracer"]

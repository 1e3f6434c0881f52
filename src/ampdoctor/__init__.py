"""ampdoctor: find mixed-precision (AMP) problems in PyTorch code.

``import ampdoctor`` is cheap and never imports torch; the tracer lives in
``ampdoctor.trace`` and needs the ``trace`` extra.
"""

__version__ = "0.1.0"

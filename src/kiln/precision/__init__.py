"""The precision logger (paper §2.3): where kiln and PyTorch part, op by op, step by step.

    cmp = Comparison(model, "fp32")
    cmp.step(idx, targets)          # forward, backward, statistics of every op and gradient
    print(headline(cmp.summary())); cmp.write("compare/")

PyTorch is the reference and is imported only by this package (and the tests).
"""

from kiln.precision.capture import Capture, reference_name
from kiln.precision.compare import Comparison, headline, markdown
from kiln.precision.stats import TOLERANCE, compare_arrays

__all__ = ["TOLERANCE", "Capture", "Comparison", "compare_arrays", "headline", "markdown", "reference_name"]

"""Step capture: a static training step recorded once as a CUDA graph and replayed."""

from kiln.graph.capture import CapturedStep, GraphCaptureError, before_each_replay, capturing

__all__ = ["CapturedStep", "GraphCaptureError", "before_each_replay", "capturing"]

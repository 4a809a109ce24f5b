"""The errors kiln raises for users: each names the bad value and what is allowed."""


class KilnError(Exception):
    """Base of every error kiln raises for bad input or an unavailable feature."""


class ShapeError(KilnError):
    """Tensor shapes that do not fit an operation."""


class DTypeError(KilnError):
    """A dtype that an operation does not accept, or two dtypes that do not match."""


class DeviceError(KilnError):
    """A device that does not exist here, or tensors on different devices."""


class AutogradError(KilnError):
    """Backward through a freed graph, a tensor changed in place after it was saved, ..."""


class ConfigError(KilnError):
    """A bad configuration value or an unknown preset."""


class DataError(KilnError):
    """A missing, empty, truncated or foreign data file."""


class NotBuiltError(KilnError, NotImplementedError):
    """A part of kiln that is not built yet."""


class GraphCaptureError(KilnError):
    """A step could not be recorded as a CUDA graph (a host sync or an uncapturable call inside it)."""


class DistributedError(KilnError):
    """A collective that failed or timed out (a dead or stalled rank), or a bad process-group call."""

"""Worker-side capture: prefix resolution, splice, delta and background staging."""

from stages.capture.splice import SpliceError, splice_prefix

__all__ = ["SpliceError", "splice_prefix"]

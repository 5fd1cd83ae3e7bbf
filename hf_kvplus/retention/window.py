"""The retention of sliding-window (and chunked) attention layers: only the window can be seen again."""

from ..errors import ConfigError
from .base import Retention


class SlidingWindow(Retention):
    """Keeps the last `window - 1` tokens: with the next query they make a full window.

    The same rule holds for chunked attention (Llama 4): a query never sees more than `chunk - 1`
    earlier tokens, and the mask picks which of them.
    """

    def __init__(self, window: int):
        if window < 1:
            raise ConfigError(f"a sliding window must hold at least 1 token, got window={window}")
        self.window = window

    def visible(self, held: int) -> int:
        return min(held, self.window - 1)

    def excess(self, held: int, new: int) -> int:
        return max(0, held - (self.window - 1))

    def max_length(self) -> int:
        return self.window

    def __repr__(self) -> str:
        return f"SlidingWindow({self.window})"

"""Keep every token: the retention of lossless full-attention layers."""

from .base import Retention


class KeepAll(Retention):
    """Every token seen stays and is visible."""

    def excess(self, held: int, new: int) -> int:
        return 0

    def __repr__(self) -> str:
        return "KeepAll()"

"""A plain-text table in rich's default look, for commands that must start fast.

``cpdpkit profile`` is timed as a whole process against Holistic Trace Analysis, and rich's
import alone is ~0.08 s of a ~0.2 s budget; this draws the same heavy-headed box with
``str`` methods only. Cells are plain text (no markup); columns are as wide as their widest
cell, never wrapped (piped output is read by tools and people alike).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["TextTable"]

Justify = Literal["left", "right"]


@dataclass
class TextTable:
    """Rows of text under a title, with an optional caption below."""

    title: str = ""
    caption: str = ""
    heads: list[str] = field(default_factory=list)
    justify: list[Justify] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)

    def add_column(self, head: str, justify: Justify = "left") -> None:
        self.heads.append(head)
        self.justify.append(justify)

    def add_row(self, *cells: str) -> None:
        if len(cells) != len(self.heads):
            raise ValueError(f"a row of {len(cells)} cells in a table of {len(self.heads)} columns")
        self.rows.append(list(cells))

    def render(self) -> str:
        """The table as lines: title, a heavy header box, the rows, the caption."""
        widths = [max(len(h), *(len(r[i]) for r in self.rows)) for i, h in enumerate(self.heads)]

        def line(cells: list[str], bar: str) -> str:
            padded = (c.rjust(w) if j == "right" else c.ljust(w) for c, w, j in zip(cells, widths, self.justify))
            return bar + bar.join(f" {p} " for p in padded) + bar

        def rule(left: str, fill: str, mid: str, right: str) -> str:
            return left + mid.join(fill * (w + 2) for w in widths) + right

        out = [self.title] if self.title else []
        out += [rule("┏", "━", "┳", "┓"), line(self.heads, "┃"), rule("┡", "━", "╇", "┩")]
        out += [line(r, "│") for r in self.rows]
        out.append(rule("└", "─", "┴", "┘"))
        if self.caption:
            out.append(self.caption)
        return "\n".join(out)

"""The report as plain data: sections of paragraphs, lists, tables, images and code.

``content`` builds one ``Document``; ``html`` and ``markdown`` render that same document,
so the two formats cannot drift apart. Text is plain (renderers escape it); the only markup
is the block type.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Paragraph", "Bullets", "Table", "Image", "Code", "Block", "Section", "Document"]


@dataclass(frozen=True)
class Paragraph:
    """A paragraph of plain text."""

    text: str


@dataclass(frozen=True)
class Bullets:
    """An unordered list of plain-text items."""

    items: tuple[str, ...]


@dataclass(frozen=True)
class Table:
    """A table of already formatted cells.

    Invariants: every row has ``len(header)`` cells; ``numeric`` (same length) marks the
    columns to right-align.
    """

    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    numeric: tuple[bool, ...]
    caption: str = ""

    def __post_init__(self) -> None:
        if len(self.numeric) != len(self.header) or any(len(r) != len(self.header) for r in self.rows):
            raise ValueError(f"table {self.caption!r}: rows and alignment must match the {len(self.header)} columns")


@dataclass(frozen=True)
class Image:
    """A PNG plot: embedded in HTML, written beside the Markdown as ``filename``."""

    filename: str
    png: bytes
    alt: str
    caption: str = ""


@dataclass(frozen=True)
class Code:
    """A preformatted block (command lines)."""

    text: str


Block = Paragraph | Bullets | Table | Image | Code


@dataclass(frozen=True)
class Section:
    """A titled part of the report."""

    title: str
    blocks: tuple[Block, ...]


@dataclass(frozen=True)
class Document:
    """A whole report."""

    title: str
    subtitle: str
    sections: tuple[Section, ...]

    def images(self) -> list[Image]:
        """Every image, in reading order."""
        return [block for section in self.sections for block in section.blocks if isinstance(block, Image)]

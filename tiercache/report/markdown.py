"""``report.md``: the same report as GitHub-flavoured Markdown, plots as PNG files beside it."""

from __future__ import annotations

import re

from .document import Block, Bullets, Code, Document, Image, Paragraph, Table

__all__ = ["render_markdown", "escape_markdown", "escape_cell"]

# Characters that start emphasis, code, links, HTML or table cells; escaping them keeps
# trace names like "my_trace_v2" and link names like "dram->hbm" literal.
_SPECIAL = re.compile(r"([\\`*_\[\]<|])")


def escape_markdown(text: str) -> str:
    """Plain text made safe to place in Markdown (also inside table cells)."""
    return _SPECIAL.sub(r"\\\1", text)


def escape_cell(text: str) -> str:
    """Text made safe as one cell of a Markdown table that is also read as plain text (gaps.md,
    printed too): only what would end or join a cell, ``|`` and ``\\``, is escaped, so names
    such as ``leaf_lru`` stay as typed."""
    return text.replace("\\", "\\\\").replace("|", "\\|")


def render_markdown(document: Document) -> str:
    """The whole Markdown file; images are linked by their file names (same folder)."""
    parts = [f"# {escape_markdown(document.title)}", f"*{escape_markdown(document.subtitle)}*"]
    for section in document.sections:
        parts.append(f"## {escape_markdown(section.title)}")
        parts += [_block(b) for b in section.blocks]
    return "\n\n".join(parts) + "\n"


def _block(block: Block) -> str:
    if isinstance(block, Paragraph):
        return escape_markdown(block.text)
    if isinstance(block, Bullets):
        return "\n".join(f"- {escape_markdown(item)}" for item in block.items)
    if isinstance(block, Table):
        return _table(block)
    if isinstance(block, Image):
        caption = f"\n\n*{escape_markdown(block.caption)}*" if block.caption else ""
        return f"![{escape_markdown(block.alt)}]({block.filename}){caption}"
    if isinstance(block, Code):
        return f"```sh\n{block.text}\n```"
    raise TypeError(f"unknown block {type(block).__name__}")


def _row(cells: tuple[str, ...]) -> str:
    return "| " + " | ".join(escape_markdown(c) for c in cells) + " |"


def _table(table: Table) -> str:
    rule = "|" + "|".join("---:" if numeric else "---" for numeric in table.numeric) + "|"
    lines = [_row(table.header), rule] + [_row(row) for row in table.rows]
    if table.caption:
        lines.append(f"\n*{escape_markdown(table.caption)}*")
    return "\n".join(lines)

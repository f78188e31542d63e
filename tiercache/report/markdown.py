"""``report.md``: the same report as GitHub-flavoured Markdown, plots as PNG files beside it."""

from __future__ import annotations

import re

from .document import Block, Bullets, Code, Document, Image, Paragraph, Table

__all__ = ["render_markdown", "escape_markdown"]

# Characters that start emphasis, code, links, HTML or table cells; escaping them keeps
# trace names like "my_trace_v2" and link names like "dram->hbm" literal.
_SPECIAL = re.compile(r"([\\`*_\[\]<|])")
# A run of underscores between two letters or digits: CommonMark (GFM) never reads it as
# emphasis (it is both left- and right-flanking and touches no punctuation).
_INTRAWORD = re.compile(r"(?<=[^\W_])(_+)(?=[^\W_])")


def escape_markdown(text: str, keep_intraword_underscores: bool = False) -> str:
    """Plain text made safe to place in Markdown (also inside table cells): report.md's text and
    every cell of gaps.md and split.md.

    ``keep_intraword_underscores`` leaves underscores between two letters or digits as typed
    (``leaf_lru``, ``my_trace.jsonl``), which renders the same, for tables that are also read
    as plain text (gaps.md and split.md, printed too); every other special character is escaped
    either way. A line break (a file name may hold one) is written as a visible ``\\n`` or
    ``\\r``: the result is always one line, so it never ends a table row or a heading."""
    if not keep_intraword_underscores:
        return _one_line(_SPECIAL.sub(r"\\\1", text))
    parts = _INTRAWORD.split(text)  # odd items: the underscore runs kept
    return _one_line("".join(part if i % 2 else _SPECIAL.sub(r"\\\1", part) for i, part in enumerate(parts)))


def _one_line(text: str) -> str:
    """``text`` with its line breaks written as ``\\n`` and ``\\r`` (after the backslashes of
    the text itself were escaped, so these two stay single)."""
    return text.replace("\n", "\\n").replace("\r", "\\r")


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
        fence = _fence(block.text)
        return f"{fence}sh\n{block.text}\n{fence}"
    raise TypeError(f"unknown block {type(block).__name__}")


def _fence(text: str) -> str:
    """A backtick fence longer than any run of backticks in ``text``, so no line of it (a
    trace name holding a newline and backticks) can close the code block early."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)


def _row(cells: tuple[str, ...]) -> str:
    return "| " + " | ".join(escape_markdown(c) for c in cells) + " |"


def _table(table: Table) -> str:
    rule = "|" + "|".join("---:" if numeric else "---" for numeric in table.numeric) + "|"
    lines = [_row(table.header), rule] + [_row(row) for row in table.rows]
    if table.caption:
        lines.append(f"\n*{escape_markdown(table.caption)}*")
    return "\n".join(lines)

"""``index.html``: the report as one self-contained page (plots embedded as base64 PNG).

No external CSS, fonts or scripts, so the file opens offline and can be mailed or attached
as is. Every piece of text goes through ``html.escape``.
"""

from __future__ import annotations

import base64
from html import escape

from .document import Block, Bullets, Code, Document, Image, Paragraph, Section, Table

__all__ = ["render_html"]

_STYLE = """
body { font: 15px/1.5 -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; color: #1d1d1f;
       max-width: 1400px; margin: 0 auto; padding: 24px 28px 64px; background: #fff; }
h1 { font-size: 26px; margin: 0 0 4px; }
h2 { font-size: 20px; margin: 36px 0 10px; padding-bottom: 4px; border-bottom: 1px solid #ddd; }
.subtitle { color: #555; margin: 0 0 16px; }
nav { background: #f5f6f8; border-radius: 6px; padding: 8px 14px; margin-bottom: 8px; font-size: 14px; }
nav a { margin-right: 16px; color: #2255aa; text-decoration: none; }
p, li { max-width: 920px; }
.table-wrap { overflow-x: auto; max-width: 100%; margin: 10px 0 18px; }
table { border-collapse: collapse; font-size: 13px; }
caption { caption-side: bottom; text-align: left; color: #666; font-size: 12px; padding-top: 6px; }
th, td { padding: 4px 8px; border-bottom: 1px solid #e6e6e6; white-space: nowrap; }
th { background: #f5f6f8; text-align: left; font-weight: 600; white-space: normal; vertical-align: bottom;
     min-width: 4.5em; }
td.wrap { white-space: normal; min-width: 11em; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
tbody tr:hover { background: #fafbfd; }
figure { margin: 14px 0 22px; }
figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { color: #555; font-size: 13px; margin-top: 4px; }
pre { background: #f5f6f8; padding: 10px 14px; border-radius: 6px; overflow-x: auto; font-size: 13px;
      white-space: pre-wrap; overflow-wrap: anywhere; }
"""


_WRAP_AFTER = 24


def render_html(document: Document) -> str:
    """The whole page."""
    nav = " ".join(f'<a href="#{_anchor(i)}">{escape(s.title)}</a>' for i, s in enumerate(document.sections))
    body = "\n".join(_section(i, s) for i, s in enumerate(document.sections))
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{escape(document.title)}</title>\n<style>{_STYLE}</style>\n</head>\n<body>\n"
        f"<h1>{escape(document.title)}</h1>\n<p class=\"subtitle\">{escape(document.subtitle)}</p>\n"
        f"<nav>{nav}</nav>\n{body}\n</body>\n</html>\n"
    )


def _anchor(index: int) -> str:
    return f"s{index + 1}"


def _section(index: int, section: Section) -> str:
    blocks = "\n".join(_block(b) for b in section.blocks)
    return f'<section id="{_anchor(index)}">\n<h2>{escape(section.title)}</h2>\n{blocks}\n</section>'


def _block(block: Block) -> str:
    if isinstance(block, Paragraph):
        return f"<p>{escape(block.text)}</p>"
    if isinstance(block, Bullets):
        return "<ul>" + "".join(f"<li>{escape(item)}</li>" for item in block.items) + "</ul>"
    if isinstance(block, Table):
        return _table(block)
    if isinstance(block, Image):
        return _image(block)
    if isinstance(block, Code):
        return f"<pre><code>{escape(block.text)}</code></pre>"
    raise TypeError(f"unknown block {type(block).__name__}")


def _cell(tag: str, text: str, numeric: bool) -> str:
    # Long text cells (a hierarchy's tiers, a preset's note) may wrap; numbers never do.
    cls = ' class="num"' if numeric else (' class="wrap"' if tag == "td" and len(text) > _WRAP_AFTER else "")
    return f"<{tag}{cls}>{escape(text)}</{tag}>"


def _table(table: Table) -> str:
    head = ""
    if any(table.header):
        head = "<thead><tr>" + "".join(_cell("th", h, n) for h, n in zip(table.header, table.numeric)) + "</tr></thead>"
    rows = "".join("<tr>" + "".join(_cell("td", c, n) for c, n in zip(row, table.numeric)) + "</tr>" for row in table.rows)
    caption = f"<caption>{escape(table.caption)}</caption>" if table.caption else ""
    # Wide tables scroll sideways inside their own box (headers wrap first); the page never clips them.
    label = escape(table.caption or "table", quote=True)
    return (f'<div class="table-wrap" role="region" tabindex="0" aria-label="{label}">'
            f"<table>{caption}{head}<tbody>{rows}</tbody></table></div>")


def _image(image: Image) -> str:
    data = base64.b64encode(image.png).decode("ascii")
    caption = f"<figcaption>{escape(image.caption)}</figcaption>" if image.caption else ""
    return f'<figure><img src="data:image/png;base64,{data}" alt="{escape(image.alt)}">{caption}</figure>'

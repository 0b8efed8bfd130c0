"""Plain text out of the formats Debian's documentation packages ship (for the offline corpus).

Each function takes the text of one file and returns readable prose: markup removed, headings and
paragraph breaks kept. They are deliberately simple (regular expressions and the standard
library's HTML parser): the goal is English text for language-model training, not a faithful
rendering.

* :func:`html_text` -- HTML pages (PostgreSQL, Debian handbook, R and SBCL manuals).
* :func:`roff_text` -- man pages in roff (``manpages``, ``manpages-dev``, ``tcl8.6-doc``).
* :func:`pod_text` -- Perl's POD (``perl-doc``).
"""

from __future__ import annotations

import re
from html.parser import HTMLParser

__all__ = ["html_text", "pod_text", "roff_text"]

_BLOCK_TAGS = {
    "p", "div", "br", "li", "ul", "ol", "dl", "dt", "dd", "tr", "table", "pre", "section",
    "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "title", "hr", "td", "th",
}  # fmt: skip
_SKIP_TAGS = {"script", "style", "head", "nav"}


class _TextCollector(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip = 0
        self.pre = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _SKIP_TAGS:
            self.skip += 1
        elif tag in _BLOCK_TAGS:
            self.parts.append("\n\n")
        if tag == "pre":
            self.pre += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in _SKIP_TAGS:
            self.skip = max(0, self.skip - 1)
        elif tag in _BLOCK_TAGS:
            self.parts.append("\n\n")
        if tag == "pre":
            self.pre = max(0, self.pre - 1)

    def handle_data(self, data: str) -> None:
        if self.skip:
            return
        self.parts.append(data if self.pre else re.sub(r"\s+", " ", data))


def _tidy(text: str) -> str:
    lines = [line.rstrip() for line in text.splitlines()]
    text = "\n".join(lines)
    text = re.sub(r"[ \t]+\n", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return re.sub(r"^[ \t]+(?=\S)", "", text, flags=re.MULTILINE).strip()


def html_text(html: str) -> str:
    """Visible text of an HTML page: scripts, styles, ``<head>`` and ``<nav>`` dropped, block
    elements separated by blank lines, ``<pre>`` kept verbatim, entities decoded."""
    parser = _TextCollector()
    parser.feed(html)
    parser.close()
    return _tidy("".join(parser.parts))


_ROFF_ESCAPES = [
    (re.compile(r"\\f(?:\[[^\]]*\]|\(..|.)"), ""),  # font changes \fB \fI \fR \fP \f(CW \f[B]
    (re.compile(r"\\s[+-]?\d"), ""),  # size changes
    (re.compile(r"\\\*\(.."), ""),  # string registers \*(lq
    (re.compile(r"\\\*\[[^\]]*\]"), ""),
    (re.compile(r"\\\(em|\\\(en"), "-"),
    (re.compile(r"\\\([lr]q|\\\(dq"), '"'),
    (re.compile(r"\\\(..|\\\[[^\]]*\]"), ""),  # other special characters
    (re.compile(r"\\[-&e]"), lambda m: {"\\-": "-", "\\&": "", "\\e": "\\"}[m.group(0)]),
    (re.compile(r"\\[|^~0 ]"), " "),
    (re.compile(r"\\c$"), ""),
]
#: roff requests whose arguments are text to keep (headings, font macros, list items)
_ROFF_TEXT_MACROS = {"SH", "SS", "B", "I", "BR", "IR", "RB", "RI", "BI", "IB", "SM", "TP", "IP"}


def roff_text(roff: str) -> str:
    """Text of a man page in roff (``man`` macros): comments and layout requests dropped, the
    arguments of heading and font macros kept, escapes resolved, paragraphs at ``.PP``/``.SH``."""
    out: list[str] = []
    for raw in roff.splitlines():
        line = raw.rstrip()
        if line.startswith(('.\\"', "'\\\"", '\\"')):
            continue
        if line.startswith((".", "'")):
            name, _, rest = line[1:].strip().partition(" ")
            if name in ("SH", "SS"):
                out.append("\n" + rest.replace('"', "").strip() + "\n")
            elif name in ("PP", "P", "LP", "sp", "br") or (name in ("TP", "IP") and not rest):
                out.append("")
            elif name in _ROFF_TEXT_MACROS and rest:
                words = re.findall(r'"[^"]*"|\S+', rest)
                joiner = " " if name in ("B", "I", "SM", "TP", "IP") else ""
                out.append(joiner.join(w.strip('"') for w in words))
            continue
        for pattern, repl in _ROFF_ESCAPES:
            line = pattern.sub(repl, line)
        out.append(line)
    return _tidy("\n".join(out))


_POD_CODE = re.compile(r"[BCEFIJLSXZ]<<+\s+(.*?)\s+>>+|[BCEFIJLSXZ]<([^<>]*)>", re.DOTALL)
_POD_ENTITIES = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/"}


def _pod_inline(text: str) -> str:
    def repl(m: re.Match[str]) -> str:
        inner = m.group(1) if m.group(1) is not None else m.group(2)
        code = m.group(0)[0]
        if code == "E":
            return _POD_ENTITIES.get(inner, "")
        if code in "XZ":
            return ""
        if code == "L":  # L<text|target> or L<target>
            inner = inner.split("|", 1)[0]
        return inner

    for _ in range(4):  # nested codes: B<I<x>>
        new = _POD_CODE.sub(repl, text)
        if new == text:
            break
        text = new
    return text


def pod_text(pod: str) -> str:
    """Text of a Perl POD document: ``=head``/``=item`` text kept, other commands and
    ``=begin``/``=end`` blocks dropped, formatting codes (``B<>``, ``C<>``, ``L<>``...) resolved."""
    out: list[str] = []
    skipping = False
    for line in pod.splitlines():
        if line.startswith("="):
            cmd, _, rest = line[1:].partition(" ")
            if cmd in ("begin", "for"):
                skipping = cmd == "begin"
            elif cmd == "end":
                skipping = False
            elif cmd.startswith("head") or cmd == "item":
                out.append("\n" + _pod_inline(rest.strip()) + "\n")
            continue
        if not skipping:
            out.append(_pod_inline(line))
    return _tidy("\n".join(out))

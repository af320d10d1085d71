"""MkDocs hook that includes a repository file outside docs/ (benchmarks/RESULTS.md) in a page of the site.

A page asks for it with a line `<!-- include: benchmarks/RESULTS.md -->` (invisible where the page is read as plain
markdown). The file's headings move one level down, under the page's own title, and its links to files beside it,
which the site does not serve, become their repository paths in plain text; links within the page stay links.
"""
from __future__ import annotations

import posixpath
import re
from pathlib import Path

INCLUDE = re.compile(r"^<!-- include: (?P<path>[\w./-]+) -->$", re.M)
# [text](target) or ![alt](target "title"); the target without spaces.
LINK = re.compile(r"(?P<image>!?)\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,5}) ", re.M)
FENCE = re.compile(r"^(```|~~~)")


def _plain_link(match: re.Match, folder: str) -> str:
    target = match["target"]
    if target.startswith("#") or re.match(r"^[a-z][a-z0-9+.-]*:", target):
        return match[0]  # an anchor on this page, or a URL: it works in the site as it is
    path = posixpath.normpath(posixpath.join(folder, target)) + ("/" if target.endswith("/") else "")
    named = match["text"].strip("`")
    if not named or path.endswith(named):  # the text already names the file: the path alone says it
        return f"`{path}`"
    return f"{match['text']} (`{path}`)"


def included_text(root: Path, relative: str) -> str:
    """The file at `root/relative`, ready to sit under a page's title: headings one level down, outside links as
    repository paths. Fenced code is left as it is."""
    folder = posixpath.dirname(relative)
    out, fenced = [], False
    for line in (root / relative).read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
        if not fenced:
            line = HEADING.sub(lambda m: "#" + m[1] + " ", line)
            line = LINK.sub(lambda m: _plain_link(m, folder), line)
        out.append(line)
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
    root = Path(config["config_file_path"]).parent
    return INCLUDE.sub(lambda m: included_text(root, m["path"]), markdown)

"""The Python examples of README.md and of the documentation pages in
docs/ work as pasted, and their relative links lead somewhere.

Every ```python block of README.md and docs/*.md is compiled, and checked for names it
uses but neither defines, imports nor gets from Python's builtins (a
function the reader was meant to guess). Then each is run, as a new Python
process against a real server: an example addresses the server as
127.0.0.1:8888, which the test points at its own. An HTML comment on the
line before a block changes that:

    <!-- example needs: MODULE -->       run only if MODULE can be imported
                                          (an optional extra), else skipped
    <!-- example not run: REASON -->     compiled and checked, not run (it
                                          serves forever, or calls the network)
"""

from __future__ import annotations

import builtins
import importlib.util
import re
import subprocess
import symtable
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The front page and the documentation site's pages (protocol.md,
# security.md and architecture.md among them are links to the root's files).
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# How the examples name the server.
EXAMPLE_SERVER = "127.0.0.1:8888"
RUN_TIMEOUT = 30.0

_BLOCK = re.compile(
    r"(?:<!-- example (?P<marker>needs|not run): (?P<what>[^>]*?) -->\n)?"
    r"^```python\n(?P<code>.*?)^```$",
    re.S | re.M,
)


@dataclass(frozen=True)
class Example:
    page: str
    line: int
    code: str
    marker: str | None
    what: str

    def __str__(self) -> str:
        return f"{self.page} line {self.line}"


def examples() -> list[Example]:
    found_all = []
    for page in PAGES:
        text = page.read_text()
        found_all.extend(
            Example(str(page.relative_to(ROOT)), text.count("\n", 0, found.start("code")) + 1,
                    found["code"], found["marker"], (found["what"] or "").strip())
            for found in _BLOCK.finditer(text)
        )
    return found_all


def undefined_names(code: str) -> set[str]:
    """Names a module's code reads (at its top level or inside its
    functions, lambdas and classes) that it never binds nor imports and
    that are not builtins."""
    top = symtable.symtable(code, "example.py", "exec")
    bound = {symbol.get_name() for symbol in top.get_symbols()
             if symbol.is_assigned() or symbol.is_imported()}
    read: set[str] = set()
    tables = [top]
    while tables:
        table = tables.pop()
        tables.extend(table.get_children())
        for symbol in table.get_symbols():
            if symbol.is_referenced() and (table is top or symbol.is_global()):
                read.add(symbol.get_name())
    return read - bound - set(dir(builtins))


def test_the_checks_catch_what_they_are_for():
    assert undefined_names(
        "import os\n"
        "def f(x):\n"
        "    return make_thumbnail(x, lambda: record(os.sep))\n"
        "y = [z for z in range(3)]\n"
        "while (job := len(y)) is None:\n"
        "    print(job)\n"
    ) == {"make_thumbnail", "record"}
    found = _BLOCK.findall("<!-- example needs: anyio -->\n```python\nx = 1\n```\n")
    assert found == [("needs", "anyio", "x = 1\n")]


def test_the_readme_and_the_docs_have_python_examples():
    pages = {example.page for example in examples()}
    assert {"README.md", "docs/client.md", "docs/python-worker.md"} <= pages


# A Markdown link's target, and the code (fenced blocks, `spans`) in which
# brackets and parentheses are no link.
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_CODE = re.compile(r"^ *```.*?^ *```$|`[^`\n]*`", re.S | re.M)


def relative_links(text: str) -> list[str]:
    """The targets of a page's links that name a file of the repository
    (not a web address, nor an anchor of the page itself), anchors cut."""
    targets = _LINK.findall(_CODE.sub("", text))
    return [target.split("#", 1)[0] for target in targets
            if not target.startswith(("http://", "https://", "mailto:", "#"))]


def test_the_link_check_finds_links_outside_code():
    page = "See [a](a.md#x), [b](https://b.example) and `[c](c.md)`.\n```\n[d](d.md)\n```\n"
    assert relative_links(page) == ["a.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_names_a_file_of_the_repository(page):
    # mkdocs build --strict checks the site's links; this checks README's
    # too, as GitHub shows it, and the docs pages' as GitHub shows them.
    for target in relative_links(page.read_text()):
        assert (page.parent / target).exists(), (str(page.relative_to(ROOT)), target)


@pytest.mark.parametrize("example", examples(), ids=str)
def test_a_readme_example_runs_as_pasted(example, server, tmp_path):
    compile(example.code, str(example), "exec")
    assert undefined_names(example.code) == set(), example
    if example.marker == "not run":
        return
    if example.marker == "needs" and importlib.util.find_spec(example.what) is None:
        pytest.skip(f"{example} needs {example.what}, which is not installed")
    code = example.code.replace(EXAMPLE_SERVER, f"127.0.0.1:{server.port}")
    # In a directory of its own: `python -c` imports from its working
    # directory first, and an example may write files.
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT)
    assert done.returncode == 0, (str(example), done.stderr)


def test_the_readme_lists_every_page_of_the_docs():
    # mkdocs build --strict fails on a page missing from mkdocs.yml's nav;
    # this keeps the front page's list as complete. The root's own files
    # (protocol.md, security.md, architecture.md, links in docs/) README
    # names at the root.
    listed = set(relative_links((ROOT / "README.md").read_text()))
    pages = {f"docs/{page.name}" for page in (ROOT / "docs").glob("*.md") if not page.is_symlink()}
    assert pages - listed == set()

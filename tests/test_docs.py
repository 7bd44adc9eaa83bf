"""The README and the docs/ pages: the generated blocks (config reference, own-script contract) are what their
commands print now, and every link between the pages reaches a file and a heading that exist."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import pytest

from tests.doc_blocks import REPO_ROOT, blocks, pages, render

# Each generated block and the page it lives on.
EXPECTED = {"python -m stagewise.config --reference": "docs/configuration.md",
            "python -m stagewise.contract": "docs/your-own-script.md"}
_LINK = re.compile(r"\]\((?!https?://|mailto:)([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)  # a '#' in code is no heading
    return {_anchor(line.lstrip("#")) for line in text.splitlines() if re.match(r"#+ ", line)}


def test_each_generated_block_is_on_its_page_once():
    """Dropping, mangling or moving a marker cannot silence the check below."""
    found = [(block.command, str(page.relative_to(REPO_ROOT))) for page in pages() for block in blocks(page.read_text())]
    assert sorted(found) == sorted(EXPECTED.items())


@pytest.mark.parametrize("command", sorted(EXPECTED))
def test_block_matches_its_command(command):
    """The block is exactly the command's current output: a field doc or a variable changed without the docs fails."""
    page = REPO_ROOT / EXPECTED[command]
    [block] = [block for block in blocks(page.read_text()) if block.command == command]
    expected = render(command)
    if block.body != expected:
        diff = "\n".join(difflib.unified_diff(block.body.splitlines(), expected.splitlines(), EXPECTED[command],
                                              f"`{command}`", lineterm=""))
        pytest.fail(f"{EXPECTED[command]}'s block for `{command}` is out of date; refresh it with "
                    f"`python -m tests.doc_blocks`:\n{diff}", pytrace=False)


def test_every_link_between_the_pages_resolves():
    """A relative link names a file of the repository, and its #anchor a heading of that page."""
    broken = []
    for page in pages():
        for target in _LINK.findall(page.read_text()):
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in _anchors(linked)):
                broken.append(f"{page.relative_to(REPO_ROOT)}: ({target})")
    assert broken == []

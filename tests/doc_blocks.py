"""The generated blocks of the README and the docs/ pages: each is a command's output between two markers, never
edited by hand.

    <!-- BEGIN generated: python -m stagewise.config --reference -->
    ...the command's stdout...
    <!-- END generated -->

tests/test_docs.py fails when a block differs from what its command prints now; refresh them all with
``python -m tests.doc_blocks`` (rewrites the pages in place).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
README = REPO_ROOT / "README.md"
# Only our own generators run: `python -m stagewise.<module> [--flag ...]`.
_BLOCK = re.compile(r"^<!-- BEGIN generated: (?P<command>python -m stagewise\.[\w.]+(?: --[\w-]+)*) -->\n"
                    r"(?P<body>.*?)^<!-- END generated -->$", re.MULTILINE | re.DOTALL)


def pages() -> list[Path]:
    """The README and every docs/ page."""
    return [README, *sorted((REPO_ROOT / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Block:
    command: str
    body: str  # the text between the markers, without the final newline
    start: int  # offsets of the body in the page's text
    end: int


def blocks(text: str) -> list[Block]:
    """Every generated block of a page's text, in order."""
    found = []
    for match in _BLOCK.finditer(text):
        body = match.group("body")
        found.append(Block(match.group("command"), body.removesuffix("\n"), match.start("body"),
                           match.start("body") + len(body)))
    return found


def render(command: str) -> str:
    """What the block's command prints now (run with this interpreter in the repo root), without the final newline."""
    argv = shlex.split(command)
    completed = subprocess.run([sys.executable, *argv[1:]], cwd=REPO_ROOT, capture_output=True, text=True,
                               timeout=120)
    if completed.returncode != 0:
        raise RuntimeError(f"`{command}` failed ({completed.returncode}): {completed.stderr[-2000:]}")
    return completed.stdout.removesuffix("\n")


def refreshed(text: str) -> str:
    """The page's text with every generated block replaced by its command's current output."""
    for block in reversed(blocks(text)):
        body = render(block.command)
        text = text[:block.start] + (body + "\n" if body else "") + text[block.end:]
    return text


def main() -> None:
    for page in pages():
        text = page.read_text()
        if not blocks(text):
            continue
        new = refreshed(text)
        page.write_text(new)
        print(f"{page.relative_to(REPO_ROOT)}: {len(blocks(new))} generated block(s), "
              f"{'rewritten' if new != text else 'already current'}")


if __name__ == "__main__":
    main()

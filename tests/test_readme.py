"""The README's generated blocks (config reference, bring-your-own contract) are what their commands print now."""

from __future__ import annotations

import difflib

import pytest

from tests.readme_blocks import README, blocks, render

EXPECTED_COMMANDS = ["python -m tasks.config --reference", "python -m tasks.contract"]


def test_readme_has_the_generated_blocks():
    """Each generated block is in the README once, so dropping or mangling a marker cannot silence the check below."""
    assert sorted(block.command for block in blocks(README.read_text())) == sorted(EXPECTED_COMMANDS)


@pytest.mark.parametrize("command", EXPECTED_COMMANDS)
def test_readme_block_matches_its_command(command):
    """The block is exactly the command's current output: a field doc or a variable changed without the README fails."""
    matching = [block for block in blocks(README.read_text()) if block.command == command]
    assert len(matching) == 1, f"README.md needs one block marked `<!-- BEGIN generated: {command} -->`"
    block = matching[0]
    expected = render(command)
    if block.body != expected:
        diff = "\n".join(difflib.unified_diff(block.body.splitlines(), expected.splitlines(), "README.md",
                                              f"`{command}`", lineterm=""))
        pytest.fail(f"README.md's block for `{command}` is out of date; refresh it with "
                    f"`python -m tests.readme_blocks`:\n{diff}", pytrace=False)

"""`python -m bench --list`: every benchmark with its goal and one line, whatever its function's docstring holds."""

from __future__ import annotations

import bench.__main__ as cli


def test_list_names_every_benchmark_with_its_goal_even_without_a_docstring(monkeypatch, capsys):
    """A benchmark whose function has no docstring (cache_rerun had none: --list ended in an IndexError), one whose
    docstring opens with a blank line and one that cannot be imported here are each listed with their goal."""

    def undocumented() -> dict:
        return {}

    def documented() -> dict:
        """

        Ours / theirs, on the same data."""
        return {}

    registry = {"undocumented": ("x:undocumented", "<= 0.25"), "documented": ("x:documented", ">= 1.0"),
                "gpu_only": ("x:gpu_only", ">= 0.97")}
    functions = {"undocumented": undocumented, "documented": documented}

    def load(name: str):
        if name not in functions:
            raise ImportError("No module named 'torch'")
        return functions[name]

    monkeypatch.setattr(cli, "BENCHMARKS", registry)
    monkeypatch.setattr(cli, "load", load)
    assert cli.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines] == [["undocumented", "<="], ["documented", ">="], ["gpu_only", ">="]]
    assert [line.split()[2] for line in lines] == ["0.25", "1.0", "0.97"]
    assert lines[0].endswith("(no description)")
    assert lines[1].endswith("Ours / theirs, on the same data.")
    assert lines[2].endswith("(cannot import here: No module named 'torch')")

"""Print the STAGEWISE_* environment a bring-your-own script gets: ``python -m stagewise.contract`` (the table in docs/your-own-script.md).

The variables are declared in ``stagewise.core.contract``.
"""

from __future__ import annotations

import argparse

from stagewise.core import contract


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description="Print the STAGEWISE_* environment of a bring-your-own script as a "
                                        "Markdown table (the list in docs/your-own-script.md).").parse_args(argv)
    print(contract.markdown())


if __name__ == "__main__":
    main()

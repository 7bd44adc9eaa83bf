"""What a spec declares, read from its source without importing it: config validation runs in every process that
parses DAGs, where importing a spec (and torch with it) would cost each parse seconds."""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Sequence
from pathlib import Path


def _module_file(module: str, search: Sequence[str]) -> Path | None:
    """The source file of ``module``: under one of ``search`` (a config's model.import_paths) first, else where the
    import system would find it; None when it cannot be found."""
    relative = Path(*module.split("."))
    for folder in search:
        for candidate in (Path(folder) / relative.with_suffix(".py"), Path(folder) / relative / "__init__.py"):
            if candidate.is_file():
                return candidate
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return Path(found.origin) if found and found.origin and found.origin.endswith(".py") else None


def _declared_keys(tree: ast.Module, class_name: str, seen: set[str]) -> set[str] | None:
    """The string keys of ``class_name``'s ``default_params`` dict literal, following bases defined in the same
    module; None when the class or a literal dict cannot be found."""
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    node = classes.get(class_name)
    if node is None or class_name in seen:
        return None
    seen.add(class_name)
    for statement in node.body:
        targets = statement.targets if isinstance(statement, ast.Assign) else \
            [statement.target] if isinstance(statement, ast.AnnAssign) and statement.value is not None else []
        if any(isinstance(target, ast.Name) and target.id == "default_params" for target in targets):
            value = statement.value
            if isinstance(value, ast.Dict) and all(isinstance(key, ast.Constant) and isinstance(key.value, str)
                                                   for key in value.keys):
                return {key.value for key in value.keys}
            return None
    for base in node.bases:
        if isinstance(base, ast.Name) and (found := _declared_keys(tree, base.id, seen)) is not None:
            return found
    return None


def declared_default_params(spec_path: str, search: Sequence[str] = ()) -> set[str]:
    """The names in the ``default_params`` of the spec at ``module:Class``, as its source declares them; empty when
    the source cannot say (the spec then has only what it declares at run time)."""
    module, _, class_name = spec_path.partition(":")
    source = _module_file(module, search) if module and class_name else None
    if source is None:
        return set()
    try:
        tree = ast.parse(source.read_text(), str(source))
    except (OSError, SyntaxError, ValueError):
        return set()
    return _declared_keys(tree, class_name, set()) or set()

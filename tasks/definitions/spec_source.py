"""What a spec declares, read from its source without importing it: config validation runs in every process that
parses DAGs, where importing a spec (and torch with it) would cost each parse seconds."""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Sequence
from pathlib import Path


def local_module_file(module: str, search: Sequence[str]) -> Path | None:
    """The source file of ``module`` under one of ``search`` (a config's model.import_paths), as the import system
    would find it there; None when no folder of ``search`` holds it."""
    relative = Path(*module.split("."))
    for folder in search:
        for candidate in (Path(folder) / relative.with_suffix(".py"), Path(folder) / relative / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def module_file(module: str, search: Sequence[str]) -> Path | None:
    """The source file of ``module``: under one of ``search`` (a config's model.import_paths) first, else where the
    import system would find it; None when it cannot be found."""
    if (found_locally := local_module_file(module, search)) is not None:
        return found_locally
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
    source = module_file(module, search) if module and class_name else None
    if source is None:
        return set()
    try:
        tree = ast.parse(source.read_text(), str(source))
    except (OSError, SyntaxError, ValueError):
        return set()
    return _declared_keys(tree, class_name, set()) or set()


# The spec base classes and the modules that export them: a class deriving from one of these is a spec.
SPEC_BASES = frozenset({"ModelSpec", "Classifier", "Regressor"})
SPEC_MODULES = frozenset({"stagewise.spec", "stagewise.definitions.spec"})
_FOLLOW_IMPORTS = 4  # modules followed from the spec's to the class's definition, then the source cannot tell


def _source_of(module: str, search: Sequence[str], may_import: bool) -> Path | None:
    """``module``'s source file, found under ``search`` or in its installed top package; importing its parent packages
    only when ``may_import`` (find_spec of a dotted name runs their __init__: a user's, with torch, at every DAG
    parse), else None where only that would find it (an editable install's mapped package)."""
    if (found := local_module_file(module, search)) is not None:
        return found
    if may_import and "." in module:
        return module_file(module, search)
    top, _, rest = module.partition(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if not rest:
        origin = getattr(spec.loader_state, "filename", None) or spec.origin  # a frozen stdlib module's own file
        return Path(origin) if origin and origin.endswith(".py") and Path(origin).is_file() else None
    return local_module_file(rest, list(spec.submodule_search_locations or []))


class _Module:
    """What one module's source defines at its top level (and in its if/try blocks)."""

    def __init__(self, name: str, path: Path) -> None:
        self.name, self.path = name, path
        self.classes: dict[str, ast.ClassDef] = {}
        self.functions: set[str] = set()
        self.imports: dict[str, tuple[str, str]] = {}  # local name -> (module, name there)
        self.modules: dict[str, str] = {}  # local name -> the module `import x.y as z` binds to it
        self.assigned: set[str] = set()
        statements = list(ast.parse(path.read_text(), str(path)).body)
        while statements:
            node = statements.pop(0)
            if isinstance(node, ast.ClassDef):
                self.classes[node.name] = node
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self.functions.add(node.name)
            elif isinstance(node, ast.ImportFrom):
                source = self._absolute(node.module or "", node.level)
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = (source, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    self.modules[alias.asname or alias.name.partition(".")[0]] = alias.name if alias.asname else \
                        alias.name.partition(".")[0]
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                self.assigned |= {target.id for target in targets if isinstance(target, ast.Name)}
            elif isinstance(node, ast.If | ast.Try):
                statements[:0] = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                                  *(line for handler in getattr(node, "handlers", []) for line in handler.body)]

    def _absolute(self, module: str, level: int) -> str:
        if not level:
            return module
        package = self.name if self.path.name == "__init__.py" else self.name.rpartition(".")[0]
        for _ in range(level - 1):
            package = package.rpartition(".")[0]
        return f"{package}.{module}" if module and package else module or package


def _verdict(module: str, name: str, search: Sequence[str], depth: int, seen: set[tuple[str, str]],
             may_import: bool) -> str | None:
    """'' when ``module.name`` is a spec class, None when the source cannot tell, else why it is none."""
    if module in SPEC_MODULES and name in SPEC_BASES:
        return ""
    if depth > _FOLLOW_IMPORTS or (module, name) in seen:
        return None
    seen.add((module, name))
    path = _source_of(module, search, may_import)
    if path is None:
        return None
    try:
        found = _Module(module, path)
    except (OSError, SyntaxError, ValueError):
        return None
    if name in found.imports:
        return _verdict(*found.imports[name], search, depth + 1, seen, may_import)
    if name in found.functions:
        return f"'{name}' in {module} ({path}) is a function, not a class"
    if name in found.assigned:
        return None  # made at run time (an alias, a factory): the import tells
    node = found.classes.get(name)
    if node is None:
        return f"module {module} ({path}) defines no class '{name}'"
    unknown = False
    for base in node.bases:
        if isinstance(base, ast.Attribute) and base.attr in SPEC_BASES:
            return ""  # spec.ModelSpec, stagewise.spec.Classifier
        where = _base_module(found, base)
        if where is not None:
            inner = _verdict(*where, search, depth + (where[0] != module), seen, may_import)
            if inner == "":
                return ""
            unknown |= inner is None
        elif not (isinstance(base, ast.Name) and base.id not in found.assigned):
            unknown = True  # a call, a subscript, a name made at run time
    if unknown:
        return None
    bases = ", ".join(ast.unparse(base) for base in node.bases) or "none"
    return (f"class {name} ({path}, line {node.lineno}) is no ModelSpec subclass (its bases: {bases}); subclass "
            f"stagewise.spec.ModelSpec, Classifier or Regressor")


def _base_module(found: _Module, base: ast.expr) -> tuple[str, str] | None:
    """(module, class name) a base class expression names: a class of the module itself, one it imports, or an
    attribute of a module it imports (``abc.ABC``, ``nn.Module`` after ``from torch import nn``); None otherwise."""
    if isinstance(base, ast.Name):
        if base.id in found.classes:
            return found.name, base.id
        return found.imports.get(base.id)
    if isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
        owner = base.value.id
        if owner in found.modules:
            return found.modules[owner], base.attr
        if owner in found.imports:  # from torch import nn: nn may be a module
            package, name = found.imports[owner]
            return f"{package}.{name}", base.attr
    return None


def spec_problem(spec_path: str, search: Sequence[str] = (), may_import: bool = False) -> str | None:
    """Why the spec at ``module:Class`` is no ModelSpec subclass, as its source shows without importing it (a
    function, another class, nothing of that name: ``os:system``); None when it is one or the source cannot tell
    (a compiled module, a class made at run time: the import at the first stage checks those)."""
    module, _, class_name = spec_path.partition(":")
    return _verdict(module, class_name, search, 0, set(), may_import) or None

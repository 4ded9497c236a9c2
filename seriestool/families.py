"""Static scan of TensorFold's model families in a checkout, and the clash check.

TensorFold finds families by iterating the `tensorfold.families` package; each declares
`MODEL_TYPES`, and two families claiming one `model_type` stop TensorFold at start. The series
tool checks this after every apply, so a rebase onto an upstream that gained its own family for
the kit's model type stops here instead of producing a tree that fails at runtime.

Only `ast` is used: upstream code is never imported or run. `MODEL_TYPES` is read from the
family's `__init__.py` (or a `families/<name>.py` module), following `from .sub import
MODEL_TYPES` into the family's own package; values may be str/tuple/list/set/frozenset literals,
names of constants in the same module, and `+` of those.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

FAMILIES_DIR = PurePosixPath("src/tensorfold/families")
_MAX_IMPORT_DEPTH = 4     # from .a import X, where a does from .b import X, ...


@dataclass
class Family:
    name: str
    file: str                         # the family's entry file, relative to the tree
    model_types: tuple[str, ...] = ()
    declared_in: str = ""             # file:line where MODEL_TYPES was found
    problem: str | None = None        # why it could not be read (syntax error, not static)
    fatal: bool = False               # the file itself is broken: TensorFold could not import it


@dataclass
class Clash:
    model_type: str
    families: list[Family]


@dataclass
class FamilyScan:
    families: list[Family] = field(default_factory=list)

    @property
    def clashes(self) -> list[Clash]:
        claims: dict[str, list[Family]] = {}
        for family in self.families:
            for model_type in dict.fromkeys(family.model_types):
                claims.setdefault(model_type, []).append(family)
        return [Clash(t, fams) for t, fams in sorted(claims.items()) if len(fams) > 1]

    @property
    def broken(self) -> list[Family]:
        return [f for f in self.families if f.fatal]

    @property
    def unreadable(self) -> list[Family]:
        return [f for f in self.families if f.problem and not f.fatal]

    @property
    def ok(self) -> bool:
        return not self.clashes and not self.broken


class _NotStatic(Exception):
    pass


class _Broken(Exception):
    pass


def _parse(path: Path, rel: str) -> ast.Module:
    try:
        return ast.parse(path.read_bytes(), filename=rel)
    except SyntaxError as exc:
        raise _Broken(f"{rel}:{exc.lineno or '?'}: syntax error: {exc.msg}") from None
    except (OSError, ValueError) as exc:
        raise _Broken(f"{rel}: unreadable: {exc}") from None


class _ModuleReader:
    """Resolves a top-level name of one module of a family package to a tuple of strings."""

    def __init__(self, tree: Path, package_dir: Path | None, module_file: Path, depth: int = 0):
        self.tree = tree
        self.package_dir = package_dir          # None for a single-file family module
        self.file = module_file
        self.rel = module_file.relative_to(tree).as_posix()
        self.depth = depth
        self.body = _parse(module_file, self.rel).body

    def lookup(self, name: str) -> tuple[tuple[str, ...], str] | None:
        """(values, 'file:line') of the last top-level binding of `name`, None if unbound."""
        found = None
        for node in self.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name
                                                    for t in node.targets):
                found = ("value", node)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and node.target.id == name and node.value is not None:
                found = ("value", node)
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        found = ("import", node, alias.name)
        if found is None:
            return None
        if found[0] == "value":
            node = found[1]
            return self.evaluate(node.value), f"{self.rel}:{node.lineno}"
        return self.follow(found[1], found[2])

    def evaluate(self, node: ast.expr) -> tuple[str, ...]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return (node.value,)
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            out: list[str] = []
            for item in node.elts:
                out += self.evaluate(item)
            return tuple(out)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("tuple", "list", "set", "frozenset") \
                and len(node.args) == 1 and not node.keywords:
            return self.evaluate(node.args[0])
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self.evaluate(node.left) + self.evaluate(node.right)
        if isinstance(node, ast.Name):
            bound = self.lookup(node.id)
            if bound is None:
                raise _NotStatic(f"{self.rel}:{node.lineno}: {node.id} is not defined at module level")
            return bound[0]
        raise _NotStatic(f"{self.rel}:{node.lineno}: MODEL_TYPES cannot be read statically: "
                         f"`{ast.unparse(node)[:60]}` is not a literal")

    def follow(self, node: ast.ImportFrom, name: str) -> tuple[tuple[str, ...], str]:
        """`from .sub import NAME` within the family's own package (or its absolute spelling)."""
        where = f"{self.rel}:{node.lineno}"
        parts: list[str] | None = None
        if self.package_dir is not None:
            if node.level == 1:
                parts = (node.module or "").split(".") if node.module else []
            elif node.level == 0 and node.module:
                own = f"tensorfold.families.{self.package_dir.name}"
                if node.module == own or node.module.startswith(own + "."):
                    parts = node.module[len(own):].strip(".").split(".") if node.module != own else []
        if parts is None:
            raise _NotStatic(f"{where}: MODEL_TYPES comes from outside the family's package "
                             f"({'.' * node.level}{node.module or ''})")
        if self.depth >= _MAX_IMPORT_DEPTH:
            raise _NotStatic(f"{where}: imports nest too deep")
        target = self.package_dir.joinpath(*parts) if parts else self.package_dir
        candidates = [target / "__init__.py"] if not parts else [target.with_suffix(".py"),
                                                                  target / "__init__.py"]
        for path in candidates:
            if path.is_file():
                reader = _ModuleReader(self.tree, self.package_dir, path, self.depth + 1)
                bound = reader.lookup(name)
                if bound is None:
                    raise _NotStatic(f"{where}: {reader.rel} defines no {name}")
                return bound
        raise _NotStatic(f"{where}: imports {'.'.join(parts) or '__init__'} from the family's "
                         "package, but that file does not exist")


def read_family(tree: Path, name: str, entry: Path, package_dir: Path | None) -> Family:
    family = Family(name=name, file=entry.relative_to(tree).as_posix())
    try:
        reader = _ModuleReader(tree, package_dir, entry)
        bound = reader.lookup("MODEL_TYPES")
        if bound is None:
            family.problem = f"{family.file}: declares no MODEL_TYPES at module level"
        else:
            family.model_types, family.declared_in = bound
    except _Broken as exc:
        family.problem, family.fatal = str(exc), True
    except _NotStatic as exc:
        family.problem = str(exc)
    return family


def scan_families(tree: Path) -> FamilyScan:
    """Every family under src/tensorfold/families of the checkout at `tree` (sorted by name):
    packages `<name>/__init__.py` and single modules `<name>.py`, as package iteration sees them."""
    root = Path(tree) / FAMILIES_DIR
    scan = FamilyScan()
    if not root.is_dir():
        return scan
    for entry in sorted(root.iterdir()):
        if entry.name.startswith((".", "_")):
            continue
        if entry.is_dir() and (entry / "__init__.py").is_file():
            scan.families.append(read_family(Path(tree), entry.name, entry / "__init__.py", entry))
        elif entry.is_file() and entry.suffix == ".py":
            scan.families.append(read_family(Path(tree), entry.stem, entry, None))
    return scan


def family_of_path(path: str) -> str | None:
    """The family a repository path belongs to (src/tensorfold/families/<name>/... or <name>.py)."""
    parts = PurePosixPath(path).parts
    base = FAMILIES_DIR.parts
    if len(parts) <= len(base) or parts[:len(base)] != base:
        return None
    head = parts[len(base)]
    if len(parts) == len(base) + 1:
        return head[:-3] if head.endswith(".py") and head != "__init__.py" else None
    return head


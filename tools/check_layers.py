"""Check cpdpkit's import layering with ``ast`` (a developer tool run by ``make test``; not installed).

Dependencies point one way (docs/contracts.md and README.md show the picture)::

    layer 0  errors, labels, contracts (the sync <-> shard Protocols), _values, the cpdpkit package
    layer 1  network            the one α-β network model; faults (FaultPlan); _text_file (the file reader)
    layer 2  topology           tiers, placement, Topology.group(ranks)
    layer 3  emulator (+ _env), planner, sync, tracing; profiler (installed as cpdpkit.profiler)
    layer 4  shard              the executors that train a plan (they import the planner)
    layer 5  bench, launch (+ _child), checkpoint
    layer 6  cli

Rules, checked over every ``.py`` file under ``cpdpkit/`` and ``profiler/``:

* **layering**: a module imports only its own component and components of lower layers, at
  module level and inside functions alike (``bench`` may also import its peer ``launch``: it runs
  each job through it). So topology/network/labels/errors import nothing above them, and
  emulator/planner/sync never import shard, bench, launch or cli.
* **profiler**: ``cpdpkit.profiler`` imports only ``cpdpkit.errors``, ``cpdpkit.labels``,
  ``cpdpkit.network``, ``cpdpkit.topology`` and itself, and never torch, not even in a function.
* **torch-free**: these modules do not import torch at module level (``cpdpkit --help``,
  ``cpdpkit plan``, ``profile`` and ``topology`` must start without it): ``cpdpkit/__init__``,
  ``errors``, ``labels``, ``contracts``, ``_values``, ``network``, ``faults``, ``_text_file``,
  ``topology``, ``_env``, ``planner/*`` (pure
  planning: the appliers and executors that need torch are ``shard/*``), ``launch``, ``cli/*`` and
  ``profiler/*``. Imports under ``if TYPE_CHECKING:`` and inside functions do not count.
* **torch-free, transitive**: the same modules do not *reach* torch through the module-level
  imports of other cpdpkit modules either; one line per import that leaves the torch-free set
  towards a module that imports torch at import time (``--direct-only`` skips this rule).
* every module belongs to a component: a new top-level module must be added to ``COMPONENTS``.

Prints one line per violation, ``file:line: the import: the rule``, and exits 1 if there is any.

Usage::

    python tools/check_layers.py                  # the repository this file lives in
    python tools/check_layers.py --root DIR       # another tree with cpdpkit/ and profiler/
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_ADD_IT = "add it to COMPONENTS in tools/check_layers.py"

# source folder -> the package name it is installed as (pyproject's package-dir)
SOURCE_DIRS = {"cpdpkit": "cpdpkit", "profiler": "cpdpkit.profiler"}

# component -> (layer, module prefixes). A module belongs to the component with the longest
# matching prefix; "cpdpkit" matches the package's own __init__ only.
COMPONENTS: dict[str, tuple[int, tuple[str, ...]]] = {
    "cpdpkit": (0, ("cpdpkit",)),
    "errors": (0, ("cpdpkit.errors",)),
    "labels": (0, ("cpdpkit.labels",)),
    # the sync <-> shard contract (typing.Protocols): below both, which do not import each other
    "contracts": (0, ("cpdpkit.contracts",)),
    # predicates on user-given values (is_int), shared by every config's validation
    "values": (0, ("cpdpkit._values",)),
    "network": (1, ("cpdpkit.network",)),
    # injected faults as data (the topology's [faults] table; the emulator applies them)
    "faults": (1, ("cpdpkit.faults",)),
    # the one bounded UTF-8 reader of user files (topology, plan, annotations)
    "files": (1, ("cpdpkit._text_file", "cpdpkit._outputs")),
    "topology": (2, ("cpdpkit.topology",)),
    # _env holds the emulator's environment variable outside the package so that reading it
    # does not run cpdpkit/emulator/__init__ (which imports torch)
    "emulator": (3, ("cpdpkit.emulator", "cpdpkit._env")),
    "planner": (3, ("cpdpkit.planner",)),
    "sync": (3, ("cpdpkit.sync",)),
    "tracing": (3, ("cpdpkit.tracing",)),
    "profiler": (3, ("cpdpkit.profiler",)),
    # the executors that train a plan: above the planner they execute, below what runs them
    "shard": (4, ("cpdpkit.shard",)),
    "bench": (5, ("cpdpkit.bench",)),
    # checkpoint saves what sync's optimizer and shard's executors hold (and is used by bench)
    "checkpoint": (5, ("cpdpkit.checkpoint", "cpdpkit._checkpoint_files")),
    # _child is the per-rank entry point torchrun runs for cpdpkit.launch
    "launch": (5, ("cpdpkit.launch", "cpdpkit._child")),
    "cli": (6, ("cpdpkit.cli",)),
}

# (importer, imported) pairs of one layer that may depend on each other, and why
ALLOWED_PEERS = {("bench", "launch"): "bench runs every job through cpdpkit.launch",
                 ("bench", "checkpoint"): "a bench job resumes from its checkpoints after an injected fault"}

PROFILER_MAY_IMPORT = ("cpdpkit", "errors", "labels", "network", "topology", "profiler")

TORCH_FREE = (
    "cpdpkit", "cpdpkit.errors", "cpdpkit.labels", "cpdpkit.contracts", "cpdpkit._values", "cpdpkit.network",
    "cpdpkit.faults", "cpdpkit._text_file", "cpdpkit._outputs", "cpdpkit.topology", "cpdpkit._env", "cpdpkit.planner.*",
    "cpdpkit.launch", "cpdpkit.cli.*", "cpdpkit.profiler.*",
)
TORCH_PACKAGES = ("torch", "torchvision", "torchaudio", "functorch")


@dataclass(frozen=True)
class Import:
    """One import statement's edge: who imports what, where, and whether it runs at import time."""

    module: str  # the importing module
    path: Path
    line: int
    text: str
    target: str  # the imported module (resolved; a submodule when ``from pkg import sub``)
    module_level: bool  # runs when the importer is imported (not in a function, not TYPE_CHECKING)


@dataclass(frozen=True)
class Violation:
    path: Path
    line: int
    text: str
    rule: str

    def format(self, root: Path) -> str:
        try:
            shown = self.path.relative_to(root)
        except ValueError:
            shown = self.path
        return f"{shown}:{self.line}: {self.text}: {self.rule}"


# ---- reading the tree ------------------------------------------------------------------------
def find_modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the source folders of ``root``."""
    modules: dict[str, Path] = {}
    for folder, package in SOURCE_DIRS.items():
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk_imports(tree: ast.Module):  # noqa: ANN202 - a generator of (node, module_level)
    """Every Import/ImportFrom node with whether it runs when the module is imported."""
    stack: list[tuple[ast.AST, bool]] = [(tree, True)]
    while stack:
        node, runs = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, runs
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend((child, False) for child in node.body)
            stack.extend((child, runs) for child in node.orelse)
            continue
        inner = runs and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        stack.extend((child, inner) for child in ast.iter_child_nodes(node))


def _base_package(module: str, path: Path, level: int) -> str:
    parts = module.split(".")
    if path.name != "__init__.py":
        parts = parts[:-1]
    return ".".join(parts[: len(parts) - (level - 1)] if level > 1 else parts)


def _lazy_names(modules: dict[str, Path]) -> dict[str, str]:
    """``cpdpkit/__init__``'s ``_LAZY`` table: public name -> the module that defines it."""
    path = modules.get("cpdpkit")
    if path is None:
        return {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets):
            try:
                table = ast.literal_eval(node.value)
            except ValueError:
                return {}
            return {str(k): str(v) for k, v in table.items()} if isinstance(table, dict) else {}
    return {}


def read_imports(modules: dict[str, Path]) -> tuple[list[Import], list[Violation]]:
    """Every import of every module, resolved to target modules; unparsable files as violations."""
    lazy = _lazy_names(modules)
    out: list[Import] = []
    problems: list[Violation] = []
    for module, path in modules.items():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except SyntaxError as exc:
            problems.append(Violation(path, exc.lineno or 0, "(file)", f"cannot parse: {exc.msg}"))
            continue
        for node, runs in _walk_imports(tree):
            text = ast.unparse(node)
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    pkg = _base_package(module, path, node.level)
                    base = f"{pkg}.{base}" if base else pkg
                targets = []
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in modules:
                        targets.append(sub)
                    elif base == "cpdpkit" and alias.name in lazy:
                        targets.append(lazy[alias.name])
                    else:
                        targets.append(base)
            for target in dict.fromkeys(targets):
                out.append(Import(module, path, node.lineno, text, target, runs))
    return out, problems


# ---- the rules -------------------------------------------------------------------------------
def component_of(module: str) -> str | None:
    best, best_len = None, -1
    for name, (_, prefixes) in COMPONENTS.items():
        for prefix in prefixes:
            exact_only = prefix == "cpdpkit"
            if (module == prefix or (not exact_only and module.startswith(prefix + "."))) and len(prefix) > best_len:
                best, best_len = name, len(prefix)
    return best


def _matches(module: str, patterns: tuple[str, ...]) -> bool:
    for p in patterns:
        if p.endswith(".*"):
            if module == p[:-2] or module.startswith(p[:-1]):
                return True
        elif module == p:
            return True
    return False


def is_torch_free(module: str) -> bool:
    return _matches(module, TORCH_FREE)


def is_torch(target: str) -> bool:
    return target.split(".", 1)[0] in TORCH_PACKAGES


def _layer_rule(imp: Import, src: str, dst: str) -> str | None:
    if src == dst:
        return None
    if src == "profiler":
        if dst not in PROFILER_MAY_IMPORT:
            return ("profiler: cpdpkit.profiler imports only cpdpkit.errors, cpdpkit.labels, "
                    f"cpdpkit.network, cpdpkit.topology and itself, not {dst}")
        return None
    src_layer, dst_layer = COMPONENTS[src][0], COMPONENTS[dst][0]
    if dst_layer < src_layer or (src, dst) in ALLOWED_PEERS:
        return None
    if dst_layer == src_layer:
        return f"layering: {src} and {dst} are peers (layer {src_layer}) and do not import each other"
    return (f"layering: {src} (layer {src_layer}) must not import {dst} (layer {dst_layer}): "
            "dependencies point down (the layers are in tools/check_layers.py)")


def check_imports(imports: list[Import], modules: dict[str, Path]) -> list[Violation]:
    """The layering, profiler and (direct) torch-free rules."""
    found: list[Violation] = []
    for module, path in modules.items():
        if component_of(module) is None:
            found.append(Violation(path, 1, f"(module {module})",
                                   f"unassigned: this module is in no layer; {_ADD_IT}"))
    for imp in imports:
        src = component_of(imp.module)
        if src is None:
            continue
        if is_torch(imp.target):
            if src == "profiler":
                found.append(Violation(imp.path, imp.line, imp.text,
                                       "torch-free: cpdpkit.profiler never imports torch, not even inside a function"))
            elif imp.module_level and is_torch_free(imp.module):
                found.append(Violation(imp.path, imp.line, imp.text,
                                       f"torch-free: {imp.module} must not import torch at module level "
                                       "(import it inside the function that needs it)"))
            continue
        if not (imp.target == "cpdpkit" or imp.target.startswith("cpdpkit.")):
            continue
        dst = component_of(imp.target)
        if dst is None:
            found.append(Violation(imp.path, imp.line, imp.text,
                                   f"unassigned: {imp.target} is in no layer; {_ADD_IT}"))
            continue
        rule = _layer_rule(imp, src, dst)
        if rule:
            found.append(Violation(imp.path, imp.line, imp.text, rule))
    return found


def _import_time_edges(imports: list[Import], modules: dict[str, Path]) -> dict[str, list[Import]]:
    """Module -> the imports that run when it is imported (a target's parent packages included)."""
    edges: dict[str, list[Import]] = {m: [] for m in modules}
    for imp in imports:
        if not imp.module_level:
            continue
        parts = imp.target.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in modules or (i == len(parts) and is_torch(imp.target)):
                edges[imp.module].append(Import(imp.module, imp.path, imp.line, imp.text, prefix, True))
    return edges


def _chain_to_torch(start: str, edges: dict[str, list[Import]]) -> list[str] | None:
    """The shortest module chain from ``start`` to a torch import at import time, or None."""
    parent: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        module = queue.popleft()
        for imp in edges.get(module, ()):
            if is_torch(imp.target):
                chain = [imp.target.split(".")[0], module]
                while parent[chain[-1]] is not None:
                    chain.append(parent[chain[-1]])  # type: ignore[arg-type]
                return chain[::-1]
            if imp.target not in parent:
                parent[imp.target] = module
                queue.append(imp.target)
    return None


def check_transitive(imports: list[Import], modules: dict[str, Path]) -> list[Violation]:
    """Torch-free modules whose import-time imports leave the torch-free set and reach torch."""
    edges = _import_time_edges(imports, modules)
    found: list[Violation] = []
    seen: set[tuple[Path, int, str]] = set()
    for module in modules:
        if not is_torch_free(module):
            continue
        for imp in edges[module]:
            if is_torch(imp.target) or is_torch_free(imp.target) or imp.target == module:
                continue
            chain = _chain_to_torch(imp.target, edges)
            key = (imp.path, imp.line, imp.target)
            if chain and key not in seen:
                seen.add(key)
                found.append(Violation(imp.path, imp.line, imp.text,
                                       f"torch-free (transitive): importing {module} imports torch: "
                                       f"{' -> '.join([module, *chain])}; move this import into the function "
                                       "that needs it"))
    return found


def check(root: Path, *, transitive: bool = True) -> tuple[list[Violation], int, int]:
    """(violations, modules checked, imports checked) for the tree at ``root``."""
    modules = find_modules(root)
    imports, problems = read_imports(modules)
    found = problems + check_imports(imports, modules)
    if transitive:
        found += check_transitive(imports, modules)
    found.sort(key=lambda v: (str(v.path), v.line, v.rule))
    return found, len(modules), len(imports)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/check_layers.py", description=__doc__.split("\n\n", 1)[0],
                                     epilog="The rules are listed in this file's docstring.")
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="tree holding cpdpkit/ and profiler/ (default: this repository)")
    parser.add_argument("--direct-only", action="store_true",
                        help="skip the transitive torch-free rule (imports of torch through other cpdpkit modules)")
    args = parser.parse_args(argv)
    if not (args.root / "cpdpkit").is_dir():
        print(f"error: {args.root} has no cpdpkit/ folder; pass --root the repository root", file=sys.stderr)
        return 2
    found, num_modules, num_imports = check(args.root, transitive=not args.direct_only)
    for v in found:
        print(v.format(args.root))
    if found:
        print(f"check_layers: {len(found)} violation(s) in {num_modules} modules", file=sys.stderr)
        return 1
    print(f"check_layers: ok ({num_modules} modules, {num_imports} imports)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

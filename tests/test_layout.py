"""Guards the package layout: which module may import what, and how big things may grow.

The tree is the architecture. ``dapo/`` holds subpackages by concern, each in one layer of
``LAYERS`` below (mirrored in ``docs/architecture.md``): ``dapo.algo``, the pure maths
(tensors in, tensors out), sits at the bottom beside the data and the collectives; rewards,
configuration, the run's machinery, models, rollout engines, evaluation and training sit on
it in that order; the commands sit on top. A module imports only from its own package and
from packages of lower layers. An import that points the other way, or an import cycle,
quietly welds two layers together, and nothing else would notice until the layers can no
longer be tested apart.

Three boundaries matter beyond tidiness:

* Verifier worker processes import ``dapo.reward`` (and re-run the ``dapo`` console script,
  hence the cheap module level of ``dapo.cli``). Importing torch, transformers or numpy there
  costs seconds and hundreds of MB per worker.
* ``dapo.config`` must load without torch, so a config can be checked (and the CLI can fail
  fast on a bad one) before anything heavy is imported.
* Only ``dapo.dist`` talks to ``torch.distributed``, so the single-process path never depends
  on it and the collective calls live in one reviewable place.

Everything is read from disk with :mod:`ast`; no ``dapo`` module is imported, so the checks
are cheap and work on a half-restructured tree. The rules are the tables just below; the
checker is plain functions taking a root directory and a package name, and its own
behaviour is pinned by the self-tests at the end, which run it on a small fake package.
"""

from __future__ import annotations

import ast
import re
import sys
import textwrap
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "dapo"

# --------------------------------------------------------------------------------------------
# The rules. A name covers itself and everything below it: "dapo.algo" covers dapo.algo and
# dapo.algo.losses, "torch" covers torch.nn.functional. Prefixes that match no module are
# fine: the layout is being built, and a rule starts biting when its module appears.
# --------------------------------------------------------------------------------------------

# The layers, lowest first: a module may import (at any depth of its code, TYPE_CHECKING
# blocks aside) only its own package's modules and those of packages in lower layers; two
# packages of one layer are independent. The most specific prefix places a module, so
# dapo.data.tools (the `dapo data` command's checks, which read the task registry and a
# tokenizer) sits with the commands while the rest of dapo.data is at the bottom. Every
# module of the package must be placed. docs/architecture.md shows the same table.
LAYERS: tuple[tuple[str, ...], ...] = (
    # maths, problems and batches, collectives; install hints for the optional extras; the
    # exception of a kind behind another
    ("dapo.algo", "dapo.data", "dapo.dist", "dapo.exception_chain", "dapo.extras"),
    ("dapo.reward",),  # tasks (verifiers), the worker pool; no torch
    # typed sections, presets, YAML and overrides; environments (tools in episodes); no torch
    ("dapo.config", "dapo.env"),
    ("dapo.models", "dapo.run"),  # loading and passes; checkpoints, run dir, logging
    ("dapo.rollout",),  # the engines
    ("dapo.eval",),  # held-out evaluation and its statistics
    ("dapo.training",),  # the step, the update, dynamic sampling, the loop
    ("dapo.ablate", "dapo.data.tools", "dapo.report"),  # commands' machinery
    ("dapo.api",),  # dapo.train, dapo.evaluate, dapo.load_config: what the commands run
    ("dapo.cli",),  # the command line, a module per command
    # python -m dapo, python -m dapo.memory_plan; dapo.rewards.math_score, the first name
    ("dapo.__main__", "dapo.memory_plan", "dapo.rewards"),
)
# The package's own __init__ holds the version and nothing else: below everything.
ROOT_LAYER = -1

# At most this many modules directly in dapo/ besides __init__.py and __main__.py.
MAX_TOP_LEVEL_MODULES = 6

# Prefix -> the only things its modules may import directly (its own imports are all it has).
ALLOWED_ONLY: dict[str, tuple[str, ...]] = {
    # The maths stays pure so it can be read, tested and reused without the rest.
    "dapo.algo": (
        "dapo.algo",
        "torch",
        "__future__",
        "typing",
        "collections.abc",
        "math",
        "dataclasses",
    ),
}

_HEAVY = ("torch", "transformers", "numpy", "pyarrow", "matplotlib")

# The machinery below the trainer takes plain arguments, never the whole config.
_NOT_THE_CONFIG = (
    "dapo.config",
    "dapo.training.step",
    "dapo.training.update",
    "dapo.training.loop",
    "dapo.cli",
)

# Prefix -> what its modules must never reach, directly or through other dapo modules.
NEVER_REACH: dict[str, tuple[str, ...]] = {
    # Imported by every verifier worker process.
    "dapo.reward": _HEAVY,
    # A config must load (and be rejected) before torch is imported.
    "dapo.config": ("torch", "transformers"),
    "dapo.models.logprobs": _NOT_THE_CONFIG,
    "dapo.rollout": _NOT_THE_CONFIG,
    "dapo.data.batch": _NOT_THE_CONFIG,
    "dapo.training.sampling": _NOT_THE_CONFIG,
    # A dry run sizes the model from its config.json before torch loads.
    "dapo.training.model_shape": ("torch", "transformers"),
}

# Prefix -> what its modules must not import themselves.
_FILE_FORMATS = ("json", "yaml", "pyarrow", "safetensors", "csv", "pickle")
FORBIDDEN_IMPORTS: dict[str, tuple[str, ...]] = {
    # The step orchestrates; reading and writing files belongs to checkpoint/rundir/data.
    "dapo.training.step": _FILE_FORMATS,
    "dapo.training.update": _FILE_FORMATS,  # phase 4 of the same step
    "dapo.training.old_logprobs": _FILE_FORMATS,  # its first part
    "dapo.training.exchange": _FILE_FORMATS,  # who trains what: objects between ranks, no files
    "dapo.training.loop": _FILE_FORMATS,  # the run's files are written by rundir and checkpoint
    "dapo.training.sampling": _FILE_FORMATS,  # dynamic sampling, inside the step
    "dapo.training.rounds": _FILE_FORMATS,  # the step's rounds
    "dapo.training.microbatches": _FILE_FORMATS,
    "dapo.training.sources": _FILE_FORMATS,
    "dapo.training.generator_thread": _FILE_FORMATS,  # its rollouts become files elsewhere
    "dapo.training.perf": _FILE_FORMATS,
}

# Prefix -> attribute names its modules must not call (``torch.exp(x)``, ``F.softmax(x)``,
# ``x.clamp(...)``): the maths belongs in dapo.algo, where it is tested on its own. Matched
# by attribute name alone (the receiver's type is unknown to ast), so ``logger.log()`` counts.
# Matched after a trailing "_" is dropped (in-place forms), and every clamp* and torch.special.*
# call counts too. ``sum``/``max``/``min`` are only caught as methods or torch functions: the
# builtins of the same names count plain Python numbers.
_MATHS = frozenset(
    {"exp", "log", "log_softmax", "softmax", "clamp", "where", "std", "logsumexp"}
    | {"sigmoid", "minimum", "maximum", "abs", "amax", "amin", "mean", "sum", "max", "min"}
    | {"sqrt", "pow", "log1p", "expm1", "tanh", "square", "var", "cumsum", "prod", "norm"}
)
FORBIDDEN_CALLS: dict[str, frozenset[str]] = {
    "dapo.training.step": _MATHS,
    "dapo.training.update": _MATHS,
    "dapo.training.old_logprobs": _MATHS,
    "dapo.training.microbatches": _MATHS,
    "dapo.training.sources": _MATHS,
    "dapo.training.rounds": _MATHS,
    "dapo.training.generator_thread": _MATHS,
    "dapo.training.perf": _MATHS,
}

# Modules below the loop take the config sections they use, never the whole Config (whose
# 100-odd fields would otherwise travel through every call): they may not import the name.
TAKE_SECTIONS = (
    "dapo.training.step",
    "dapo.training.update",
    "dapo.training.old_logprobs",
    "dapo.training.microbatches",
    "dapo.training.rounds",
    "dapo.training.exchange",
    "dapo.training.sources",
    "dapo.training.sampling",
    "dapo.training.perf",
)

# Dotted name -> the only module prefixes that may import it or refer to it in code.
RESERVED: dict[str, tuple[str, ...]] = {
    "torch.distributed": ("dapo.dist",),
}

# Prefix -> the dapo modules its module level may import; everything else there must be
# standard library (imports inside functions are free: they run only when needed).
STDLIB_ONLY_AT_MODULE_LEVEL: dict[str, tuple[str, ...]] = {
    "dapo.cli": ("dapo.cli",),
}

# Package modules only: tests hold long tables of cases (and this file its own checker).
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60  # def line to last line, decorators and docstring excluded

# Directories whose files may not use another module's _private names.
PRIVATE_NAME_DIRS = ("dapo", "tests", "benchmarks")


# --------------------------------------------------------------------------------------------
# Reading the package.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    line: int
    target: str  # a dapo module (or the package a name came from), else the full dotted name
    internal: bool  # inside the package being checked
    module_level: bool  # runs when the module is imported, not only when a function is called


@dataclass
class Module:
    name: str
    path: str  # relative to the root, for messages
    tree: ast.Module
    n_lines: int
    is_package: bool
    imports: list[Import] = field(default_factory=list)
    type_imports: list[Import] = field(default_factory=list)
    """Those of ``if TYPE_CHECKING:`` blocks: never run, but a cycle through them still ties
    two modules' designs together (each names the other's types)."""


def covers(prefix: str, name: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def first_cover(prefixes: Iterable[str], name: str) -> str | None:
    return next((p for p in prefixes if covers(p, name)), None)


def is_private(name: str) -> bool:
    dunder = len(name) > 4 and name.startswith("__") and name.endswith("__")
    return name.startswith("_") and not dunder


def _rules_for(name: str, table: Mapping[str, Collection[str]]) -> list[str] | None:
    """Everything the rules covering ``name`` list, or None when no rule covers it."""
    applies = [values for prefix, values in table.items() if covers(prefix, name)]
    return None if not applies else [v for values in applies for v in values]


def _python_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return sorted(
        p
        for p in directory.rglob("*.py")
        if not any(part.startswith(".") or part == "__pycache__" for part in p.parts)
    )


def _dotted_name(relative: Path) -> str:
    parts = list(relative.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


_FUNCTION_NODES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def runtime_nodes(tree: ast.AST) -> Iterator[tuple[ast.AST, bool]]:
    """Every node that can run, with whether it sits inside a function.

    The body of ``if TYPE_CHECKING:`` never runs, so it is skipped (its ``else`` is kept).
    """
    for node, in_function, type_only in all_nodes(tree):
        if not type_only:
            yield node, in_function


def all_nodes(tree: ast.AST) -> Iterator[tuple[ast.AST, bool, bool]]:
    """Every node, with whether it sits inside a function and inside the body of an
    ``if TYPE_CHECKING:`` (which never runs)."""
    stack: list[tuple[ast.AST, bool, bool]] = [(tree, False, False)]
    while stack:
        node, in_function, type_only = stack.pop()
        yield node, in_function, type_only
        inside = in_function or isinstance(node, _FUNCTION_NODES)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend((child, inside, True) for child in node.body)
            stack.extend((child, inside, type_only) for child in node.orelse)
            stack.append((node.test, inside, type_only))
        else:
            stack.extend((child, inside, type_only) for child in ast.iter_child_nodes(node))


def from_base(node: ast.ImportFrom, module: str, is_package: bool) -> str | None:
    """The absolute module a ``from ... import`` reads from (None: beyond the top level)."""
    if node.level == 0:
        return node.module
    parts = module.split(".") if is_package else module.split(".")[:-1]
    keep = len(parts) - (node.level - 1)
    if keep < 1:
        return None
    return ".".join(parts[:keep] + ([node.module] if node.module else []))


def _from_target(base: str, name: str, package: str, modules: Collection[str]) -> str:
    if name == "*":
        return base
    full = f"{base}.{name}"
    if covers(package, base):
        # ``from dapo.algo import losses`` imports a module; ``from dapo.algo import f`` a name.
        return full if full in modules else base
    # Outside the package, keep the full name so that ``from torch import distributed``
    # is seen as torch.distributed.
    return full


def _collect_imports(
    tree: ast.Module,
    name: str,
    is_package: bool,
    package: str,
    modules: Collection[str],
    *,
    type_only: bool = False,
) -> list[Import]:
    """The imports that run (or, ``type_only``, those of ``if TYPE_CHECKING:`` blocks)."""
    found: list[Import] = []
    nodes = ((n, f) for n, f, t in all_nodes(tree) if t == type_only)
    for node, in_function in nodes:
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = from_base(node, name, is_package)
            if base is None:
                continue
            targets = [_from_target(base, a.name, package, modules) for a in node.names]
        else:
            continue
        for target in targets:
            found.append(Import(node.lineno, target, covers(package, target), not in_function))
    return sorted(set(found), key=lambda i: (i.line, i.target, i.module_level))


@cache
def module_graph(root: Path, package: str) -> dict[str, Module]:
    """Every module of ``root/package`` by dotted name, with its runtime imports."""
    files: dict[str, Path] = {}
    for path in _python_files(root / package):
        name = _dotted_name(path.relative_to(root))
        # Mid-move, foo.py and foo/__init__.py may both exist; Python imports the package.
        if name not in files or path.name == "__init__.py":
            files[name] = path
    modules: dict[str, Module] = {}
    for name, path in sorted(files.items()):
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source, filename=str(path))
        is_package = path.name == "__init__.py"
        imports = _collect_imports(tree, name, is_package, package, files)
        type_imports = _collect_imports(tree, name, is_package, package, files, type_only=True)
        if name == package:
            # The package's own __init__ re-exports the Python API from a module __getattr__:
            # importing any module of the package runs the __init__ but not that function, so
            # only code that asks for dapo.train (and so on) reaches the API through it.
            imports = [imp for imp in imports if imp.module_level]
        modules[name] = Module(
            name=name,
            path=path.relative_to(root).as_posix(),
            tree=tree,
            n_lines=len(source.splitlines()),
            is_package=is_package,
            imports=imports,
            type_imports=type_imports,
        )
    return modules


def import_edges(
    modules: Mapping[str, Module], *, with_types: bool = False
) -> dict[str, dict[str, int]]:
    """module -> {imported module: first line}, between modules that exist on disk; with
    ``with_types``, the imports of ``if TYPE_CHECKING:`` blocks too."""
    graph: dict[str, dict[str, int]] = {name: {} for name in modules}
    for name, module in modules.items():
        imports = [*module.imports, *module.type_imports] if with_types else module.imports
        for imp in sorted(imports, key=lambda i: i.line):
            # A module reading a name from itself (``from . import x`` in an __init__) is no
            # dependency on anything else.
            if imp.internal and imp.target in modules and imp.target != name:
                graph[name].setdefault(imp.target, imp.line)
    return graph


def with_ancestors(
    graph: Mapping[str, Mapping[str, int]], modules: Mapping[str, Module]
) -> dict[str, dict[str, int]]:
    """``graph`` plus what Python also runs: importing ``a.b.c`` first runs ``a/__init__`` and
    ``a/b/__init__``, for the importer's own packages too. For what a module reaches, not for
    cycles (a package's __init__ importing its submodules is how packages work)."""

    def ancestors(name: str) -> list[str]:
        parts = name.split(".")
        return [".".join(parts[:k]) for k in range(1, len(parts)) if ".".join(parts[:k]) in modules]

    out: dict[str, dict[str, int]] = {}
    for name, edges in graph.items():
        out[name] = dict(edges)
        for target in [name, *edges]:
            for package in ancestors(target):
                if package != name:
                    out[name].setdefault(package, edges.get(target, 1))
    return out


def _unique(imports: Iterable[Import]) -> Iterator[Import]:
    seen: set[tuple[int, str]] = set()
    for imp in imports:
        if (imp.line, imp.target) not in seen:
            seen.add((imp.line, imp.target))
            yield imp


# --------------------------------------------------------------------------------------------
# Cycles.
# --------------------------------------------------------------------------------------------


def strongly_connected(graph: Mapping[str, Collection[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the components of more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component: list[str] = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _shortest_cycle(
    graph: Mapping[str, Collection[str]], start: str, within: set[str]
) -> list[str] | None:
    parent: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph[node]):
            if nxt == start:
                path = [node]
                while (prev := parent[path[-1]]) is not None:
                    path.append(prev)
                return path[::-1]
            if nxt in within and nxt not in parent:
                parent[nxt] = node
                queue.append(nxt)
    return None


def find_cycles(modules: Mapping[str, Module], *, with_types: bool = False) -> list[str]:
    """For every module caught in a cycle, the shortest cycle through it (each once); with
    ``with_types``, through type-only imports too."""
    graph = import_edges(modules, with_types=with_types)
    seen: set[tuple[str, ...]] = set()
    found: list[str] = []
    for component in strongly_connected(graph):
        for start in component:
            cycle = _shortest_cycle(graph, start, set(component))
            if cycle is None:
                continue
            turn = cycle.index(min(cycle))  # one spelling per cycle, whatever the start
            cycle = cycle[turn:] + cycle[:turn]
            if tuple(cycle) in seen:
                continue
            seen.add(tuple(cycle))
            line = graph[cycle[0]][cycle[1]]
            found.append(f"{modules[cycle[0]].path}:{line}: {' -> '.join([*cycle, cycle[0]])}")
    return found


# --------------------------------------------------------------------------------------------
# Import rules.
# --------------------------------------------------------------------------------------------


def _chains(
    graph: Mapping[str, Mapping[str, int]], start: str, blocked: Callable[[str], bool]
) -> dict[str, list[str]]:
    """Shortest import chain from ``start`` to every module it reaches, nearest first.

    Blocked modules are neither entered nor gone through: reaching one is reported by the
    import that reaches it, and whatever lies behind it would only repeat that report.
    """
    chains = {start: [start]}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph[node]):
            if nxt not in chains and not blocked(nxt):
                chains[nxt] = [*chains[node], nxt]
                queue.append(nxt)
    return chains


def reach_violations(
    modules: Mapping[str, Module], never_reach: Mapping[str, Sequence[str]]
) -> list[str]:
    """Modules that import a forbidden thing themselves or through any dapo module."""
    graph = with_ancestors(import_edges(modules), modules)
    found: list[str] = []
    for name in sorted(modules):
        forbidden = _rules_for(name, never_reach)
        if not forbidden:
            continue
        chains = _chains(graph, name, lambda m, f=forbidden: first_cover(f, m) is not None)
        for reached, chain in chains.items():
            seen: set[str] = set()
            for imp in modules[reached].imports:
                hit = first_cover(forbidden, imp.target)
                if hit is None or hit in seen:
                    continue
                seen.add(hit)
                hops = " -> ".join([*chain, imp.target])
                if len(chain) == 1:
                    found.append(f"{modules[name].path}:{imp.line}: {name} imports {hit}")
                    continue
                line = graph[name][chain[1]]
                where = f"{modules[reached].path}:{imp.line}"
                found.append(f"{modules[name].path}:{line}: {name} reaches {hit}: {hops} ({where})")
    return found


def placement(name: str, layers: Sequence[Sequence[str]]) -> tuple[str, int] | None:
    """The most specific prefix of ``layers`` that covers ``name``, and its layer."""
    found = [(p, i) for i, layer in enumerate(layers) for p in layer if covers(p, name)]
    return max(found, key=lambda pi: len(pi[0])) if found else None


def unplaced_modules(
    modules: Mapping[str, Module], layers: Sequence[Sequence[str]], root: str
) -> list[str]:
    """Modules in no layer (the package's own __init__ aside)."""
    return [
        f"{m.path}:1: {name} is in no layer; add its package to LAYERS (and to the table in "
        "docs/architecture.md)"
        for name, m in sorted(modules.items())
        if name != root and placement(name, layers) is None
    ]


def layer_violations(
    modules: Mapping[str, Module], layers: Sequence[Sequence[str]], root: str
) -> list[str]:
    """Imports of a package in the importer's own layer or a higher one."""
    found: list[str] = []
    for name, module in sorted(modules.items()):
        here = placement(name, layers)
        if here is None:
            continue
        for imp in _unique(module.imports):
            if not imp.internal or imp.target == root or imp.target not in modules:
                continue
            there = placement(imp.target, layers)
            if there is None or there[0] == here[0] or there[1] < here[1]:
                continue
            relation = "the same layer as" if there[1] == here[1] else "a higher layer than"
            found.append(
                f"{module.path}:{imp.line}: {name} imports {imp.target}: {there[0]} is in "
                f"{relation} {here[0]} (layer {there[1]} against {here[1]})"
            )
    return found


def top_level_modules(root: Path, package: str) -> list[str]:
    """The modules directly in the package's directory, __init__ and __main__ aside."""
    return sorted(
        p.name
        for p in (root / package).glob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    )


def allowed_only_violations(
    modules: Mapping[str, Module], allowed_only: Mapping[str, Sequence[str]]
) -> list[str]:
    found: list[str] = []
    for name, module in sorted(modules.items()):
        allowed = _rules_for(name, allowed_only)
        if allowed is None:
            continue
        for imp in _unique(module.imports):
            if first_cover(allowed, imp.target) is None:
                found.append(
                    f"{module.path}:{imp.line}: {name} imports {imp.target}, "
                    f"outside what it may import ({', '.join(allowed)})"
                )
    return found


def forbidden_import_violations(
    modules: Mapping[str, Module], forbidden_imports: Mapping[str, Sequence[str]]
) -> list[str]:
    found: list[str] = []
    for name, module in sorted(modules.items()):
        forbidden = _rules_for(name, forbidden_imports) or []
        seen: set[tuple[int, str]] = set()
        for imp in module.imports:
            hit = first_cover(forbidden, imp.target)
            if hit is not None and (imp.line, hit) not in seen:
                seen.add((imp.line, hit))
                found.append(f"{module.path}:{imp.line}: {name} imports {imp.target}")
    return found


def module_level_violations(
    modules: Mapping[str, Module], stdlib_only: Mapping[str, Sequence[str]]
) -> list[str]:
    """Module-level imports that are neither standard library nor an allowed dapo module."""
    found: list[str] = []
    for name, module in sorted(modules.items()):
        allowed = _rules_for(name, stdlib_only)
        if allowed is None:
            continue
        for imp in _unique(module.imports):
            if not imp.module_level:
                continue
            if imp.internal:
                ok = first_cover(allowed, imp.target) is not None
            else:
                ok = imp.target.split(".")[0] in sys.stdlib_module_names
            if not ok:
                found.append(
                    f"{module.path}:{imp.line}: {name} imports {imp.target} at module level "
                    "(move it into the function that needs it)"
                )
    return found


def _name_bindings(module: Module) -> dict[str, str]:
    """Local name -> the dotted name it was imported as (``F`` -> torch.nn.functional)."""
    bound: dict[str, str] = {}
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    bound[top] = top
        elif isinstance(node, ast.ImportFrom):
            base = from_base(node, module.name, module.is_package)
            for alias in node.names:
                if base is not None and alias.name != "*":
                    bound[alias.asname or alias.name] = f"{base}.{alias.name}"
    return bound


def _dotted_parts(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as [a, b, c]; None when the chain does not start at a plain name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _resolved(node: ast.AST, bound: Mapping[str, str]) -> str | None:
    parts = _dotted_parts(node)
    if parts is None:
        return None
    return ".".join([bound.get(parts[0], parts[0]), *parts[1:]])


def reserved_violations(
    modules: Mapping[str, Module], reserved: Mapping[str, Sequence[str]]
) -> list[str]:
    """Imports of, or references to, a reserved name outside the modules it is reserved to."""
    found: list[str] = []
    for name, module in sorted(modules.items()):
        names = [r for r, owners in reserved.items() if first_cover(owners, name) is None]
        if not names:
            continue
        seen: set[int] = set()
        for imp in module.imports:
            hit = first_cover(names, imp.target)
            if hit is not None and imp.line not in seen:
                seen.add(imp.line)
                found.append(f"{module.path}:{imp.line}: {name} imports {imp.target}")
        bound = _name_bindings(module)
        for node, _ in runtime_nodes(module.tree):
            if not isinstance(node, ast.Attribute):
                continue
            hit = first_cover(names, _resolved(node, bound) or "")
            # Report the innermost matching node only: torch.distributed, not also .barrier.
            if hit is not None and first_cover([hit], _resolved(node.value, bound) or "") is None:
                found.append(f"{module.path}:{node.lineno}: {name} refers to {hit}")
    return sorted(set(found), key=_by_location)


def call_violations(
    modules: Mapping[str, Module], forbidden_calls: Mapping[str, Collection[str]]
) -> list[str]:
    """Calls such as ``torch.exp(x)``, ``F.softmax(x)``, ``x.clamp(...)`` or ``exp(x)``."""
    found: list[tuple[str, int, int, str]] = []
    for name, module in sorted(modules.items()):
        banned = set(_rules_for(name, forbidden_calls) or ())
        if not banned:
            continue
        bound = _name_bindings(module)
        for node in ast.walk(module.tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Attribute):
                attr = func.attr.rstrip("_")
                special = (_resolved(func, bound) or "").startswith("torch.special.")
                hit = attr in banned or attr.startswith("clamp") or special
            else:
                # ``from torch import exp`` then ``exp(x)``.
                hit = isinstance(func, ast.Name) and (
                    func.id in bound and bound[func.id].rsplit(".", 1)[-1] in banned
                )
            if hit:
                shown = textwrap.shorten(ast.unparse(func), 60, placeholder="...")
                what = f"{name} calls {shown}()"
                found.append((module.path, node.lineno, node.col_offset, what))
    return [f"{path}:{line}: {what}" for path, line, _, what in sorted(found)]


def _by_location(message: str) -> tuple[str, int, str]:
    path, line, rest = message.split(":", 2)
    return path, int(line), rest


# --------------------------------------------------------------------------------------------
# Private names.
# --------------------------------------------------------------------------------------------


@dataclass
class _SourceFile:
    name: str  # its module name: dapo.training.step, or test_faults for tests/test_faults.py
    path: str
    tree: ast.Module
    is_package: bool


def _source_files(root: Path, package: str, dirs: Sequence[str]) -> list[_SourceFile]:
    files: list[_SourceFile] = []
    for directory in dirs:
        # The package's modules are named from the root; test and benchmark files from
        # their own directory, which is how they import each other (``from test_faults``).
        base = root if directory == package else root / directory
        for path in _python_files(root / directory):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            name = _dotted_name(path.relative_to(base))
            rel = path.relative_to(root).as_posix()
            files.append(_SourceFile(name, rel, tree, path.name == "__init__.py"))
    return files


def _module_aliases(source: _SourceFile, local: Collection[str]) -> dict[str, str]:
    """Names bound in this file to one of our modules (never to a function or class)."""
    aliases: dict[str, str] = {}
    for node in ast.walk(source.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if alias.asname and (alias.name in local or top in local):
                    aliases[alias.asname] = alias.name
                elif not alias.asname and top in local:
                    aliases[top] = top
        elif isinstance(node, ast.ImportFrom):
            base = from_base(node, source.name, source.is_package)
            for alias in node.names:
                if base is not None and f"{base}.{alias.name}" in local:
                    aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
    return aliases


def _module_of(node: ast.AST, aliases: Mapping[str, str], local: Collection[str]) -> str | None:
    """The module that ``node`` (``mod``, ``dapo.x.y``) denotes, if it denotes one of ours."""
    parts = _dotted_parts(node)
    if parts is None or parts[0] not in aliases:
        return None
    current = aliases[parts[0]]
    for part in parts[1:]:
        if f"{current}.{part}" not in local:
            return None
        current = f"{current}.{part}"
    return current


_ATTR_FUNCTIONS = frozenset({"setattr", "getattr", "delattr", "hasattr"})
_ATTR_METHODS = frozenset({"setattr", "delattr"})  # monkeypatch.setattr / .delattr


def _private_uses_in(source: _SourceFile, local: Collection[str]) -> Iterator[tuple[int, str]]:
    aliases = _module_aliases(source, local)
    for node in ast.walk(source.tree):
        if isinstance(node, ast.ImportFrom):
            base = from_base(node, source.name, source.is_package)
            for alias in node.names:
                if base is not None and base != source.name and is_private(alias.name):
                    yield node.lineno, f"from {base} import {alias.name}"
        elif isinstance(node, ast.Attribute) and is_private(node.attr):
            module = _module_of(node.value, aliases, local)
            if module is not None and module != source.name:
                yield node.lineno, f"{module}.{node.attr}"
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            named = isinstance(func, ast.Name) and func.id in _ATTR_FUNCTIONS
            method = isinstance(func, ast.Attribute) and func.attr in _ATTR_METHODS
            if not (named or method):
                continue
            first, rest = node.args[0], node.args[1:]
            if isinstance(first, ast.Constant) and isinstance(first.value, str) and method:
                # monkeypatch.setattr("dapo.x._y", value)
                module, _, attr = first.value.rpartition(".")
            elif rest and isinstance(rest[0], ast.Constant) and isinstance(rest[0].value, str):
                module, attr = _module_of(first, aliases, local) or "", rest[0].value
            else:
                continue
            if module in local and module != source.name and is_private(attr):
                shown = func.id if isinstance(func, ast.Name) else ast.unparse(func)
                yield node.lineno, f"{shown}({module}, {attr!r})"


def private_name_uses(root: Path, package: str, dirs: Sequence[str]) -> list[str]:
    """Uses of another module's _private names, in every file under ``dirs``."""
    sources = _source_files(root, package, dirs)
    local: set[str] = set()
    for source in sources:
        parts = source.name.split(".")
        # Namespace packages (a directory without __init__.py) are modules too.
        local.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    found: list[str] = []
    for source in sources:
        for line, what in sorted(set(_private_uses_in(source, local))):
            found.append(f"{source.path}:{line}: uses {what}, private to another module")
    return found


# --------------------------------------------------------------------------------------------
# Sizes.
# --------------------------------------------------------------------------------------------


def function_length(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from ``def`` to the end, decorators excluded, less the docstring's lines."""
    length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
    first = node.body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        length -= first.end_lineno - first.lineno + 1  # type: ignore[operator]
    return length


def functions(
    node: ast.AST, prefix: str = ""
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method, nested ones included, with a qualified name."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{prefix}{child.name}", child
            yield from functions(child, f"{prefix}{child.name}.")
        elif isinstance(child, ast.ClassDef):
            yield from functions(child, f"{prefix}{child.name}.")
        else:
            yield from functions(child, prefix)


def module_size_violations(modules: Mapping[str, Module], max_lines: int) -> list[str]:
    return [
        f"{m.path}:1: {m.n_lines} lines (at most {max_lines})"
        for _, m in sorted(modules.items())
        if m.n_lines > max_lines
    ]


def function_size_violations(modules: Mapping[str, Module], max_lines: int) -> list[str]:
    found: list[str] = []
    for _, module in sorted(modules.items()):
        for qualname, node in functions(module.tree):
            length = function_length(node)
            if length > max_lines:
                found.append(
                    f"{module.path}:{node.lineno}: {qualname}() is {length} lines "
                    f"(at most {max_lines})"
                )
    return sorted(found, key=_by_location)


# --------------------------------------------------------------------------------------------
# The checks on the real package.
# --------------------------------------------------------------------------------------------


def _package() -> dict[str, Module]:
    return module_graph(REPO, PACKAGE)


def _fail_on(violations: list[str], what: str) -> None:
    if violations:
        listing = "\n  ".join(violations)
        pytest.fail(f"{len(violations)} {what}:\n  {listing}", pytrace=False)


def test_the_package_is_found() -> None:
    # Guards the guards: every check below would pass vacuously on an empty graph.
    modules = _package()
    assert PACKAGE in modules, f"no {PACKAGE}/__init__.py under {REPO}"
    assert any(m.imports for m in modules.values()), "no imports found: is the parser broken?"


def test_no_import_cycles() -> None:
    _fail_on(find_cycles(_package()), "import cycles")


def test_no_import_cycles_through_type_only_imports() -> None:
    # A module that names another's types under TYPE_CHECKING while that one imports it is
    # still a cycle of design: neither can be read, or replaced, without the other.
    _fail_on(find_cycles(_package(), with_types=True), "import cycles (type-only imports too)")


def test_every_module_is_in_a_layer() -> None:
    _fail_on(unplaced_modules(_package(), LAYERS, PACKAGE), "modules outside the layers")


def test_packages_import_only_lower_layers() -> None:
    _fail_on(layer_violations(_package(), LAYERS, PACKAGE), "imports against the layers")


def test_the_top_level_holds_packages() -> None:
    found = top_level_modules(REPO, PACKAGE)
    assert len(found) <= MAX_TOP_LEVEL_MODULES, (
        f"{len(found)} modules directly in {PACKAGE}/ (at most {MAX_TOP_LEVEL_MODULES}): "
        f"{', '.join(found)}; put each in the subpackage of its concern"
    )


def _as_path(prefix: str) -> str:
    path = prefix.replace(".", "/")
    return f"{path}/" if (REPO / path).is_dir() else f"{path}.py"


def test_the_architecture_page_shows_the_layers() -> None:
    # docs/architecture.md has the same table: a row per layer, lowest first, "| N | paths |".
    page = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| \d+ \| ([^|]*) \|", page, flags=re.MULTILINE)
    shown = [sorted(cell.strip(" `") for cell in row.split(",")) for row in rows]
    assert shown == [sorted(_as_path(p) for p in layer) for layer in LAYERS]


def test_algo_imports_only_torch_and_itself() -> None:
    _fail_on(allowed_only_violations(_package(), ALLOWED_ONLY), "imports out of dapo.algo")


def test_light_modules_never_reach_heavy_ones() -> None:
    _fail_on(reach_violations(_package(), NEVER_REACH), "forbidden imports, direct or transitive")


def test_only_dist_touches_torch_distributed() -> None:
    _fail_on(reserved_violations(_package(), RESERVED), "uses of a reserved module")


def test_trainer_reads_and_writes_no_files() -> None:
    _fail_on(forbidden_import_violations(_package(), FORBIDDEN_IMPORTS), "forbidden imports")


def test_trainer_does_no_maths() -> None:
    _fail_on(call_violations(_package(), FORBIDDEN_CALLS), "maths calls outside dapo.algo")


def whole_config_imports(
    modules: Mapping[str, Module], prefixes: Sequence[str], package: str
) -> list[str]:
    """Modules of ``prefixes`` that import the name ``Config`` from ``package.config``
    (type-only imports included)."""
    found = []
    for name in sorted(modules):
        if first_cover(prefixes, name) is None:
            continue
        module = modules[name]
        for node in ast.walk(module.tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = from_base(node, name, module.is_package) or ""
            if covers(f"{package}.config", base) and any(a.name == "Config" for a in node.names):
                found.append(
                    f"{module.path}:{node.lineno}: {name} imports {base}.Config (take the "
                    "config sections it uses instead)"
                )
    return found


def test_the_step_and_below_take_config_sections() -> None:
    _fail_on(whole_config_imports(_package(), TAKE_SECTIONS, PACKAGE), "whole-config imports")


def test_cli_module_level_is_cheap() -> None:
    violations = module_level_violations(_package(), STDLIB_ONLY_AT_MODULE_LEVEL)
    _fail_on(violations, "heavy module-level imports in the command line")


def test_no_private_names_across_modules() -> None:
    violations = private_name_uses(REPO, PACKAGE, PRIVATE_NAME_DIRS)
    _fail_on(violations, "uses of another module's private names")


def test_modules_are_small() -> None:
    _fail_on(module_size_violations(_package(), MAX_MODULE_LINES), "modules too long")


def test_functions_are_short() -> None:
    _fail_on(function_size_violations(_package(), MAX_FUNCTION_LINES), "functions too long")


# --------------------------------------------------------------------------------------------
# Self-tests of the checker, on a fake package.
# --------------------------------------------------------------------------------------------


def _write(root: Path, files: Mapping[str, str]) -> Path:
    for relative, source in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source), encoding="utf-8")
    return root


def test_checker_finds_a_cycle_through_a_function_level_import(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "fakepkg/__init__.py": "",
            "fakepkg/a.py": "from fakepkg import b\n",
            "fakepkg/b.py": "def f():\n    from fakepkg.a import g\n",
            "fakepkg/c.py": "import fakepkg.a\n",
        },
    )
    modules = module_graph(tmp_path, "fakepkg")
    assert Import(2, "fakepkg.a", internal=True, module_level=False) in modules["fakepkg.b"].imports
    assert find_cycles(modules) == ["fakepkg/a.py:1: fakepkg.a -> fakepkg.b -> fakepkg.a"]


def test_checker_ignores_type_checking_imports(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "fakepkg/__init__.py": "",
            "fakepkg/a.py": """\
                import typing
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    from fakepkg import b
                if typing.TYPE_CHECKING:
                    import torch
                else:
                    import json
                """,
            "fakepkg/b.py": "from . import a\n",
        },
    )
    modules = module_graph(tmp_path, "fakepkg")
    targets = {imp.target for imp in modules["fakepkg.a"].imports}
    assert targets == {"typing", "typing.TYPE_CHECKING", "json"}
    assert find_cycles(modules) == []
    assert {i.target for i in modules["fakepkg.a"].type_imports} == {"fakepkg.b", "torch"}
    assert find_cycles(modules, with_types=True) == [
        "fakepkg/a.py:4: fakepkg.a -> fakepkg.b -> fakepkg.a"
    ]
    assert reach_violations(modules, {"fakepkg.a": ("torch",)}) == []


def test_checker_resolves_from_imports_to_modules_or_packages(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "fakepkg/__init__.py": "",
            "fakepkg/sub/__init__.py": "def helper(): ...\n",
            "fakepkg/sub/leaf.py": "from .. import sub\nfrom . import helper\n",
            "fakepkg/top.py": "from fakepkg.sub import leaf, helper\nfrom torch import nn\n",
        },
    )
    modules = module_graph(tmp_path, "fakepkg")
    assert [i.target for i in modules["fakepkg.sub.leaf"].imports] == ["fakepkg.sub"] * 2
    top = [i.target for i in modules["fakepkg.top"].imports]
    assert top == ["fakepkg.sub", "fakepkg.sub.leaf", "torch.nn"]


def test_checker_follows_torch_through_a_helper(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "fakepkg/__init__.py": "",
            "fakepkg/tasks/__init__.py": "",
            "fakepkg/tasks/t.py": "import json\n\nfrom fakepkg import helper\n",
            "fakepkg/helper.py": "def f():\n    import torch.nn\n",
        },
    )
    violations = reach_violations(module_graph(tmp_path, "fakepkg"), {"fakepkg.tasks": ("torch",)})
    assert violations == [
        "fakepkg/tasks/t.py:3: fakepkg.tasks.t reaches torch: "
        "fakepkg.tasks.t -> fakepkg.helper -> torch.nn (fakepkg/helper.py:2)"
    ]


def test_checker_applies_the_other_import_rules(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "fakepkg/__init__.py": "",
            "fakepkg/algo.py": "import math\nimport numpy as np\nfrom fakepkg import cli\n",
            "fakepkg/dist.py": "import torch.distributed as dist\n",
            "fakepkg/cli.py": "import argparse\nimport torch\n\ndef main():\n    import yaml\n",
            "fakepkg/trainer.py": """\
                import json
                import torch
                import torch.nn.functional as F
                from torch import distributed as tdist, exp
                def step(x, logger):
                    logger.info(x.sum())
                    torch.distributed.barrier()
                    tdist.barrier()
                    return F.log_softmax(x, -1), x.clamp(0, 1), exp(x)
                """,
        },
    )
    modules = module_graph(tmp_path, "fakepkg")
    assert allowed_only_violations(modules, {"fakepkg.algo": ("fakepkg.algo", "math")}) == [
        "fakepkg/algo.py:2: fakepkg.algo imports numpy, outside what it may import "
        "(fakepkg.algo, math)",
        "fakepkg/algo.py:3: fakepkg.algo imports fakepkg.cli, outside what it may import "
        "(fakepkg.algo, math)",
    ]
    assert reserved_violations(modules, {"torch.distributed": ("fakepkg.dist",)}) == [
        # The alias tdist is reported once, at its import, not again at tdist.barrier().
        "fakepkg/trainer.py:4: fakepkg.trainer imports torch.distributed",
        "fakepkg/trainer.py:7: fakepkg.trainer refers to torch.distributed",
    ]
    assert forbidden_import_violations(modules, {"fakepkg.trainer": ("json",)}) == [
        "fakepkg/trainer.py:1: fakepkg.trainer imports json"
    ]
    calls = call_violations(modules, {"fakepkg.trainer": {"log_softmax", "clamp", "exp"}})
    assert [c.split(" calls ")[1] for c in calls] == ["F.log_softmax()", "x.clamp()", "exp()"]
    assert module_level_violations(modules, {"fakepkg.cli": ("fakepkg.cli",)}) == [
        "fakepkg/cli.py:2: fakepkg.cli imports torch at module level "
        "(move it into the function that needs it)"
    ]


def test_checker_finds_private_names_used_across_modules(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "fakepkg/__init__.py": "__version__ = '1'\n",
            "fakepkg/m.py": "def _helper(): ...\n\ndef public():\n    return _helper()\n",
            "fakepkg/user.py": """\
                from fakepkg import __version__, m
                from fakepkg.m import public
                class C:
                    _own = 1
                    def f(self):
                        return self._own, public._cache, m.public(), __version__
                """,
            "tests/test_faults.py": "def _setup(): ...\n",
            "tests/test_x.py": """\
                import fakepkg.m
                import fakepkg.m as mod
                from test_faults import _setup
                def test(monkeypatch, obj):
                    monkeypatch.setattr(mod, "_helper", None)
                    monkeypatch.setattr(obj, "_helper", None)
                    monkeypatch.setattr("fakepkg.m._helper", None)
                    return fakepkg.m._helper, mod.__file__
                """,
        },
    )
    assert private_name_uses(tmp_path, "fakepkg", ["fakepkg", "tests"]) == [
        "tests/test_x.py:3: uses from test_faults import _setup, private to another module",
        "tests/test_x.py:5: uses monkeypatch.setattr(fakepkg.m, '_helper'), "
        "private to another module",
        "tests/test_x.py:7: uses monkeypatch.setattr(fakepkg.m, '_helper'), "
        "private to another module",
        "tests/test_x.py:8: uses fakepkg.m._helper, private to another module",
    ]


def test_checker_measures_functions_without_their_docstring(tmp_path: Path) -> None:
    docstring = '    """' + "\n".join(["A long docstring."] * 10) + '\n    """\n'
    body = "".join(f"    x{i} = {i}\n" for i in range(5))
    _write(
        tmp_path,
        {
            "fakepkg/__init__.py": "",
            "fakepkg/f.py": f"@decorator\ndef documented():\n{docstring}{body}\n"
            f"def bare():\n{body}{body}",
        },
    )
    modules = module_graph(tmp_path, "fakepkg")
    documented = dict(functions(modules["fakepkg.f"].tree))["documented"]
    assert function_length(documented) == 6  # def line + 5 body lines
    # documented() spans 17 lines, but 11 of them are its docstring: only bare() is too long.
    assert function_size_violations(modules, 8) == [
        "fakepkg/f.py:20: bare() is 11 lines (at most 8)"
    ]
    assert module_size_violations(modules, 20) == ["fakepkg/f.py:1: 30 lines (at most 20)"]


def test_checker_follows_what_parent_packages_import(tmp_path: Path) -> None:
    # Importing fakepkg.data.problems runs fakepkg/data/__init__.py first.
    _write(
        tmp_path,
        {
            "fakepkg/__init__.py": "",
            "fakepkg/data/__init__.py": "import torch\n",
            "fakepkg/data/problems.py": "X = 1\n",
            "fakepkg/tasks/__init__.py": "",
            "fakepkg/tasks/t.py": "from fakepkg.data.problems import X\n",
        },
    )
    violations = reach_violations(module_graph(tmp_path, "fakepkg"), {"fakepkg.tasks": ("torch",)})
    assert violations == [
        "fakepkg/tasks/t.py:1: fakepkg.tasks.t reaches torch: "
        "fakepkg.tasks.t -> fakepkg.data -> torch (fakepkg/data/__init__.py:1)"
    ]
    assert find_cycles(module_graph(tmp_path, "fakepkg")) == []  # no parent edges for cycles


def test_checker_catches_in_place_clamp_and_special_forms(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "fakepkg/__init__.py": "",
            "fakepkg/trainer.py": """\
                import torch
                def step(x, n):
                    x.exp_()
                    x.clamp_min(0)
                    torch.special.entr(x)
                    return max(n, 1) + sum([n])
                """,
        },
    )
    calls = call_violations(module_graph(tmp_path, "fakepkg"), {"fakepkg.trainer": _MATHS})
    assert [c.split(" calls ")[1] for c in calls] == [
        "x.exp_()",
        "x.clamp_min()",
        "torch.special.entr()",
    ]  # the builtins max and sum count plain numbers: not maths


def test_checker_places_modules_in_layers_and_finds_upward_imports(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "fakepkg/__init__.py": "",
            "fakepkg/low/__init__.py": "",
            "fakepkg/low/a.py": "from fakepkg.low import b\n",  # its own package: fine
            "fakepkg/low/b.py": "def f():\n    from fakepkg.high import c\n",  # upward
            "fakepkg/low/tool.py": "from fakepkg.high import c\nfrom fakepkg.low import a\n",
            "fakepkg/mid/__init__.py": "",
            "fakepkg/mid/m.py": "from fakepkg import side\nfrom fakepkg.low import a\n",
            "fakepkg/side.py": "from fakepkg.mid import m\n",  # same layer as mid
            "fakepkg/high/__init__.py": "",
            "fakepkg/high/c.py": "from fakepkg.low.tool import x\nfrom fakepkg import loose\n",
            "fakepkg/loose.py": "",
        },
    )
    layers = (("fakepkg.low",), ("fakepkg.mid", "fakepkg.side"), ("fakepkg.high",))
    layers_with_tool = (*layers, ("fakepkg.low.tool",))
    modules = module_graph(tmp_path, "fakepkg")
    assert placement("fakepkg.low.tool", layers_with_tool) == ("fakepkg.low.tool", 3)
    assert placement("fakepkg.low.a", layers_with_tool) == ("fakepkg.low", 0)
    assert unplaced_modules(modules, layers, "fakepkg") == [
        "fakepkg/loose.py:1: fakepkg.loose is in no layer; add its package to LAYERS (and to "
        "the table in docs/architecture.md)"
    ]
    # In layer 0, low.tool may not import high; placed in a layer of its own above high, it
    # may, and then high may not import it.
    assert layer_violations(modules, layers_with_tool, "fakepkg") == [
        "fakepkg/high/c.py:1: fakepkg.high.c imports fakepkg.low.tool: fakepkg.low.tool is in "
        "a higher layer than fakepkg.high (layer 3 against 2)",
        "fakepkg/low/b.py:2: fakepkg.low.b imports fakepkg.high.c: fakepkg.high is in "
        "a higher layer than fakepkg.low (layer 2 against 0)",
        "fakepkg/mid/m.py:1: fakepkg.mid.m imports fakepkg.side: fakepkg.side is in "
        "the same layer as fakepkg.mid (layer 1 against 1)",
        "fakepkg/side.py:1: fakepkg.side imports fakepkg.mid.m: fakepkg.mid is in "
        "the same layer as fakepkg.side (layer 1 against 1)",
    ]
    assert "fakepkg/low/tool.py:1" in layer_violations(modules, layers, "fakepkg")[1]
    assert top_level_modules(tmp_path, "fakepkg") == ["loose.py", "side.py"]


def test_checker_finds_the_whole_config_imported_below_the_loop(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "fakepkg/__init__.py": "",
            "fakepkg/config.py": "class Config: ...\nclass AlgoConfig: ...\n",
            "fakepkg/low.py": """\
                from typing import TYPE_CHECKING
                from fakepkg.config import AlgoConfig
                if TYPE_CHECKING:
                    from fakepkg.config import Config
                """,
            "fakepkg/ok.py": "from fakepkg.config import AlgoConfig\n",
            "fakepkg/top.py": "from fakepkg.config import Config\n",
        },
    )
    modules = module_graph(tmp_path, "fakepkg")
    assert whole_config_imports(modules, ("fakepkg.low", "fakepkg.ok"), "fakepkg") == [
        "fakepkg/low.py:4: fakepkg.low imports fakepkg.config.Config (take the config "
        "sections it uses instead)"
    ]

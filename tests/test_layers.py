"""The layer order, read from minidist's own import graph: no cycle, no import against it.

README's "Architecture" section states the stack; this test is its enforcement. It parses
every module of the package (ast, nothing is imported), takes every `import` and
`from ... import` of a minidist module, at the top or inside a function, and checks:

    1. each edge goes to a module of the same layer or a lower one;
    2. the graph has no cycle (a strongly connected component of more than one module);
    3. a function imports a minidist module only where the import cannot be at the top
       (IMPORTS_IN_FUNCTIONS: an optional dependency, or a command that must start fast).

What breaks either rule today is listed below, each entry with its reason and the part of
the redesign that removes it. The lists only shrink: an entry that no longer matches the
code fails the test too, so a fixed violation is struck from the list in the same change.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "minidist"

# Lowest first. A module's layer is that of the longest prefix listed.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("minidist", "minidist.backend",
              "minidist.cli",               # the commands' parser and one-line errors
              "minidist.observe.trace")),   # the Chrome trace format: imports nothing of
    #                                         minidist; the runtime's hang report, the
    #                                         schedule renderer and the run directory use it
    ("runtime", ("minidist.runtime",)),
    ("collectives", ("minidist.collectives",)),
    ("autograd", ("minidist.autograd", "minidist.memory.recompute")),   # re-run in backward
    ("nn", ("minidist.nn", "minidist.seed", "minidist.data")),
    ("optim", ("minidist.optim",)),
    ("parallel and modes", ("minidist.parallel", "minidist.deterministic",
                            "minidist.memory")),
    ("train", ("minidist.train", "minidist.baseline")),
    ("tools", ("minidist.bench", "minidist.observe", "minidist.reliability",
               "minidist.cluster", "minidist.hardware", "minidist.gpu",
               "minidist.memory.budget", "minidist.memory.budget_models",
               "minidist.memory.budget_measure", "minidist.memory.budget_fit")),
    ("command line", ("minidist.__main__", "minidist.train_cli", "minidist.train_check",
                      "minidist.train_options",
                      "minidist.train_dry_run",
                      "minidist.memory.budget_cli",
                      "minidist.reliability.interval_cli", "minidist.cluster.cli",
                      "minidist.hardware.roofline_cli", "minidist.hardware.predict_cli")),
]

# (importer, imported): why it is there today, and what removes it.
AGAINST_THE_ORDER: dict[tuple[str, str], str] = {}

# Today's cycles, as the sets of modules they join: why, and what removes them.
CYCLES: dict[frozenset[str], str] = {}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.lru_cache(maxsize=None)
def syntax_trees() -> dict[Path, ast.Module]:
    """Every module of minidist/, parsed once per test session."""
    return {path: ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE.rglob("*.py"))}


@functools.lru_cache(maxsize=None)
def imports() -> dict[str, frozenset[str]]:
    """{module: the minidist modules it imports}, from the source, top level or not."""
    paths = {module_name(p): p for p in syntax_trees()}

    def resolve(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(syntax_trees()[path]):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for a in node.names:       # `from pkg import mod` imports mod; `from
                    sub = f"{base}.{a.name}"   # pkg import name` takes pkg's attribute
                    found.add(sub if sub in paths else base)
        graph[name] = frozenset(r for n in found if n.startswith("minidist")
                                and (r := resolve(n)) is not None and r != name)
    return graph


def layer(name: str) -> int:
    """The index in LAYERS of the longest listed prefix of `name`."""
    best, at = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > best:
                best, at = len(p), i
    assert at >= 0, f"{name} is in no layer: add it to LAYERS (and to README's stack)"
    return at


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(frozenset(comp))
    return out


def test_every_module_has_a_layer():
    for name in imports():
        layer(name)


def test_no_import_runs_against_the_layer_order():
    graph = imports()
    found = {(a, b) for a, targets in graph.items() for b in targets if layer(b) > layer(a)}
    new = sorted(found - set(AGAINST_THE_ORDER))
    gone = sorted(set(AGAINST_THE_ORDER) - found)
    assert not new, "imports against the layer order (" + " < ".join(
        n for n, _ in LAYERS) + "):\n" + "\n".join(
        f"  {a} ({LAYERS[layer(a)][0]}) imports {b} ({LAYERS[layer(b)][0]})" for a, b in new)
    assert not gone, f"fixed, so strike them from AGAINST_THE_ORDER: {gone}"


def test_no_import_cycle():
    found = cycles(imports())
    new = [sorted(c) for c in found if c not in CYCLES]
    gone = [sorted(c) for c in CYCLES if c not in found]
    assert not new, "import cycles:\n" + "\n".join(f"  {' <-> '.join(c)}" for c in new)
    assert not gone, f"fixed (or changed), so update CYCLES: {gone}"


def core_dependencies() -> set[str]:
    """The import names of setup.cfg's install_requires (ml_dtypes>=0.4,<0.7 -> ml_dtypes)."""
    text = (PACKAGE.parent / "setup.cfg").read_text()
    block = re.search(r"install_requires =\n((?:[ \t]+\S.*\n)+)", text).group(1)
    return {re.split(r"[<>=!~ ]", line.strip())[0].replace("-", "_") for line in
            block.splitlines() if not line.strip().startswith("#")}


def test_every_package_imported_at_a_module_top_is_a_core_dependency():
    """README's first install (`pip install -e .`) runs every demo and every option of the
    main job: what a module imports at its top is in install_requires; the optional
    extras' packages are imported inside the function that needs them."""
    core, found = core_dependencies(), {}
    stdlib = set(sys.stdlib_module_names)
    for path, tree in syntax_trees().items():
        for node in tree.body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and not node.level else []
            for name in names:
                top = name.split(".")[0]
                if top not in stdlib and top != "minidist" and top not in core:
                    found.setdefault(top, []).append(str(path.relative_to(PACKAGE.parent)))
    assert core >= {"numpy", "multiprocess", "ml_dtypes"}
    assert not found, f"imported at a module's top but not in install_requires: {found}"


# Modules whose functions import minidist modules, and why the import cannot be at the top.
# Anything else imports at the top, so that a reader sees a module's dependencies first.
IMPORTS_IN_FUNCTIONS: dict[str, str] = {
    "minidist.__main__": "each command imports only its own tool: `python -m minidist gpu "
                         "check` must start on a GPU machine that lacks multiprocess, and "
                         "`--help` must not wait for every tool",
}


def imports_in_functions() -> dict[str, list[str]]:
    """{module: ['line: imported module', ...]} for every minidist import inside a function."""
    out: dict[str, list[str]] = {}
    for path, tree in syntax_trees().items():
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Import):
                        names = [a.name for a in sub.names]
                    elif isinstance(sub, ast.ImportFrom) and not sub.level:
                        names = [sub.module or ""]
                    else:
                        continue
                    found |= {f"{sub.lineno}: {n}" for n in names if n.startswith("minidist")}
        if found:
            out[module_name(path)] = sorted(found, key=lambda f: int(f.split(":")[0]))
    return out


def test_imports_inside_functions_only_where_a_dependency_is_optional():
    found = imports_in_functions()
    new = {m: lines for m, lines in found.items() if m not in IMPORTS_IN_FUNCTIONS}
    gone = sorted(set(IMPORTS_IN_FUNCTIONS) - set(found))
    assert not new, "imports inside functions (move them to the top of the module):\n" + \
        "\n".join(f"  {m}: {', '.join(lines)}" for m, lines in sorted(new.items()))
    assert not gone, f"no longer needed, so strike them from IMPORTS_IN_FUNCTIONS: {gone}"


def test_the_checker_finds_a_planted_cycle_and_a_planted_inversion():
    graph = {"minidist.nn.a": {"minidist.nn.b"}, "minidist.nn.b": {"minidist.nn.a"},
             "minidist.autograd.c": {"minidist.optim.d"}, "minidist.optim.d": set()}
    assert cycles(graph) == [frozenset({"minidist.nn.a", "minidist.nn.b"})]
    assert layer("minidist.optim.d") > layer("minidist.autograd.c")
    assert layer("minidist.memory.budget_fit") > layer("minidist.memory.precision")


# The core a reader follows carries no mode that is not its own: the deterministic mode
# lives in minidist/deterministic/ and swaps modules and Functions from outside.
CORE = ("autograd", "nn", "optim", "parallel")
MODE_WORDS = re.compile(r"determinis|canonical|tiles|tree.?sum", re.IGNORECASE)


def test_the_core_holds_nothing_of_the_deterministic_mode():
    found = [f"{path.relative_to(PACKAGE.parent)}:{i}: {line.strip()}"
             for folder in CORE for path in sorted((PACKAGE / folder).rglob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1)
             if MODE_WORDS.search(line)]
    assert not found, "the deterministic mode in the core:\n" + "\n".join(found[:20])


def test_readme_s_reading_table_gives_each_algorithm_s_files_and_their_lines():
    """README's "One algorithm end to end" table: every file it names exists, and the line
    count it gives is the files' total now (the table is a claim; this keeps it true)."""
    readme = (PACKAGE.parent / "README.md").read_text()
    table = readme.split("One algorithm end to end", 1)[1].split("\n\n", 2)[1]
    rows = [r for r in table.splitlines() if r.startswith("| ") and not r.startswith("| algo")]
    assert len(rows) == 7, table
    for row in rows:
        name, files, lines = (c.strip() for c in row.strip("|").split("|"))
        folder, total = "", 0
        for ref in re.findall(r"`([\w/]+\.py)`", files):
            folder = ref.rsplit("/", 1)[0] + "/" if "/" in ref else folder
            path = PACKAGE / (ref if "/" in ref else folder + ref)
            assert path.exists(), f"{name}: {path} is missing"
            total += len(path.read_text().splitlines())
        assert total == int(lines), f"README says {name} is {lines} lines; it is {total}"


if __name__ == "__main__":            # print today's violations (to seed or prune the lists)
    g = imports()
    for a, b in sorted((a, b) for a, t in g.items() for b in t if layer(b) > layer(a)):
        print(f"against: {a} -> {b}")
    for c in cycles(g):
        print("cycle:", sorted(c))
    for m, lines in sorted(imports_in_functions().items()):
        print(f"imports in functions: {m}: {', '.join(lines)}")
    sys.exit(pytest.main([__file__, "-q"]))

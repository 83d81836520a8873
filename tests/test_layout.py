"""
The package's layout, as docs/architecture.md describes it, read from the
source: no import circle among the modules of ``twisted_relay/``;
``_twisted.py`` (the bottom layer) imports nothing of the relay's; no module
outside ``simulated/`` longer than about 700 lines; no module (the request
path included) but ``_twisted.py`` reads another object's private attributes.
"""

from __future__ import annotations

import ast
import os

from twisted.trial.unittest import SynchronousTestCase

import twisted_relay

PACKAGE = "twisted_relay"
PACKAGE_DIR = os.path.dirname(twisted_relay.__file__)

#: The longest a module may be, outside the simulated upstream.
MAX_LINES = 700

#: The one module allowed to read other objects' private attributes:
#: Twisted's, each use guarded (docs/architecture.md).
GUARDED = "twisted_relay._twisted"

#: The rows of docs/architecture.md's "The rooms", bottom to top: a module
#: imports only from its own row and the rows below it (a package stands for
#: its modules).
LAYERS = (
    ("Twisted's internals", ("_twisted",)),
    (
        "pure values and rules",
        ("_version", "_json", "_argtypes", "errors", "logs", "redact", "translation", "config", "routing", "model_list", "affinity", "bodies", "usage", "prices", "metering", "relay_keys", "usage_page", "spend_limits", "body_form", "platforms", "openai", "sse_events", "signin.person", "signin.config", "signin.tokens", "signin.people", "signin.device_flow"),
    ),
    ("message threads", ("message_threads",)),
    ("whole-body work", ("body_work", "body_worker", "body_pool")),
    ("settings", ("options", "configfile", "settings")),
    ("the upstream leg", ("chunked", "upstream_headers", "upstream_agent", "upstream", "logins", "wires")),
    ("streaming", ("sse",)),
    ("records", ("dumps", "metrics", "spend_limits_sql", "spend_shares_sql", "signin_sql", "ledger_rows", "ledger_sql", "ledger")),
    ("sign-in", ("signin",)),
    ("the request path", ("drain", "pacing", "batch", "answer", "attempts", "relayed_request", "app", "site", "admin", "spend_guard", "spend_routes")),
    ("tools", ("replay", "demo", "simulated", "ledger_report")),
    ("the process", ("gctuning", "start_checks", "service", "workers", "worker_process", "tap")),
)


def layer_of(module: str) -> int:
    """
    The row of ``module`` in :data:`LAYERS`: its first two names under the
    package (a package whose modules sit in several rows, ``signin.config``),
    else its first.
    """
    parts = module.split(".")
    for name in (".".join(parts[1:3]), parts[1]):
        for row, (_, names) in enumerate(LAYERS):
            if name in names:
                return row
    raise KeyError(module)


#: Public names that begin with an underscore (named tuples' methods).
_PUBLIC_UNDERSCORED = frozenset({"_replace", "_asdict", "_fields", "_make"})


def package_modules() -> dict[str, str]:
    """Every module of the package: dotted name -> file."""
    found = {}
    for folder, dirs, files in os.walk(PACKAGE_DIR):
        dirs[:] = sorted(d for d in dirs if not d.startswith(("_", ".")) or d == "__init__")
        relative = os.path.relpath(folder, os.path.dirname(PACKAGE_DIR))
        prefix = relative.replace(os.sep, ".")
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            stem = name[:-3]
            dotted = prefix if stem == "__init__" else "%s.%s" % (prefix, stem)
            found[dotted] = os.path.join(folder, name)
    return found


def _type_checking_only(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _import_nodes(tree: ast.AST):
    """Every import statement, at any depth (a lazy import is a dependency too), but those under ``if TYPE_CHECKING``."""
    pending = [tree]
    while pending:
        node = pending.pop()
        for child in ast.iter_child_nodes(node):
            if _type_checking_only(child):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            pending.append(child)


def imports_of(module: str, path: str, modules: dict[str, str]) -> set[str]:
    """The package's modules that ``module`` imports."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = set()
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    for node in _import_nodes(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            # ``from a import b``: the module ``a.b`` when there is one, else ``a``.
            targets = [
                "%s.%s" % (base, alias.name) if "%s.%s" % (base, alias.name) in modules else base
                for alias in node.names
            ]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target.startswith(PACKAGE) and target != module and target != PACKAGE:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    modules = package_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for following in sorted(graph.get(node, ())):
            if following not in index:
                visit(following)
                low[node] = min(low[node], low[following])
            elif following in on_stack:
                low[node] = min(low[node], index[following])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def private_reads(path: str) -> list[str]:
    """
    ``x._name`` where ``x`` is not ``self`` or ``cls``: another object's
    private attribute (dunder names are not private).
    """
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or (name.startswith("__") and name.endswith("__")) or name in _PUBLIC_UNDERSCORED:
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        found.append("%s:%d %s.%s" % (os.path.basename(path), node.lineno, ast.unparse(owner), name))
    return found


class CirclesTests(SynchronousTestCase):
    """The circle finder itself, on small graphs."""

    def test_finds_a_circle(self):
        self.assertEqual(circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}), [["a", "b", "c"]])

    def test_a_tree_has_none(self):
        self.assertEqual(circles({"a": {"b", "c"}, "b": {"c"}, "c": set()}), [])

    def test_reads_lazy_imports(self):
        path = self.mktemp()
        with open(path, "w", encoding="utf-8") as f:
            f.write(
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from twisted_relay import app\n"
                "def later():\n    from twisted_relay.service import Relay\n"
            )
        modules = package_modules()
        self.assertEqual(imports_of("twisted_relay.x", path, modules), {"twisted_relay.service"})


class LayoutTests(SynchronousTestCase):
    """The package as docs/architecture.md says it is laid out."""

    def test_no_import_circle(self):
        self.assertEqual(circles(import_graph()), [])

    def test_imports_go_down_the_rows(self):
        """Every module is in a row of :data:`LAYERS` and imports nothing from a row above its own."""
        upward = []
        for module, imported in import_graph().items():
            if module == PACKAGE:
                continue  # the package's face: it may name anything
            for other in imported:
                if layer_of(other) > layer_of(module):
                    upward.append("%s -> %s" % (module, other))
        self.assertEqual(sorted(upward), [])

    def test_no_private_imports(self):
        """No module imports another module's private name (``from twisted_relay.x import _y``)."""
        modules = package_modules()
        found = []
        for name, path in modules.items():
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            for node in _import_nodes(tree):
                if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith(PACKAGE):
                    continue
                for alias in node.names:
                    private = alias.name.startswith("_") and not alias.name.startswith("__")
                    if private and "%s.%s" % (node.module, alias.name) not in modules:
                        found.append("%s: %s.%s" % (name, node.module, alias.name))
        self.assertEqual(found, [])

    def test_twisted_internals_import_nothing_of_the_relay(self):
        self.assertEqual(import_graph()["twisted_relay._twisted"], set())

    def test_id_core_imports_no_twisted(self):
        modules = package_modules()
        core = [name for name in modules if name == "twisted_relay.translation" or name.startswith("twisted_relay.translation.")]
        self.assertTrue(core)
        for name in core:
            with open(modules[name], encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in _import_nodes(tree):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                for imported in names:
                    self.assertFalse(imported.split(".")[0] in ("twisted", "klein", "treq"), (name, imported))

    def test_modules_are_short(self):
        long = {}
        for name, path in package_modules().items():
            if name.startswith("twisted_relay.simulated"):
                continue
            with open(path, encoding="utf-8") as f:
                count = sum(1 for _ in f)
            if count > MAX_LINES:
                long[name] = count
        self.assertEqual(long, {})

    def test_no_private_reads(self):
        """No module but the guarded one reads another object's private attribute (the request path included)."""
        found = []
        for name, path in package_modules().items():
            if name != GUARDED:
                found.extend(private_reads(path))
        self.assertEqual(found, [])

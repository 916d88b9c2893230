"""The house rules a review checks by hand, as tests: no import circle, the node store's insides
stay inside it, and no class grows past what one reader holds in mind."""

from __future__ import annotations

import ast
import functools
import inspect
import pathlib
import re
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {"ucpd": ROOT / "ucpd", "ucpd_client": ROOT / "client" / "ucpd_client"}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for pkg, base in PACKAGES.items():
        for path in base.rglob("*.py"):
            rel = path.relative_to(base).with_suffix("")
            parts = [pkg, *rel.parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """Every module `name` imports, at the top or inside a function (a lazy import is still an
    edge); imports only a type checker sees are not."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    out: set[str] = set()

    def resolve(mod: str) -> None:
        while mod and mod not in MODULES:
            mod = mod.rpartition(".")[0]
        if mod and mod != name:
            out.add(mod)

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    resolve(alias.name)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - (child.level - 1)]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                for alias in child.names:
                    if f"{mod}.{alias.name}" in MODULES:
                        resolve(f"{mod}.{alias.name}")
                    else:
                        resolve(mod)
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


@functools.cache
def _graph() -> dict[str, set[str]]:
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    # A package's __init__ importing its own submodules is how a package exposes them, not a
    # circle: a submodule that imports its package gets the package's names, so keep those edges
    # only one way (submodule -> package's siblings).
    for name in graph:
        graph[name] = {m for m in graph[name] if not (name.startswith(m + ".") and MODULES[m].name == "__init__.py")}
    return graph


AREAS = ["ucpd.daemon", "ucpd.team", "ucpd.format", "ucpd.ucl", "ucpd.protocol", "ucpd.sim", "ucpd_client"]


def _area(module: str) -> str:
    return next((a for a in AREAS if module == a or module.startswith(a + ".")), "ucpd")


@pytest.mark.parametrize("area", [*AREAS, "ucpd"])
def test_no_module_takes_part_in_an_import_circle(area):
    assert [c for c in _cycles(_graph()) if any(_area(m) == area for m in c)] == []


STORE_INSIDES = [
    (re.compile(r"\.slots\.slots\b"), "the slot table"),
    (re.compile(r"\.table\.versions\b"), "the version table's dict"),
    (re.compile(r"\bstore\.lock\b"), "the store's lock"),
]
STORE_MODULES = {"ucpd/daemon/store.py", "ucpd/daemon/slots.py", "ucpd/daemon/versions.py"}


@pytest.mark.parametrize("pattern,what", STORE_INSIDES, ids=[w for _, w in STORE_INSIDES])
def test_only_the_store_touches_its_insides(pattern, what):
    offenders = []
    for path in sorted((ROOT / "ucpd").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in STORE_MODULES:
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{rel}:{lineno}: {line.strip()}")
    assert offenders == [], f"{what} is reached from outside the store"


@pytest.mark.parametrize("area", [*AREAS, "ucpd"])
def test_no_class_is_longer_than_450_lines(area):
    long = []
    for name, path in MODULES.items():
        if _area(name) != area:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1
                if size > 450:
                    long.append(f"{name}.{node.name}: {size} lines")
    assert long == []


def test_the_team_driver_stays_under_400_lines():
    assert len((ROOT / "ucpd" / "team" / "team.py").read_text().splitlines()) < 400


def _calls_outside(func: str, allowed: set[str]) -> list[str]:
    """Every call of a function or method named ``func`` in ucpd and the client outside the
    ``allowed`` files (paths from the repository root)."""
    found = []
    for path in sorted(p for base in PACKAGES.values() for p in base.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                if (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)) == func:
                    found.append(f"{rel}:{node.lineno}")
    return found


def test_one_durable_write_helper():
    """write, fsync, close, fsync the folder: written once, in ucpd.format.durable; every
    other module asks it (durable_file, write_file_new, write_file_atomic, fsync_fd)."""
    assert _calls_outside("fsync", {"ucpd/format/durable.py"}) == []


TESTS = ROOT / "tests"
# job -> (function names that do it, the one helper module that defines them)
TEST_HELPERS = {
    "waiting for a condition": ({"wait_until", "wait_for", "eventually", "_wait"}, "helpers/waiting.py"),
    "choosing a free port": ({"free_port", "_free_port"}, "helpers/daemons.py"),
}


def test_the_tests_have_one_helper_per_job():
    """One ``wait_until``, one ``free_port``, and daemon processes started only through
    ``helpers/daemons.py`` (its ``Daemon``; teams of them: ``helpers/daemon_team.DaemonTeam``).
    ``tests/format/fixtures`` holds scripts run outside pytest, on their own."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS).as_posix()
        if rel.startswith("format/fixtures/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for job, (names, home) in TEST_HELPERS.items():
                    if node.name in names and rel != home:
                        found.append(f"tests/{rel}:{node.lineno}: def {node.name} ({job} is {home}'s)")
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "spawn_and_wait":
                if rel not in ("helpers/daemons.py", "faults/test_parent_death.py"):
                    found.append(f"tests/{rel}:{node.lineno}: spawn_and_wait (start a helpers.daemons.Daemon)")
    assert found == []


def test_only_the_roots_tell_a_folder_from_an_object_store():
    """The storage seam (``ucpd.format.roots``): a checkpoint root is a ``Root``, and only the
    roots (and the object store's own module) ask whether a name is a URL."""
    assert _calls_outside("is_url", {"ucpd/format/roots.py", "ucpd/format/objstore.py"}) == []


def _face_members(*faces) -> set[str]:
    return {n for face in faces for k in face.__mro__ if k is not object
            for n in [*vars(k), *getattr(k, "__annotations__", {})] if not n.startswith("_")}


def test_the_daemon_uses_the_team_only_through_its_face():
    """``ucpd/daemon/`` reaches the team of daemons through ``versions.TeamFace`` (and the sources
    a restore gathered through ``TeamSourcesFace``): every ``<x>.team.<member>`` names a member a
    face declares, and none goes on into a part (``self.team.sources.widen``: ask the face).
    ``daemon/cli.py`` builds the team: the composition root is left out."""
    from ucpd.daemon.versions import TeamFace, TeamSourcesFace

    allowed = _face_members(TeamFace, TeamSourcesFace)
    found = []
    for path in sorted((ROOT / "ucpd" / "daemon").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "ucpd/daemon/cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "team":
                if node.attr not in allowed:
                    found.append(f"{rel}:{node.lineno}: .team.{node.attr} is not on the team's face")
            chain = node.value.value if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) else None
            if isinstance(chain, ast.Attribute) and chain.attr == "team":
                found.append(f"{rel}:{node.lineno}: .team.{node.value.attr}.{node.attr} reaches into a part of the team")
    assert found == []


def test_the_team_and_its_gathered_sources_have_what_their_faces_declare():
    from ucpd.daemon.versions import TeamFace, TeamSourcesFace
    from ucpd.team.sources import TeamSources
    from ucpd.team.team import Team

    def members(cls) -> set[str]:  # methods, properties and what __init__ assigns to self
        assigned = {t.attr for n in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(cls.__init__))))
                    if isinstance(n, (ast.Assign, ast.AnnAssign))
                    for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                    for t in (t.elts if isinstance(t, ast.Tuple) else [t]) if isinstance(t, ast.Attribute)}
        return assigned | {n for n in dir(cls) if not n.startswith("_")}

    assert _face_members(TeamFace) - members(Team) == set()
    assert _face_members(TeamSourcesFace) - members(TeamSources) == set()


def _team_chains() -> set[str]:
    """Every ``<x>.team.<member>.<attr>`` and ``team.<member>.<attr>`` in ``ucpd/team/``: a part
    reaching through the driver into another part (or its config)."""
    found = set()
    for path in sorted((ROOT / "ucpd" / "team").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
                base = node.value.value
                if (isinstance(base, ast.Name) and base.id == "team") or (isinstance(base, ast.Attribute) and base.attr == "team"):
                    found.add(f"{rel}: team.{node.value.attr}.{node.attr}")
    return found


# What is left of issue 39's chains, named: the list only shrinks (a chain gone must leave it too).
# None is left: every part takes what it uses.
TEAM_CHAINS_LEFT: set[str] = set()


def test_no_team_part_reaches_another_through_the_driver():
    """A part of the team gets what it uses (a ``view.TeamView``, the store, the transport,
    callables for what it asks a sibling): ``self.team.parity.on_unit`` is a new caller the
    parity group cannot see. The chains left are named in ``TEAM_CHAINS_LEFT``, which only shrinks."""
    found = _team_chains()
    assert sorted(found - TEAM_CHAINS_LEFT) == [], "a new chain through the team: give the part what it uses"
    assert sorted(TEAM_CHAINS_LEFT - found) == [], "gone: take it off TEAM_CHAINS_LEFT"


def _built_with_the_team() -> set[str]:
    """Every ``Part(..., team, ...)`` in ``ucpd/team/``: a class built with the whole driver
    (``self`` inside ``team.py``; ``team`` or ``self.team`` elsewhere)."""
    found = set()
    for path in sorted((ROOT / "ucpd" / "team").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if not name[:1].isupper():
                continue
            for a in [*node.args, *(k.value for k in node.keywords)]:
                if (isinstance(a, ast.Name) and (a.id == "team" or (a.id == "self" and rel == "ucpd/team/team.py"))) or (
                        isinstance(a, ast.Attribute) and a.attr == "team" and isinstance(a.value, ast.Name) and a.value.id == "self"):
                    found.add(f"{rel}: {name}")
    return found


# Parts still built with the whole team (issue 39): the list only shrinks. None is left.
BUILT_WITH_THE_TEAM_LEFT: set[str] = set()


def test_no_team_part_is_built_with_the_whole_team():
    """A part's constructor names what it takes, typed (``Replicator(view, wanted, store, ...)``),
    never the untyped driver. What is left is named in ``BUILT_WITH_THE_TEAM_LEFT``, which only shrinks."""
    found = _built_with_the_team()
    assert sorted(found - BUILT_WITH_THE_TEAM_LEFT) == [], "built with the whole team: pass what it uses"
    assert sorted(BUILT_WITH_THE_TEAM_LEFT - found) == [], "gone: take it off BUILT_WITH_THE_TEAM_LEFT"

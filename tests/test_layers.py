"""The library's dependency rule (ARCHITECTURE.md, top): imports point one way. Checked on the source, lazy imports
(inside functions) included, since a lazy import hides a circle without removing it; so are string import tables
(``"package.module:Name"``, resolved when a run starts: an import made later) and package roots (raysim/__init__.py,
the package face, and every subpackage's __init__.py).

``python tests/test_layers.py`` prints the drawing's figures (:func:`drawing`)."""
import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=None)
def parsed(path):
    """A source file's syntax tree, parsed once per test session (several tests walk the same files; none changes
    a tree)."""
    return ast.parse(Path(path).read_text(), str(path))


def module_imports(package: str = "raysim") -> dict[str, set[str]]:
    """{module: the modules of ``package`` it imports anywhere in its source}."""
    return {m: {o for o in outs if o == package or o.startswith(package + ".")}
            for m, outs in all_imports().items() if m == package or m.startswith(package + ".")}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_in_the_library():
    edges = module_imports()
    assert len(edges) > 30
    found = cycles(edges)
    assert not found, "import cycles:\n" + "\n".join(
        " <-> ".join(c) + "\n    " + "\n    ".join(f"{m} -> {sorted(edges[m] & set(c))}" for m in c) for c in found)


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_only_the_backends_import_ray():
    offenders = []
    for folder in ("raysim", "algorithms", "envs", "tuning"):
        for p in sorted((ROOT / folder).rglob("*.py")):
            if p.relative_to(ROOT).parts[:2] == ("raysim", "backends"):
                continue
            for node in ast.walk(parsed(p)):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                if any(n == "ray" or n.startswith("ray.") for n in names):
                    offenders.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"ray imported outside raysim/backends/: {offenders}"


def test_algorithms_import_only_the_contract():
    """Methods import the contract (algorithm, steps, messages, models, training, rng, config, errors, shared_maths, data
    types), never the engine's machinery, the backends or the result files."""
    allowed = {"raysim.algorithm", "raysim.steps", "raysim.messages", "raysim.models", "raysim.training",
               "raysim.rng", "raysim.config", "raysim.errors", "raysim.shared_maths", "raysim.data", "raysim.data.federated",
               "raysim.data.arrays", "raysim.data.datasets", "raysim.data.class_folders", "raysim.layers",
               "raysim.runner.grouped"}
    bad = []
    for p in sorted((ROOT / "algorithms").rglob("*.py")):
        for node in ast.walk(parsed(p)):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for m in mods:
                if m.startswith("raysim") and m not in allowed and m != "raysim":
                    bad.append(f"{p.name}:{node.lineno} {m}")
    assert not bad, f"methods reaching past the contract: {bad}"


def test_config_error_is_imported_from_raysim_errors():
    """ConfigError is imported from ``raysim.errors``, where it is defined and which imports nothing of raysim, never
    through a module that merely uses it (``raysim.config``): a method's dependency on the error is not one on the
    config plumbing."""
    bad = []
    for folder in ("raysim", "algorithms", "envs", "tuning", "tests"):
        for p in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(parsed(p)):
                if (isinstance(node, ast.ImportFrom) and not node.level
                        and node.module not in ("raysim", "raysim.errors") and (node.module or "").startswith("raysim")
                        and "ConfigError" in {a.name for a in node.names}):
                    bad.append(f"{p.relative_to(ROOT)}:{node.lineno} from {node.module}")
    assert not bad, f"ConfigError imported past raysim.errors: {bad}"


def test_the_environment_is_reached_through_the_declared_protocol():
    """envs.Environment satisfies the engine's protocol; an implementation lacking a method is refused naming env."""
    import pytest

    from raysim.engine.environment import Environment, check_environment
    from raysim.errors import ConfigError

    from envs import Environment as Impl

    assert all(callable(getattr(Impl, m)) for m in ("archs", "bind", "select", "outcome", "summary", "state_dict",
                                                     "load_state_dict"))

    class Partial:
        sim_time = 0.0

        def select(self, round_idx, target=None):
            return []

    assert not isinstance(Partial(), Environment)
    with pytest.raises(ConfigError, match="env.*lacks archs, bind, outcome"):
        check_environment(Partial())
    check_environment(None)


PACKAGES = ("raysim", "algorithms", "envs", "tuning")

# a string that names a module ("raysim.engine.loop") or an object in one ("raysim.backends.sequential:Sequential",
# "envs:Environment") is an import path: a table of them is an import made later, by name
_IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(:[A-Za-z_][\w.]*)?$")
_IMPORTERS = ("import_module", "__import__")  # whatever these are given is a module name, dotted or not


def folder_of(module: str) -> str:
    """A module's room: a subpackage of a package (``raysim.engine``, ``raysim.io``, ...), a top-level package beside
    it (``algorithms``, ``envs``, ``tuning``), or a top-level module of raysim on its own (``raysim.algorithm``; the
    package face ``raysim``, raysim/__init__.py, too)."""
    parts = module.split(".")
    if parts[0] == "raysim":
        return ".".join(parts[:2]) if len(parts) >= 3 or (ROOT / "raysim" / parts[-1]).is_dir() else module
    return parts[0]


def module_names(root: Path, packages) -> dict[str, Path]:
    """{dotted module name: its file} for every module of ``packages`` under ``root``; a package's __init__.py is
    the package itself (``raysim``, ``raysim.engine``)."""
    names = {}
    for pkg in packages:
        for p in sorted((root / pkg).rglob("*.py")):
            parts = p.relative_to(root).with_suffix("").parts
            names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return names


def _imported(node, pkg: str, names) -> list[str]:
    """The names an import statement, or a string that is an import path, reaches (not yet reduced to modules)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
            base = ".".join(up + ([base] if base else []))
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in names else base for a in node.names]
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if fn in _IMPORTERS and isinstance(node.args[0].value, str):
            return [node.args[0].value]
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and _IMPORT_PATH.match(node.value):
        module, colon, _ = node.value.partition(":")
        # "module:attr" of a known module, or a dotted name that is exactly a module (a bare "raysim" is a name:
        # a logger's, the program's, a package looked up with find_spec)
        if module in names and (colon or "." in module):
            return [module]
    return []


def import_graph(root: Path = ROOT, packages=PACKAGES) -> dict[str, set[str]]:
    """{module: every module of ``packages`` it imports}, across packages too: imports at the top and lazy ones
    (inside functions), string import tables (``"package.module:Name"``, a dotted module name, what
    ``importlib.import_module`` is given) and package roots (``raysim``: raysim/__init__.py, the package face, and
    every subpackage's __init__.py) as modules like any other."""
    names = module_names(root, packages)

    def known(name):
        while name and name not in names:
            name = name.rpartition(".")[0]
        return name or None

    edges = {}
    for name, path in names.items():
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out = set()
        for node in ast.walk(parsed(path)):
            for t in _imported(node, pkg, names):
                k = known(t)
                if k and k != name:
                    out.add(k)
        edges[name] = out
    return edges


def all_imports() -> dict[str, set[str]]:
    """The import graph of the four packages (:func:`import_graph`)."""
    return import_graph()


def drawing(edges: dict[str, set[str]], room_of=folder_of) -> dict:
    """The figures of the layer drawing: modules and their arrows, module circles (lazy and string imports
    included); rooms (:func:`folder_of`) and the arrows between them; floors, the longest downward path + 1 (a
    room that imports no other room is on floor 0); back-arrows, the arrows that close a circle of rooms (a
    depth-first walk's back edges, rooms in name order: they point up, against the floors); room circles."""
    rooms: dict[str, set[str]] = {}
    for m, outs in edges.items():
        rooms.setdefault(room_of(m), set()).update(room_of(o) for o in outs if room_of(o) != room_of(m))
    for outs in list(rooms.values()):
        for o in outs:
            rooms.setdefault(o, set())
    back, state = set(), {}

    def walk(r):
        state[r] = "open"
        for o in sorted(rooms[r]):
            if state.get(o) == "open":
                back.add((r, o))
            elif o not in state:
                walk(o)
        state[r] = "done"

    for r in sorted(rooms):
        if r not in state:
            walk(r)
    floor: dict[str, int] = {}

    def floor_of(r):
        if r not in floor:
            floor[r] = 1 + max((floor_of(o) for o in rooms[r] if (r, o) not in back), default=-1)
        return floor[r]

    return {"modules": len(edges), "module arrows": sum(map(len, edges.values())), "circles": len(cycles(edges)),
            "rooms": len(rooms), "floors": 1 + max(map(floor_of, rooms), default=-1),
            "arrows": sum(map(len, rooms.values())), "back-arrows": len(back), "room circles": len(cycles(rooms)),
            "back": sorted(back), "floor": {r: floor_of(r) for r in sorted(rooms)}}


def test_no_module_cycle_in_any_package():
    """raysim/, algorithms/, envs/ and tuning/: no import circle among their modules, lazy imports included (e.g.
    MAFML and its baselines: the shared public-data helper lives in algorithms/mutual_maths.py)."""
    edges = all_imports()
    assert {"algorithms.mafml", "algorithms.mutual_baselines", "envs", "tuning.study"} & set(edges)
    found = cycles(edges)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_drawing_has_no_circle_and_no_back_arrow():
    """The drawing (rooms on floors, the arrows between them) of the honest graph — lazy imports, string import tables
    and package roots included: no module circle, no room circle, no arrow pointing up."""
    d = drawing(all_imports())
    assert (d["circles"], d["room circles"], d["back-arrows"]) == (0, 0, 0), d["back"]
    # the package face sits on top: nothing of the packages imports it (the version is read from raysim/_version.py)
    assert not [m for m, outs in all_imports().items() if "raysim" in outs], "the package face imported from below"


def _package(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_checker_sees_lazy_imports_string_tables_and_package_roots(tmp_path):
    """A tiny package with one circle of each hidden kind: each found, and with it a back-arrow of the drawing."""
    def graph(files):
        return import_graph(_package(tmp_path / str(len(list(tmp_path.iterdir()))), files), ("pkg",))

    room = lambda m: ".".join(m.split(".")[:2])  # noqa: E731  pkg.core, pkg.app: the rooms
    base = {"pkg/__init__.py": "", "pkg/core/__init__.py": "", "pkg/app/__init__.py": "",
            "pkg/app/main.py": "from pkg.core import engine\n", "pkg/core/engine.py": "import os\n"}
    clean = graph(base)
    assert clean["pkg.app.main"] == {"pkg.core.engine"}
    assert (drawing(clean, room)["circles"], drawing(clean, room)["back-arrows"]) == (0, 0)
    planted = {
        # a lazy import inside a function
        "lazy": {"pkg/core/engine.py": "def run():\n    from pkg.app.main import go\n    return go()\n"},
        # a string table of import paths, and a module name given to importlib
        "table": {"pkg/core/engine.py": 'BACKENDS = {"x": "pkg.app.main:Backend"}\n'},
        "importlib": {"pkg/core/engine.py": "import importlib\nM = importlib.import_module('pkg.app.main')\n"},
        # the package face: a leaf below it reading what the face defines
        "root": {"pkg/core/engine.py": "def version():\n    from pkg import __version__\n    return __version__\n",
                 "pkg/__init__.py": "__version__ = '1'\n\ndef run():\n    from pkg.app.main import go\n"},
    }
    for kind, files in planted.items():
        d = drawing(graph({**base, **files}), room)
        assert d["circles"] == 1 and d["back-arrows"] >= 1, (kind, d)
    # names that are no import: a bare package name (a logger's), prose, a dotted name of an attribute
    names = {"pkg/core/engine.py": 'LOG = "pkg"\nDOC = "see pkg.app.main for more"\nK = "pkg.app.main.Backend"\n'}
    assert graph({**base, **names})["pkg.core.engine"] == set()


def test_folders_import_downwards_only():
    """Rooms (folders; top-level raysim modules each their own) form no circle: the driver side of the engine gets
    its backend by name through raysim/engine/backend.py (the interface), never by importing raysim/backends/; io/'s
    file helpers (raysim/io/files.py) sit below both io/ and the state store."""
    rooms: dict[str, set[str]] = {}
    for m, outs in all_imports().items():
        rooms.setdefault(folder_of(m), set()).update(folder_of(o) for o in outs if folder_of(o) != folder_of(m))
    for outs in list(rooms.values()):
        for o in outs:
            rooms.setdefault(o, set())
    found = cycles(rooms)
    assert not found, "folders importing each other:\n" + "\n".join(" <-> ".join(c) for c in found)
    assert "raysim.backends" not in rooms["raysim.engine"] and "raysim.engine" not in rooms["raysim.io"]
    # the runner side (runners, executors, the batched form, grouped networks, state store, footprint) is a room of
    # its own below the driver side and the backends: it imports neither
    assert not {"raysim.engine", "raysim.backends", "raysim.app"} & rooms["raysim.runner"], rooms["raysim.runner"]


def test_the_folder_check_finds_a_circle():
    assert cycles({"raysim.engine": {"raysim.backends"}, "raysim.backends": {"raysim.engine"}})


@pytest.mark.xdist_group("fresh_process")
def test_the_application_sits_on_top(fresh_process):
    """The application (raysim/app/: the command line, sweeps, reproductions, verdicts, the report) imports the
    engine; nothing below it — the contract, the config plumbing, the engine, the backends, io/, the methods, the
    environments — imports it (tuning/, the CLI's Optuna layer, neither), and ``import raysim`` does not load it."""
    below = {m: outs for m, outs in all_imports().items()
             if not m.startswith("raysim.app") and m != "raysim.__main__"}  # ``python -m raysim``: the entry point
    bad = sorted(f"{m} -> {o}" for m, outs in below.items() for o in outs if o.startswith("raysim.app"))
    assert not bad, f"the application imported from below: {bad}"
    # in a fresh process (tests/fresh_process.py): ``import raysim`` and raysim.numerics load no torch (a cluster
    # node's CPU probe, a Ray task running raysim.numerics.node_cpu before a portable run, costs its worker no torch
    # import); the Ray actor module then loads neither the application nor pandas (a Ray worker never reads a table;
    # raysim.results loads it)
    assert fresh_process["torch_after_import_raysim"] == []
    assert fresh_process["app_or_pandas_after_actor_module"] == []


def test_the_config_plumbing_sits_below_the_contract():
    """raysim/config/ (the typed sections, fields, YAML, the registry, user code, the dry run) imports neither the
    engine, the runner side, the backends, io/ nor the application: the contract and the engine build on it, never the reverse."""
    edges = all_imports()
    bad = sorted(f"{m} -> {o}" for m, outs in edges.items() if m.startswith("raysim.config")
                 for o in outs if o.split(".")[:2] in (["raysim", "engine"], ["raysim", "runner"], ["raysim", "backends"],
                                                       ["raysim", "io"], ["raysim", "app"]))
    assert not bad, f"the config plumbing reaching up: {bad}"


# -- function size: no function over 60 lines, none with more than 6 parameters -------------------------------------

MAX_LINES, MAX_PARAMS = 60, 6

# deliberately kept, each with its reason (``path:function``); an entry that no longer offends fails the test, so
# the list only shrinks
SIZE_ALLOWED = {
    "raysim/engine/loop.py:run_experiment": "the public entry point (raysim.run_experiment): its keyword-only API (out_dir, "
                                            "progress, write, resume, callbacks, prepared) is what users call",
    "raysim/backends/ray_actors.py:run_client_step": "a Ray actor method: the payload must be a top-level argument for "
                                                     "Ray to resolve its ObjectRef; the commits ride on the same call",
    "raysim/backends/ray_actors.py:run_server_step_ahead": "a Ray actor method: the upload and report refs must be "
                                                           "top-level arguments (*refs) for Ray to resolve them",
    "raysim/data/skew.py:nway_kshot": "its keyword parameters are data.partition_params keys (README), read off the "
                                      "signature by the partitioner registry",
    "tuning/study.py:tune": "the Python entry point of `raysim tune`: a documented keyword API (benchmarks/HOSTILE.md) "
                            "the CLI and users call",
}


def function_sizes(source: str) -> list[tuple[str, int, int]]:
    """(name, lines, parameters) of every function in ``source``; ``self`` / ``cls`` is not counted, ``*args`` and
    ``**kwargs`` count one each (a data class's fields are not parameters: no function defines them)."""
    out = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = n.args
            k = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
            k -= bool(a.args and a.args[0].arg in ("self", "cls"))
            out.append((n.name, n.end_lineno - n.lineno + 1, k))
    return out


def test_no_long_or_wide_function():
    """Every function of the four packages has at most 60 lines and 6 parameters (group parameters that belong
    together into a small frozen data class, split long functions into named steps), but the allowed ones."""
    found = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            for name, lines, params in function_sizes(p.read_text()):
                if lines > MAX_LINES or params > MAX_PARAMS:
                    found[f"{p.relative_to(ROOT).as_posix()}:{name}"] = f"{lines} lines, {params} parameters"
    bad = {k: v for k, v in found.items() if k not in SIZE_ALLOWED}
    assert not bad, "functions over 60 lines or 6 parameters:\n" + "\n".join(f"{k}: {v}" for k, v in sorted(bad.items()))
    stale = sorted(set(SIZE_ALLOWED) - set(found))
    assert not stale, f"allowed but no longer long or wide (remove from SIZE_ALLOWED): {stale}"


def test_the_size_check_finds_long_and_wide_functions():
    wide = "def f(a, b, c, d, e, f, g):\n    pass\n"
    method = "class C:\n    def m(self, a, b, c, d, e, f):\n        pass\n"
    long = "def g():\n" + "    x = 1\n" * 60
    assert function_sizes(wide) == [("f", 2, 7)]
    assert function_sizes(method) == [("m", 2, 6)]
    assert function_sizes(long) == [("g", 61, 0)]


def _state_outside_init(tree: ast.Module) -> list[str]:
    """``Class.attr`` for every ``self.attr = ...`` outside ``__init__`` of an attribute ``__init__`` does not create,
    and ``Class: getattr(self, ...)`` for every probe of its own attributes."""
    found = []
    for cls in [n for n in tree.body if isinstance(n, ast.ClassDef)]:
        made: dict[str, set] = {}
        for fn in [n for n in cls.body if isinstance(n, ast.FunctionDef)]:
            for n in ast.walk(fn):
                if (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr")
                        and n.args and isinstance(n.args[0], ast.Name) and n.args[0].id == "self"):
                    found.append(f"{cls.name}: {n.func.id}(self, ...)")
                targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(
                    n, (ast.AnnAssign, ast.AugAssign)) else []
                for t in targets:
                    for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                        if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                            made.setdefault(fn.name, set()).add(e.attr)
        init = made.get("__init__", set())
        found += sorted({f"{cls.name}.{a}" for fn, attrs in made.items() if fn != "__init__" for a in attrs - init})
    return found


def test_the_backends_declare_their_state():
    # the backends and their parts (recovery, balancing) create every attribute in __init__ and never probe their own
    # with getattr; the interface holds no mutable class-level defaults (one list shared by every instance). (The
    # actors of ray_actors.py are runners: their state is the runners'.)
    found = []
    names = ["sequential.py", "ray_backend.py", "ray_recovery.py", "ray_balance.py"]
    for path in [ROOT / "raysim" / "backends" / n for n in names] + [ROOT / "raysim" / "engine" / "backend.py"]:
        tree = ast.parse(path.read_text())
        found += [f"{path.name}: {f}" for f in _state_outside_init(tree)]
        for cls in [n for n in tree.body if isinstance(n, ast.ClassDef)]:
            found += [f"{path.name}: {cls.name}: a mutable class-level default" for n in cls.body
                      if isinstance(n, (ast.Assign, ast.AnnAssign))
                      and isinstance(n.value, (ast.List, ast.Dict, ast.Set))]
    assert found == []


def test_the_state_check_finds_late_attributes():
    tree = ast.parse("class A:\n    def __init__(self):\n        self.x = 1\n    def f(self):\n        self.y = 2\n"
                     "        return getattr(self, 'z', None)\n")
    assert _state_outside_init(tree) == ["A: getattr(self, ...)", "A.y"]


if __name__ == "__main__":
    figures = drawing(all_imports())
    print(", ".join(f"{figures[k]} {k}" for k in ("modules", "module arrows", "circles", "rooms", "floors", "arrows",
                                                   "back-arrows", "room circles")))
    for r, f in sorted(figures["floor"].items(), key=lambda x: (-x[1], x[0])):
        print(f"  floor {f:2d}  {r}")
    for a, b in figures["back"]:
        print(f"  back-arrow {a} -> {b}")

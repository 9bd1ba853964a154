"""Name registry: the only way the engine reaches the method modules (``"fedproto"`` -> ``algorithms.fedproto``; the
shipped methods' names are registered from above, by :mod:`raysim.shipped` when raysim is imported, so this module,
below the contract, names no method), and the user's own methods, models and datasets: by import path
(``"package.module:Name"``) or registered by name (:func:`register_algorithm`; ``raysim.register_model`` and
``raysim.register_dataset`` live beside the zoo and the loaders they check names against, :mod:`raysim.models` and
:mod:`raysim.data.datasets`, and fill :data:`MODELS` and :data:`DATASETS` here). User registrations travel to every
runner in the ``RunSpec`` (:func:`snapshot` / :func:`install`), so a name registered on the driver resolves on every
actor of a cluster too.

What a config may run: an import path written in a config resolves only to what is meant to be loaded. A module of
Python's standard library is refused before it is imported; the object an import path names must then be marked for
its use (:func:`dataset_loader`, :func:`model_factory`: the attribute ``raysim_kind``), registered from Python
(``register_dataset`` / ``register_model`` / ``register_algorithm``, whose targets are trusted), or pass the check
of its kind (a subclass of ``raysim.algorithm.Algorithm`` for ``algorithm.name``; a torchvision model builder or a
``torch.nn.Module`` subclass for ``model.arch``, :mod:`raysim.adapt`) before anything calls it. A function of the
standard library or of an installed package (``shutil:rmtree``, ``os:system``, ``numpy:save``) is none of these."""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import sys
from collections.abc import Mapping
from typing import Any, Callable, Union

from raysim.errors import ConfigError

# names -> "module:Class": the shipped methods, filled from above when raysim is imported (raysim/shipped.py: the
# methods sit above the contract, and the registry below it names none of them), and the user's own
# (register_algorithm)
ALGORITHMS: dict[str, str] = {}


# the simulated environment (device, network, participation, clock): an implementation of the engine's declared
# protocol (raysim.engine.environment.Environment), registered like a method: the environment layer (envs/) imports
# raysim, never the reverse, so the engine reaches it by a name raysim/shipped.py registers (envs.Environment)
ENVIRONMENT: dict[str, str] = {"target": ""}


def register_environment(target: str) -> None:
    """Use another environment implementation (``"module.path:Class"`` with ``Class.from_experiment(cfg, fed_data)``
    returning an object of the engine's Environment protocol) for configs with an ``env`` section."""
    if not is_import_path(target):
        raise ValueError(f"{target!r} is not an import path package.module:Class")
    ENVIRONMENT["target"] = target


def make_environment(cfg, fed_data):
    """The run's simulated environment, or None when the config has no ``env`` section."""
    if cfg.env is None:
        return None
    # the target is set from Python only (register_environment), never by a config: trusted
    return resolve(ENVIRONMENT["target"], "env", "Class", trusted=True).from_experiment(cfg, fed_data)


# ---------------------------------------------------------------------------------------------------------------
# marks: what a config may call by import path

MARK = "raysim_kind"  # attribute set by the decorators below, e.g. ``raysim_kind = "dataset_loader"``
DATASET_LOADER = "dataset_loader"
MODEL_FACTORY = "model_factory"


def _mark(obj, kind: str):
    if not callable(obj):
        raise TypeError(f"@raysim.{kind} marks a function or class, not {type(obj).__name__}")
    setattr(obj, MARK, kind)
    return obj


def dataset_loader(fn):
    """Decorator: ``fn`` may be named by ``data.dataset`` (and ``data.public.dataset``) as ``module:fn`` and is then
    called as ``fn(root, **data.dataset_params)``. A config can call no unmarked function."""
    return _mark(fn, DATASET_LOADER)


def model_factory(fn):
    """Decorator: ``fn`` may be named by ``model.arch`` as ``module:fn`` and is then called as
    ``fn(input_shape, num_classes, **model.params)``. A config can call no unmarked function."""
    return _mark(fn, MODEL_FACTORY)


def marked(obj, kind: str) -> bool:
    """``obj`` carries the mark ``kind`` as its own attribute (read from its own ``__dict__``, so an object whose
    ``__getattr__`` answers anything is not marked)."""
    try:
        d = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        return False
    return isinstance(d, Mapping) and d.get(MARK) == kind and callable(obj)


def registered(obj, target: str, table: dict) -> bool:
    """``obj`` (reached by import path ``target``) was registered from Python (``table``: MODELS or DATASETS)."""
    return any(v == target if isinstance(v, str) else v is obj for v in table.values())


def is_stdlib(module: str) -> bool:
    """``module`` belongs to Python's standard library (or is built into the interpreter)."""
    top = module.split(".")[0]
    return top in sys.stdlib_module_names or top in sys.builtin_module_names


def describe_object(obj) -> str:
    """``package.module.name`` of a function or class, for messages."""
    mod = getattr(obj, "__module__", None)
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if isinstance(mod, str) and isinstance(name, str):
        return f"{mod}.{name}"
    return type(obj).__name__ + " object"


def refuse_unmarked(key: str, target: str, obj, what: str, decorator: str, register: str) -> ConfigError:
    """The one-line refusal of an import path whose object is not marked ``what``."""
    where = describe_object(obj)
    mod = getattr(obj, "__module__", None)
    mod = mod if isinstance(mod, str) else ""
    why = (f"{where} (of Python's standard library)" if is_stdlib(mod) else
           f"{where} (of raysim itself)" if mod.split(".")[0] in _OWN_PACKAGES else
           f"{where} (of an installed package)" if installed_object(obj) else where)
    return ConfigError(key, f"{target!r} names {why}, which is not marked as a {what}; a config may call only "
                            f"functions marked with @{decorator} (import raysim) or registered from Python with "
                            f"{register}")


_OWN_PACKAGES = ("raysim", "algorithms", "envs", "tuning")


def _installed_package(module: str) -> bool:
    """The top-level package of ``module`` is installed (site-packages, dist-packages) or raysim's own, found without
    importing it."""
    top = module.split(".")[0]
    if top in _OWN_PACKAGES:
        return True
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    where = " ".join([str(spec.origin or "")] + [str(p) for p in (spec.submodule_search_locations or [])]) if spec else ""
    return "site-packages" in where or "dist-packages" in where


def installed_object(obj) -> bool:
    """``obj`` (a function or class) was defined in an installed package or the standard library."""
    mod = getattr(obj, "__module__", None)
    return isinstance(mod, str) and (is_stdlib(mod) or _installed_package(mod))


MODELS: dict[str, Union[str, Callable]] = {}  # user model factories by name: "module:factory" or a callable
DATASETS: dict[str, Union[str, Callable]] = {}  # user dataset loaders by name: "module:loader" or a callable
USER_ALGORITHMS: dict[str, str] = {}  # the algorithms registered at run time (shipped to the runners)


def register_algorithm(name: str, target: str) -> None:
    """Register ``"module.path:ClassName"`` under ``name`` (for methods that live outside this repository)."""
    ALGORITHMS[name] = target
    USER_ALGORITHMS[name] = target


def snapshot() -> dict:
    """The user registrations, as the runners need them (callables travel by reference, or by value when defined
    in ``__main__``)."""
    return {"algorithms": dict(USER_ALGORITHMS), "models": dict(MODELS), "datasets": dict(DATASETS)}


def install(snap: dict | None) -> None:
    """Make a driver's registrations (:func:`snapshot`) known in this process (a runner on an actor)."""
    if not snap:
        return
    for name, target in snap.get("algorithms", {}).items():
        ALGORITHMS[name] = USER_ALGORITHMS[name] = target
    MODELS.update(snap.get("models", {}))
    DATASETS.update(snap.get("datasets", {}))


def is_import_path(name: Any) -> bool:
    return isinstance(name, str) and name.count(":") == 1 and all(name.split(":"))


def _ensure_cwd_on_path() -> None:
    """User modules live in the working directory, which ``python -m`` puts on sys.path but an installed entry
    point does not: add it (last, so it never shadows an installed package)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


_OWN = {"loader": "dataset loaders marked with @raysim.dataset_loader",
        "factory": "model factories marked with @raysim.model_factory (or nn.Module classes, torchvision builders)",
        "Class": "subclasses of raysim.algorithm.Algorithm"}


def resolve(target: Union[str, Callable], key: str, what: str = "object", trusted: bool = False) -> Any:
    """The object an import path ``"package.module:name"`` (``name`` may be dotted) names, or ``target`` itself when
    it is already an object; a path that does not resolve is a ConfigError naming ``key``. A path from a config
    (not ``trusted``: registered from Python) may not name a module of the standard library: it is refused before
    anything is imported. Callers check the object's mark or kind before calling it."""
    if not isinstance(target, str):
        return target
    if not is_import_path(target):
        raise ConfigError(key, f"{target!r} is not an import path; write package.module:{what}")
    module, attr = target.split(":")
    if not trusted and is_stdlib(module):
        own = _OWN.get(what, f"{what}s")
        raise ConfigError(key, f"{target!r} names Python's standard library (module {module.split('.')[0]!r}); a "
                               f"config may name only {own}, registered names or the built-in choices (README: "
                               f"Bring your own model and data)")
    # a target registered from Python is the program's own choice (it may name its __main__); one from a config is not
    obj = import_config_module(module, key, target, own_program=trusted)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(key, f"module {module!r} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


# (module, working directory) -> the error its one import attempt gave (never retried; a dry run's refusals are not
# kept: the same process may run the config for real afterwards)
_FAILED_IMPORTS: dict[tuple[str, str], ConfigError] = {}


def _script_problem(module: str) -> str:
    """Why ``module`` would run a program instead of defining names ('' when it is an ordinary module): a
    ``__main__`` module (a package's command line, ``python -m``), or a spec whose file is not a module's."""
    if "__main__" in module.split("."):
        return "is a __main__ module: importing it runs that package's command line"
    spec = importlib.util.find_spec(module)  # imports the parent packages: whatever they raise is the import's error
    origin = getattr(spec, "origin", None) if spec is not None else None
    if not isinstance(origin, str) or origin in ("built-in", "frozen") or not os.path.isabs(origin):
        return ""
    if os.path.basename(origin) == "__main__.py":
        return "is a __main__ module: importing it runs that package's command line"
    if not origin.endswith(tuple(importlib.machinery.all_suffixes())):
        return f"is loaded from {os.path.basename(origin)!r}, a script, not a module file"
    return ""


def import_config_module(module: str, key: str, target: str, own_program: bool = False):
    """Import ``module``, which the config key ``key`` names (``target``), once: never a ``__main__`` module or a
    script; whatever its import raises — ``SystemExit`` included — is one ConfigError naming ``key``, remembered,
    so a later lookup does not run the module's code again; under ``--dry-run`` its top-level code writes nothing
    (installed packages too). ``own_program``: a target registered from Python (it may name the program's own
    ``__main__``), not one a config names."""
    from raysim.config import dryrun

    if (module, os.getcwd()) in _FAILED_IMPORTS:
        raise _FAILED_IMPORTS[module, os.getcwd()]
    if module in sys.modules and (own_program or "__main__" not in module.split(".")):
        return sys.modules[module]  # (a config never reaches the running program's __main__)
    _ensure_cwd_on_path()

    try:
        # installed packages are guarded too (nothing written), but a cache they make on first use and cope without
        # is not the config's fault; the user's own modules may not try at all
        with dryrun.user_code(key, f"importing {module!r}", report=not _installed_package(module)):
            problem = "" if own_program else _script_problem(module)
            if problem:
                raise ConfigError(key, f"{target!r}: module {module!r} {problem}; a config names a module that "
                                       f"defines a loader, factory or method")
            return importlib.import_module(module)
    except KeyboardInterrupt:
        raise
    except ConfigError as e:
        error = e
    except ImportError as e:
        error = ConfigError(key, f"cannot import module {module!r} of {target!r} ({type(e).__name__}: {e}); it must "
                                 f"be importable from the working directory, PYTHONPATH or an installed package")
    except BaseException as e:  # the module raised, or exited (SystemExit), while importing
        text = str(e).splitlines()[0][:200] if str(e) else ""
        error = ConfigError(key, f"importing {module!r} raised {type(e).__name__}{': ' + text if text else ''}")
    if not dryrun.is_active():
        _FAILED_IMPORTS[module, os.getcwd()] = error
    raise error from None


def check_signature(fn: Callable, args: tuple, kwargs: dict, key: str, params_key: str, expected: str) -> None:
    """ConfigError unless ``fn(*args, **kwargs)`` binds: naming ``params_key.<name>`` for a keyword the callable does
    not take, else ``key`` with the expected form."""
    if not callable(fn):
        raise ConfigError(key, f"{fn!r} is not callable; expected {expected}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins without a signature: calling them will tell
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        try:
            sig.bind(*args)
        except TypeError:
            raise ConfigError(key, f"{getattr(fn, '__qualname__', fn)}{sig} cannot be called as {expected}") from None
        params = sig.parameters
        takes_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        bad = [k for k in kwargs if not takes_kw and k not in params]
        if bad:
            allowed = [n for n, p in list(params.items())[len(args):] if p.kind is not inspect.Parameter.VAR_POSITIONAL]
            raise ConfigError(f"{params_key}.{bad[0]}", f"unknown parameter for {getattr(fn, '__qualname__', fn)}; "
                                                        f"allowed: {', '.join(allowed) or 'none'}") from None
        raise ConfigError(params_key, f"{getattr(fn, '__qualname__', fn)}{sig}: {e}") from None


def algorithm_target(name: str) -> str:
    if name not in ALGORITHMS:
        if is_import_path(name):
            cls = resolve(name, "algorithm.name", "Class")
            if not _is_algorithm_class(cls):
                raise ConfigError("algorithm.name", f"{name!r} is not a subclass of raysim.algorithm.Algorithm")
            if _is_abstract_algorithm(cls):
                raise ConfigError("algorithm.name", f"{name!r} is raysim's abstract base class (a round needs a method "
                                                    f"that implements it); name a method, e.g. fedavg, or your "
                                                    f"subclass of it")
            return name
        raise ConfigError("algorithm.name", f"{name!r} is not allowed; choose one of: {', '.join(sorted(ALGORITHMS))}, "
                                            f"or an import path package.module:Class")
    return ALGORITHMS[name]


def _is_algorithm_class(obj) -> bool:
    """``obj`` is a subclass of raysim.algorithm.Algorithm (checked by name along its MRO: the registry sits below the
    contract and does not import it)."""
    return isinstance(obj, type) and any(f"{k.__module__}.{k.__qualname__}" == "raysim.algorithm.Algorithm"
                                         for k in obj.__mro__)


def _is_abstract_algorithm(cls) -> bool:
    """``cls`` is the contract's base class itself or leaves abstract methods unimplemented."""
    import inspect

    return f"{cls.__module__}.{cls.__qualname__}" == "raysim.algorithm.Algorithm" or inspect.isabstract(cls)


def load_target(target: str):
    module, cls = target.split(":")
    _ensure_cwd_on_path()
    obj = importlib.import_module(module)
    for part in cls.split("."):
        obj = getattr(obj, part)
    return obj


def algorithm_class(name: str):
    return load_target(algorithm_target(name))

"""A reward function of the user's own: ``reward.function=PATH.py:NAME`` or ``module:NAME``.

The function is called as ``NAME(response, ground_truth)`` for every response, in place of
the verifier that the row's ``data_source`` would pick, and may return:

- a ``float`` (or ``int``): the score; the response counts as correct when it is > 0;
- a ``bool``: +1.0 and correct, or -1.0 and incorrect (the paper's R_correct);
- a :class:`~dapo.reward.tasks.base.Score`, as it is;
- a ``dict`` with ``score`` and optionally ``correct`` (a bool; default score > 0), ``pred``
  (the extracted answer: shown in samples, and what maj@k votes with) and ``vote`` (a string
  maj@k votes with instead of ``pred``; ``""`` casts no vote).

"Correct" is what dynamic sampling filters on (a group all correct or all wrong teaches
nothing) and what accuracy counts. The function runs in the reward workers like every
verifier (:mod:`dapo.reward.pool`): a deadline and a memory limit per response (its file is
imported as a worker starts, under neither); whatever it raises or returns wrongly is a
fault (``reward/faults``), graded incorrect, and training goes on. Standard library only at
module level: workers import this.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import inspect
import numbers
import site
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dapo.reward.tasks import RewardFn, Score, get_verifier
from dapo.reward.tasks.code import CodeConfig, CodeSettings
from dapo.reward.worker import is_bool, type_name

FIX = (
    "give reward.function as PATH.py:NAME (a Python file and a function in it) or "
    "package.module:NAME (an importable module), NAME taking (response, ground_truth)"
)


def is_path_spec(target: str) -> bool:
    """Whether the part before ``:NAME`` names a file rather than a module."""
    return target.endswith(".py") or "/" in target or "\\" in target


def file_inside(directory: Path, cfg: Any) -> tuple[str, str] | None:
    """The first (setting, spec) of the run config ``cfg`` whose code (its reward function,
    its environment) is a file inside ``directory`` (a run directory, perhaps from
    elsewhere: code that came with it is never run), else None."""
    specs = {"reward.function": cfg.reward.function, "env.class": cfg.env.class_}
    for key, spec in specs.items():
        if ":" not in spec:
            continue  # empty, or a built-in name
        target, _ = split_spec(spec, key)
        if is_path_spec(target):
            path = Path(target).expanduser().resolve()
            if path.is_relative_to(Path(directory).resolve()):
                return key, spec
    return None


def split_spec(spec: str, key: str = "reward.function", fix: str = FIX) -> tuple[str, str]:
    """``PATH.py:NAME`` or ``module:NAME`` -> (target, name); ValueError naming the fix.
    ``key`` and ``fix``: the config field that holds ``spec``, and how to write it."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise ValueError(f"{key}={spec!r} is not TARGET:NAME; {fix}")
    return target, name


def spec_file(spec: str, key: str = "reward.function", fix: str = FIX) -> Path:
    """The file that holds the function: the path given, or the module's source file."""
    target, _ = split_spec(spec, key, fix)
    if is_path_spec(target):
        path = Path(target).expanduser()
        if not path.is_file():
            raise ValueError(f"{key}={spec!r}: no file {path.resolve()}; {fix}")
        return path.resolve()
    try:
        found = importlib.util.find_spec(target)
    except (ImportError, ValueError) as exc:
        found, error = None, exc
    else:
        error = None
    if found is None or found.origin is None or not Path(found.origin).is_file():
        local = Path(target.replace(".", "/") + ".py")
        hint = ""
        if local.is_file():
            hint = f" (there is ./{local}: write {key}=./{local}:NAME)"
        why = f": {error}" if error else ""
        raise ValueError(f"{key}={spec!r}: no module {target!r}{why}{hint}; {fix}")
    return Path(found.origin).resolve()


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _module_name(path: Path) -> str:
    # One module per file, whatever it is called: two reward files both named rewards.py
    # must not replace each other in sys.modules.
    return "dapo_user_reward_" + hashlib.sha256(str(path).encode()).hexdigest()[:16]


def load_function(spec: str, key: str = "reward.function", fix: str = FIX) -> Callable[..., Any]:
    """Import the module or file that ``spec`` names and return its object NAME."""
    target, name = split_spec(spec, key, fix)
    if is_path_spec(target):
        path = spec_file(spec, key, fix)
        module_name = _module_name(path)
        module = sys.modules.get(module_name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(module_name, path)
            if loader_spec is None or loader_spec.loader is None:  # no .py: no loader
                raise ValueError(
                    f"{key}={spec!r}: {path} is not a .py file, and Python imports a file "
                    f"only by that name; rename it to {path.with_suffix('.py').name} and "
                    f"give {key}={path.with_suffix('.py')}:{name}"
                )
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[module_name] = module  # so that pickle and dataclasses find it
            try:
                loader_spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[module_name]
                raise
    else:
        spec_file(spec, key, fix)  # a clear error for a module that does not exist
        module = importlib.import_module(target)
    fn = getattr(module, name, None)
    if fn is None:
        where = getattr(module, "__file__", target)
        raise ValueError(f"{key}={spec!r}: {where} has no {name!r}; {fix}")
    return fn


def check_callable(fn: Any, where: str) -> None:
    """``fn`` must be callable as ``fn(response, ground_truth)``."""
    if not callable(fn):
        raise ValueError(f"{where} is a {type(fn).__name__}, not a function; {FIX}")
    try:
        inspect.signature(fn).bind("response", "ground truth")
    except TypeError as exc:
        raise ValueError(
            f"{where} cannot be called as {getattr(fn, '__name__', 'it')}(response, "
            f"ground_truth): {exc}; {FIX}"
        ) from None
    except ValueError:
        pass  # a builtin without a signature: it is called and judged by what it returns


def check_spec(spec: str) -> str:
    """Load ``spec`` and check it: the SHA-256 of its file, or ValueError with the fix."""
    path = spec_file(spec)
    try:
        fn = load_function(spec)
    except (ValueError, KeyboardInterrupt):
        raise
    except SystemExit as exc:  # not the run's end: a script's own exit, or its argparse's
        raise ValueError(
            f"reward.function={spec!r}: importing {path} called sys.exit({exc.code!r}) (a "
            "script that parses its own command line?); keep a script's work under "
            '`if __name__ == "__main__":`, so that importing the file only defines functions'
        ) from exc
    except BaseException as exc:
        raise ValueError(
            f"reward.function={spec!r}: importing {path} raised {type(exc).__name__}: {exc}"
        ) from exc
    check_callable(fn, f"reward.function={spec!r}")
    return file_sha256(path)


def check(spec: str, fn: Callable[..., Any] | None = None) -> tuple[str, str]:
    """Check the reward function before any model loads: ``spec`` (loaded here), or ``fn``,
    the function ``spec`` names, given in Python. Returns the spec (a file's made absolute, so
    that a run's config works from any directory) and the SHA-256 of its file."""
    if fn is not None:
        check_callable(fn, f"reward_fn={spec}")
        return spec, file_sha256(spec_file(spec))
    sha = check_spec(spec)
    target, name = split_spec(spec)
    return (f"{spec_file(spec)}:{name}" if is_path_spec(target) else spec), sha


def spec_for(fn: Callable[..., Any], given: str = "") -> str:
    """The spec naming ``fn`` (:func:`spec_of`); ValueError when ``given``, a spec set
    besides, names another function."""
    spec = spec_of(fn)
    if given and given != spec:
        raise ValueError(f"reward_fn names {spec} but reward.function is {given}: give one of them")
    return spec


def spec_of(fn: Callable[..., Any]) -> str:
    """The ``reward.function`` value naming ``fn``, a function given in Python: worker
    processes import it by that name, so a lambda or a nested function cannot be used."""
    qualname = getattr(fn, "__qualname__", "")
    module = getattr(fn, "__module__", None)
    if not qualname.isidentifier() or module is None:
        raise ValueError(
            f"reward_fn={fn!r} is not a top-level function of a module: reward workers are "
            "separate processes that import it by name, so a lambda, a nested function, a "
            "method or a partial cannot reach them. Define it with def at the top level of a "
            ".py file and pass that function (or reward.function=PATH.py:NAME)"
        )
    file = getattr(sys.modules.get(module), "__file__", None)
    # The script (__mp_main__ in a process that multiprocessing spawned to run its work) is
    # named by its file, as is a module of the caller's own directory, not installed: its
    # name imports only while that directory is on sys.path, and the run's config must
    # resume from any directory, with the dapo command as well as python -m dapo.
    if module in ("__main__", "__mp_main__"):
        if file is None:
            raise ValueError(
                f"reward_fn={qualname} is defined in an interactive session, which worker "
                "processes cannot import; put it in a .py file and pass reward_fn from there "
                "(or reward.function=PATH.py:NAME)"
            )
        if not _binds_at_top_level(Path(file), qualname):
            raise ValueError(
                f"reward_fn={qualname} is not defined at the top level of {Path(file).resolve()}"
                ": reward workers (and a resume) import that file as a module, where the "
                'block under `if __name__ == "__main__":` does not run; define it with def '
                'at the top level of the file, outside `if __name__ == "__main__":`'
            )
        return f"{Path(file).resolve()}:{qualname}"
    if "." not in module and str(file).endswith(".py") and not _installed(Path(file).resolve()):
        return f"{Path(file).resolve()}:{qualname}"
    return f"{module}:{qualname}"


def _binds_at_top_level(path: Path, name: str) -> bool:
    """Whether the script ``path`` binds ``name`` when imported as a module (not run): at its
    top level, or in a block there (an ``if``, a ``try``) other than its
    ``if __name__ == "__main__":``. Read, not imported: importing a script may run its work.
    A file that cannot be read or parsed is given the benefit of the doubt."""
    try:
        tree = ast.parse(path.read_bytes(), str(path))
    except (OSError, SyntaxError, ValueError):
        return True
    return name in _bound_names(tree.body)


def _bound_names(body: list[ast.stmt]) -> set[str]:
    names: set[str] = set()
    for node in body:
        if isinstance(node, ast.If) and _is_main_guard(node.test):
            names |= _bound_names(node.orelse)
            continue
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).partition(".")[0] for a in node.names}
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    continue  # a nested block's statements: walked below
                names |= {
                    n.id
                    for n in ast.walk(child)
                    if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
                }
            for field in ("body", "orelse", "finalbody", "handlers"):
                block = getattr(node, field, None)
                if isinstance(block, list):
                    names |= _bound_names([*_handler_bodies(block)])
    return names


def _handler_bodies(block: list[Any]) -> list[ast.stmt]:
    """``block``'s statements, the bodies of ``except`` handlers flattened into it."""
    out: list[ast.stmt] = []
    for node in block:
        out.extend(node.body if isinstance(node, ast.ExceptHandler) else [node])
    return out


def _is_main_guard(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    sides = [test.left, *test.comparators]
    return isinstance(test.ops[0], ast.Eq) and {
        (n.id if isinstance(n, ast.Name) else getattr(n, "value", None)) for n in sides
    } == {"__name__", "__main__"}


def _installed(path: Path) -> bool:
    """Whether ``path`` lies in the standard library or an environment's site-packages,
    where its module imports by name from any directory."""
    places = [sysconfig.get_paths()[key] for key in ("purelib", "platlib", "stdlib")]
    places += [*site.getsitepackages(), site.getusersitepackages()]
    return any(path.is_relative_to(Path(place).resolve()) for place in places if place)


def to_score(value: Any) -> Score:
    """What a user's function returned, as a Score; TypeError for anything else."""
    if isinstance(value, Score):
        return value
    if is_bool(value):  # numpy's too: what np.isclose and comparisons of numpy values give
        correct = bool(value)
        return Score(score=1.0 if correct else -1.0, correct=correct, pred="")
    if isinstance(value, numbers.Real):
        score = float(value)
        return Score(score=score, correct=score > 0, pred="")
    if isinstance(value, dict) and "score" in value:
        score = value["score"]
        if is_bool(score) or not isinstance(score, numbers.Real):
            raise TypeError(f"its 'score' is {type_name(score)}, not a number")
        correct = value.get("correct", float(score) > 0)
        if not is_bool(correct):
            raise TypeError(f"its 'correct' is {type_name(correct)}, not a bool")
        pred = value.get("pred", "")
        pred = pred if isinstance(pred, str) else ""
        vote = value.get("vote")
        if vote is not None and not isinstance(vote, str):
            raise TypeError(f"its 'vote' is {type_name(vote)}, not a str")
        return Score(score=float(score), correct=bool(correct), pred=pred, vote=vote)
    raise TypeError(
        f"a reward function returned {type_name(value)}; return a float, a bool, a Score "
        "or a dict with 'score' (and optionally 'correct', 'pred', 'vote')"
    )


class CustomReward:
    """The reward pool's ``resolve`` for a user's function: every data_source gets it.

    Pickled to the workers as its spec (and the function, when one was given in Python:
    pickle sends that by its module and name), each worker imports the function once, in
    :meth:`prepare`, as it starts: a slow import is start-up time, not a response's deadline.
    """

    def __init__(self, spec: str, fn: Callable[..., Any] | None = None) -> None:
        self.spec, self.given = spec, fn
        self._loaded: Callable[..., Any] | None = fn

    def __getstate__(self) -> dict[str, Any]:
        # Not what was loaded here: a file's module has a name only this process knows.
        return {"spec": self.spec, "given": self.given}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["spec"], state["given"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"CustomReward({self.spec!r})"

    def prepare(self) -> None:
        """Import the function now; ValueError naming its file when that fails. A reward
        worker calls this before it reports ready (:func:`dapo.reward.worker.worker_main`)."""
        if self._loaded is None:
            check_spec(self.spec)
            self._loaded = load_function(self.spec)  # imported by check_spec: no second run

    def __call__(self, data_source: str) -> RewardFn:
        if self._loaded is None:  # graded in this process (workers=0): nothing prepared it
            self._loaded = load_function(self.spec)
        fn = self._loaded
        return lambda response, ground_truth: to_score(fn(response, ground_truth))


def make_resolver(
    function: str = "", fn: Callable[..., Any] | None = None, code: CodeConfig | None = None
) -> Callable[[str], RewardFn]:
    """The reward pool's ``resolve``: the user's function when one is set, else the task
    registry (each row's verifier), with ``code`` rows graded under ``code``'s settings."""
    if function:
        return CustomReward(function, fn)
    if code is not None and not code.is_default():
        return CodeSettings(code)
    return get_verifier

"""Named factories. Models, algorithms and rewards meet only through these registries.

Every lookup accepts either a registered name or an import path, ``package.module:attribute`` or
``path/to/file.py:attribute``, so a user plugs in a custom component without touching mmgrpo::

    from mmgrpo.registry import REWARDS

    @REWARDS.register("my_reward", kind="pointwise", modality="image")
    def my_reward(batch): ...

    REWARDS.get("my_pkg.my_mod:my_fn")   # also works, with no registration
    REWARDS.get("my_rewards.py:my_fn")   # and so does a file
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import re
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any


class RegistryError(KeyError):
    """An unknown name or an import path that does not resolve. ``str()`` is a one-line message."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want the plain sentence
        return str(self.args[0])


@dataclass
class Entry:
    """One registered factory and the facts about it that listings show (for rewards: kind and modality)."""

    name: str
    obj: Any
    info: dict[str, Any] = field(default_factory=dict)


def plugin_info(obj: Any) -> dict[str, Any]:
    """The listing facts a component carries itself, for the entries the registry did not register by hand (an
    entry point, a ``module:attr`` path): its ``mmgrpo_info`` dict (``kind``, ``modality``, ``description``...),
    completed by its own string ``kind`` and ``modality`` attributes (a ``Reward`` subclass has both)."""
    info = dict(getattr(obj, "mmgrpo_info", None) or {})
    for key in ("kind", "modality"):
        value = getattr(obj, key, None)
        if isinstance(value, str):
            info.setdefault(key, value)
    return info


def _error_text(err: Exception) -> str:
    """One line for an exception raised while importing: ``file:line: message`` for a SyntaxError."""
    if isinstance(err, SyntaxError):
        return f"{err.filename}:{err.lineno}: {type(err).__name__}: {err.msg}"
    return " ".join(f"{type(err).__name__}: {err}".split())


def _import_name(obj: Any) -> str:
    """``module:qualname`` of a function or class (the form of an entry point's value); "" for other objects."""
    return f"{getattr(obj, '__module__', '')}:{getattr(obj, '__qualname__', '')}"


def _import_file(file: Path) -> ModuleType:
    """Import a Python file under a module name derived from its absolute path, once (later calls reuse it)."""
    file = file.resolve()
    name = "mmgrpo_file_" + hashlib.sha1(str(file).encode()).hexdigest()[:12] + "_" + re.sub(r"\W", "_", file.stem)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def import_path(path: str) -> Any:
    """Resolve ``package.module:attribute`` or ``path/to/file.py:attribute`` (relative to the current directory, or
    absolute) to the object it names; the attribute may be dotted."""
    module_name, _, attr = path.rpartition(":")
    if not module_name or not all(part.isidentifier() for part in attr.split(".")):  # 'C:\\rewards.py' names none
        raise RegistryError(f"'{path}' is not an import path of the form package.module:attribute or "
                            "path/to/file.py:attribute")
    try:
        if module_name.endswith(".py"):
            obj = _import_file(Path(module_name).expanduser())
        else:
            obj = importlib.import_module(module_name)
    except Exception as err:
        file = module_name.replace(".", "/") + ".py"
        missing = isinstance(err, ModuleNotFoundError) and err.name == module_name.split(".")[0]
        hint = (f" (the current directory is not on the import path; name the file: '{file}:{attr}')"
                if missing and Path(file).is_file() else "")
        raise RegistryError(f"cannot import module '{module_name}' for '{path}': {_error_text(err)}{hint}") from err
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as err:
            raise RegistryError(f"module '{module_name}' has no attribute '{attr}' (from '{path}')") from err
    return obj


class Registry:
    """A name -> factory table for one kind of component.

    ``entry_point_group`` names a packaging entry-point group (for example ``mmgrpo.rewards``) whose entries are
    added the first time the registry is read, so installed plug-in packages register themselves; their listing
    facts come from :func:`plugin_info`, as for a ``module:attr`` path. One whose name is taken (by a built-in or an
    earlier plug-in) is skipped with a warning.
    ``builtin_modules`` are imported lazily on first read, so that registering does not import heavy libraries at
    ``import mmgrpo`` time.
    """

    def __init__(self, kind: str, entry_point_group: str | None = None, builtin_modules: tuple[str, ...] = ()):
        self.kind = kind
        self.entry_point_group = entry_point_group
        self.builtin_modules = builtin_modules
        self._entries: dict[str, Entry] = {}
        self._broken: dict[str, str] = {}
        """Entry points that failed to load: name -> why (raised when that name is asked for)."""
        self._loaded = False

    def register(self, name: str, obj: Any = None, **info: Any) -> Any:
        """Register ``obj`` under ``name``; without ``obj``, return a decorator. ``info`` is free-form metadata."""

        def add(target: Any) -> Any:
            if name in self._entries and self._entries[name].obj is not target:
                raise RegistryError(f"{self.kind} '{name}' is already registered")
            self._entries[name] = Entry(name, target, dict(info))
            return target

        return add if obj is None else add(obj)

    def _load(self) -> None:
        if self._loaded:
            return
        for module in self.builtin_modules:
            importlib.import_module(module)
        if self.entry_point_group:
            for ep in metadata.entry_points(group=self.entry_point_group):
                if ep.name in self._entries:  # a built-in, or a plug-in met earlier on sys.path
                    if _import_name(self._entries[ep.name].obj) == ep.value:  # the plug-in registered itself
                        continue
                    warnings.warn(f"{self.kind} entry point {ep.name} = {ep.value} is skipped: '{ep.name}' is "
                                  f"already a {self.kind} (use '{ep.value}' to reach the plug-in)", RuntimeWarning,
                                  stacklevel=3)
                    continue
                try:
                    obj = ep.load()
                except Exception as err:  # noqa: BLE001 (a broken plug-in must not stop runs that do not use it)
                    why = f"entry point {ep.name} = {ep.value} cannot be loaded: {_error_text(err)}"
                    self._broken[ep.name] = why
                    warnings.warn(f"{self.kind} {why}; skipped", RuntimeWarning, stacklevel=3)
                    continue
                self._entries[ep.name] = Entry(ep.name, obj, {**plugin_info(obj), "source": f"entry point {ep.value}"})
        self._loaded = True

    def entry(self, name: str) -> Entry:
        """The entry for a registered name, or a synthetic one for ``package.module:attribute``."""
        if ":" in name:
            obj = import_path(name)
            return Entry(name, obj, plugin_info(obj))
        self._load()
        if name in self._broken and name not in self._entries:
            raise RegistryError(f"{self.kind} '{name}': {self._broken[name]}")
        if name not in self._entries:
            close = difflib.get_close_matches(name, list(self._entries), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            known = ", ".join(sorted(self._entries)) or "none"
            raise RegistryError(f"unknown {self.kind} '{name}'{hint} (known: {known})")
        return self._entries[name]

    def get(self, name: str) -> Any:
        """The registered object (usually a class or factory function) for ``name``."""
        return self.entry(name).obj

    def build(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call the factory registered as ``name`` with the given arguments."""
        return self.get(name)(*args, **kwargs)

    def names(self) -> list[str]:
        self._load()
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        self._load()
        return name in self._entries

    def __iter__(self) -> Iterator[Entry]:
        self._load()
        return iter(sorted(self._entries.values(), key=lambda e: e.name))


REWARDS = Registry("reward", entry_point_group="mmgrpo.rewards", builtin_modules=("mmgrpo.rewards",))
ADVANTAGES = Registry("advantage estimator", builtin_modules=("mmgrpo.grpo.advantages",))
POLICY_LOSSES = Registry("policy loss", builtin_modules=("mmgrpo.grpo.losses",))
ROLLOUT_MODES = Registry("rollout mode", builtin_modules=("mmgrpo.pipelines.flow.modes",))
MODEL_ADAPTERS = Registry("model adapter", builtin_modules=("mmgrpo.pipelines.flow.adapters",
                                                           "mmgrpo.pipelines.vlm.model"))
PIPELINES = Registry("pipeline", builtin_modules=("mmgrpo.pipelines",))
TASKS = Registry("task", builtin_modules=("mmgrpo.tasks",))
"""Synthetic tasks (``data.train_prompts: task:NAME``): objects with ``items(split) -> list[dict]``."""


"""The source guard of the model modules (``models/``): a module that restates or replaces a
transformers method names it with the sha256 of the source it was written against, and refuses the
model under a transformers whose method differs (a changed method would otherwise give silently
different numbers)."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import textwrap

WRITTEN_AGAINST = "5.25.0"  # the transformers release whose sources the model modules' hashes are


def source_hash(obj, dedent: bool = False) -> str:
    """sha256 of a function's source (the transformers original of a method coreattn wrapped); ``dedent``:
    of its dedented source (the hashes of the bias models' modules, inkling2.py and t5.py)."""
    source = inspect.getsource(getattr(obj, "coreattn_wrapped", obj))
    return hashlib.sha256((textwrap.dedent(source) if dedent else source).encode()).hexdigest()


def check_sources(module_name: str, known: dict[str, str], family: str, dedent: bool = False) -> str | None:
    """None if every ``Class.method`` (or function) of ``known`` in ``module_name`` has the source hash
    given there, else why not (naming the method)."""
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return f"this transformers has no {module_name}"
    for qualname, want in known.items():
        obj = module
        for part in qualname.split("."):
            obj = getattr(obj, part, None)
        if obj is None or source_hash(obj, dedent) != want:
            return (f"{qualname} differs from the transformers release coreattn's {family} path was written "
                    f"against ({WRITTEN_AGAINST})")
    return None


def wrap_method(cls, name: str, wrap) -> None:
    """Replace ``cls.name`` by ``wrap(original)`` once (idempotent); the original stays reachable as
    the wrapper's ``coreattn_wrapped``."""
    method = getattr(cls, name)
    if not hasattr(method, "coreattn_wrapped"):
        wrapper = wrap(method)
        wrapper.coreattn_wrapped = method
        setattr(cls, name, wrapper)

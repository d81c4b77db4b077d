"""The launcher's caches, registered in one place: ``forget`` drops every one of them (after a
plan constant changes or another GPU is emulated), so that no cache can be missed."""

from __future__ import annotations

from functools import lru_cache

_clears: list = []


def cached(maxsize: int | None = 1024):
    """``functools.lru_cache(maxsize)``, registered with ``forget``."""

    def wrap(fn):
        memo = lru_cache(maxsize=maxsize)(fn)
        _clears.append(memo.cache_clear)
        return memo

    return wrap


def table() -> dict:
    """A dictionary cache (a lookup cheaper than a function call on the hot paths), registered
    with ``forget``."""
    d: dict = {}
    _clears.append(d.clear)
    return d


def forget() -> None:
    """Drop every registered cache."""
    for clear in _clears:
        clear()


def set_plan_constant(name: str, value):
    """Set the tuned constant ``name`` of the plans to ``value`` in every plan module that
    binds it (a constant of common is imported by value elsewhere) and drop every cache;
    returns the value it had."""
    from .._plans import backward, common, forward, jagged

    modules = [m for m in (common, forward, backward, jagged) if hasattr(m, name)]
    if not name.isupper() or not modules:
        raise KeyError(f"no plan constant {name} in cupyln/_plans")
    old = getattr(modules[0], name)
    for module in modules:
        setattr(module, name, value)
    forget()
    return old

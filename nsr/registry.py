"""A name -> function registry (verl's ``register_policy_loss`` habit): variants are data, not if/elif chains; and
the method's two registries, :data:`RULES` and :data:`ADVANTAGES`."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Mapping[str, F], Generic[F]):
    """Read-only mapping of registered names; ``register(name, **info)`` is the only way in.

    ``registry[name]`` on an unknown name raises ``ValueError`` naming the field and every valid name,
    which is the error a user sees for a typo in a sweep file. ``info(name)`` returns the keyword arguments the
    entry was registered with (e.g. a rule's expected gradient weight), so facts about an entry live next to it.
    """

    def __init__(self, field: str):
        self.field = field
        self._items: dict[str, F] = {}
        self._info: dict[str, dict[str, Any]] = {}

    def register(self, name: str, **info: Any) -> Callable[[F], F]:
        def deco(fn: F) -> F:
            if name in self._items:
                raise ValueError(f"{self.field} {name!r} is registered twice")
            self._items[name] = fn
            self._info[name] = dict(info)
            return fn

        return deco

    def __getitem__(self, name: str) -> F:
        try:
            return self._items[name]
        except (KeyError, TypeError):
            raise ValueError(f"{self.field}={name!r} is not valid; allowed: {', '.join(self._items)}") from None

    def info(self, name: str) -> dict[str, Any]:
        """What ``name`` was registered with (a copy); unknown names raise like ``registry[name]``."""
        self[name]
        return dict(self._info[name])

    def __contains__(self, name: object) -> bool:  # Mapping's default catches KeyError only
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.field}: {', '.join(self._items)})"


RULES: Registry = Registry("LossConfig.rule")
"""Every clip rule, with its analytic expected weight and levels (registered in nsr.objectives and nsr.related with
``register_rule``). It lives here, apart from the rules, so the configs check a name without importing them."""
ADVANTAGES: Registry = Registry("AdvantageConfig.kind")
"""Every advantage kind (registered in nsr.advantages)."""

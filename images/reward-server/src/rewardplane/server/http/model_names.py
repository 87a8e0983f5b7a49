"""Which ``model`` names a request may carry (pure).

A client names the model the way its framework knows it: verl sends the reward model's path,
vLLM clients the served name, the SDK the generic ``reward-model``. The server answers to its
served name, the model's source (path or hub id, as given to ``--model``), every alias, the
generic default, and no name at all. Any other name is refused, even with one model served: a
trainer pointed at the wrong reward model must learn it from the first request, not from a
training curve. The error lists the accepted names and says how to add one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

GENERIC_NAME = "reward-model"


def _plain(name: str) -> str:
    """A path's plain spelling: ``./models/rm/`` and ``models/rm`` name the same checkpoint."""
    while name.startswith("./"):
        name = name[2:].lstrip("/")
    return name.rstrip("/")


def _variants(name: str) -> set[str]:
    plain = _plain(name)
    return {name, plain} if plain else {name}


@dataclass(frozen=True)
class ModelNames:
    served: str
    source: str = ""
    aliases: tuple[str, ...] = ()
    paths: tuple[str, ...] = ()
    """Other spellings of a local source (its absolute and resolved paths): accepted, not listed."""

    @classmethod
    def of(
        cls, served: str, source: str = "", aliases: Iterable[str] = (), paths: Iterable[str] = ()
    ) -> ModelNames:
        return cls(
            served=served,
            source=source,
            aliases=tuple(dict.fromkeys(a for a in aliases if a)),
            paths=tuple(dict.fromkeys(p for p in paths if p)),
        )

    @property
    def accepted(self) -> frozenset[str]:
        names = {GENERIC_NAME, *_variants(self.served)}
        if self.source:
            names |= _variants(self.source)
        for alias in (*self.aliases, *self.paths):
            names |= _variants(alias)
        return frozenset(names)

    def listed(self) -> list[str]:
        """The names ``/v1/models`` lists: the served name first, then the aliases."""
        return list(dict.fromkeys([self.served, *self.aliases]))

    def problem(self, name: str | None) -> str | None:
        """None if ``name`` is served here, else the message of the 400."""
        if not name or name in self.accepted or _plain(name) in self.accepted:
            return None
        shown = [self.served, *([self.source] if self.source else []), *self.aliases]
        return (
            f"model {name!r} is not served here; this server answers to {shown} (served name, model "
            "source, aliases) or no model at all. Send one of those, or add the name as an alias: "
            "spec.model.aliases on the RewardModel, or --model-alias on the server"
        )

"""One registry of named entries for every extension point (encoder backbones, dataset formats,
tokenizers, `sat caption`'s output formats), as timm's and torchvision's model registries keep
theirs: an entry registered once by name, looked up by name with an error that lists the names
there are, and listed in registration order (the first is a default where one is needed).

Written here rather than taken from a library: timm's and torchvision's registries hold models
only, and this is the twenty lines the four extension points share."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Generic, Protocol, TypeVar


class Named(Protocol):
    name: str


T = TypeVar("T", bound=Named)


class Registry(Mapping[str, T], Generic[T]):
    """Entries by name, in registration order. ``unknown(name, names)`` makes the error that
    ``find`` raises for a name that is not registered (each extension point says it in its own
    words and with its own exception class, e.g. a usage error for a command-line value)."""

    def __init__(self, kind: str, unknown: Callable[[object, list[str]], Exception]):
        self.kind = kind
        self._unknown = unknown
        self._entries: dict[str, T] = {}

    def register(self, entry: T) -> T:
        """Add ``entry`` (a name registered twice is a programming error)."""
        if entry.name in self._entries:
            raise ValueError(f"{self.kind} {entry.name!r} is already registered")
        self._entries[entry.name] = entry
        return entry

    def find(self, name: object) -> T:
        """The entry ``name``, or the extension point's error naming every registered one."""
        try:
            return self._entries[name]  # type: ignore[index]
        except (KeyError, TypeError):  # TypeError: an unhashable value from a config file
            raise self._unknown(name, list(self._entries)) from None

    def __getitem__(self, name: str) -> T:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

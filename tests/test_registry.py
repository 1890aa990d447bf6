"""The one registry class behind every extension point (registry.py)."""

from dataclasses import dataclass

import pytest

from showattendtell.registry import Registry


@dataclass
class Entry:
    name: str


class Unknown(ValueError):
    pass


def test_entries_in_registration_order_and_an_unknown_name_lists_them():
    reg: Registry[Entry] = Registry("thing", lambda n, names: Unknown(f"{n!r}: {names}"))
    a, b = reg.register(Entry("b")), reg.register(Entry("a"))
    assert list(reg) == ["b", "a"] and reg.find("a") is b and reg["b"] is a and len(reg) == 2
    with pytest.raises(Unknown, match=r"'c': \['b', 'a'\]"):
        reg.find("c")
    with pytest.raises(Unknown):  # an unhashable value from a config file is unknown too
        reg.find(["a"])
    with pytest.raises(ValueError, match="thing 'a' is already registered"):
        reg.register(Entry("a"))
    assert reg.find("a") is b  # the first registration stays

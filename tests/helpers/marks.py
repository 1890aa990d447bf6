"""Skip marks for tests that need something outside Python."""

from __future__ import annotations

import pytest

from showattendtell.metrics import java_available

needs_java = pytest.mark.skipif(
    not java_available(), reason="Java is not installed (the official METEOR and PTB tokenizer)"
)

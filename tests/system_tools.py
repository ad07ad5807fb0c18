"""Programs the tests run that pip does not install (redis-server has its own
module, tests/redis_server.py)."""

from __future__ import annotations

import shutil

import pytest


def system_tool(name: str, missing: str, *, optional: bool = False) -> str:
    """The path of `name`; when it is not installed the test fails (or, for an
    `optional` tool, is skipped) with `missing`, which says how to get it."""
    path = shutil.which(name)
    if path is None:
        (pytest.skip if optional else pytest.fail)(f"{name} is not installed; {missing}")
    return path

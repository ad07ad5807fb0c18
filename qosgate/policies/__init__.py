"""Policies shipped inside the package, so that `qosgate demo` works from an
installed wheel as from the checkout (where policies/example.yaml links here)."""

from __future__ import annotations

from importlib import resources


def example_policy() -> str:
    """The path of the example policy: tiers, demo tenants, the simulated GPU."""
    return str(resources.files(__name__).joinpath("example.yaml"))

"""The package's public API: `qosgate.__all__`, re-exported lazily from the
modules behind it."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import qosgate


def test_every_public_name_is_the_object_its_module_defines():
    names = [n for n in qosgate.__all__ if n != "__version__"]
    assert len(names) == len(set(names)) >= 20
    for name in names:
        value = getattr(qosgate, name)
        module = importlib.import_module(qosgate._WHERE[name])
        assert value is getattr(module, name), name
    assert set(qosgate.__all__) <= set(dir(qosgate))
    assert isinstance(qosgate.__version__, str) and qosgate.__version__


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_thing"):
        qosgate.no_such_thing  # noqa: B018


@pytest.mark.parametrize("module", ["qosgate", "qosgate.core.scheduler"])
def test_importing_the_package_or_its_core_loads_no_network_stack(module):
    # The core is sans-I/O: a simulator, a benchmark or a test can use it
    # without the HTTP server, the Redis client or an engine being imported.
    code = (
        f"import sys, {module}; "
        "print(sorted(m for m in ('aiohttp', 'redis', 'vllm', 'uvloop') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

"""qosgate/core is sans-I/O and stands alone: it imports only itself and the
standard library, so every adapter (HTTP, backends, quotas, fleet, config)
depends on it and never the other way round."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

CORE = Path(__file__).resolve().parent.parent / "qosgate" / "core"


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                names.add("qosgate.core")  # relative: inside core
            elif node.module is not None:
                names.add(node.module)
    return names


def test_core_imports_only_core_and_the_standard_library():
    files = sorted(CORE.glob("*.py"))
    assert len(files) >= 6
    outside = {
        f"{path.name}: {name}"
        for path in files
        for name in imported_modules(path)
        if not (name == "qosgate.core" or name.startswith("qosgate.core."))
        and name.split(".")[0] not in sys.stdlib_module_names
    }
    assert not outside, sorted(outside)


def test_the_check_sees_an_import_from_outside(tmp_path):
    # The walk above would pass vacuously if it missed imports.
    probe = tmp_path / "probe.py"
    probe.write_text("import qosgate.config.models\nfrom redis import Redis\nfrom . import x\n")
    assert imported_modules(probe) == {"qosgate.config.models", "redis", "qosgate.core"}

"""A compose file as `docker compose config` would render it, for machines
without the compose plugin: YAML (anchors and `<<` merges resolved), then
compose's variable interpolation in every string value, from a given
environment and nothing else (no `.env` file is read; docker/ has none).

The interpolation follows the Compose specification ("Interpolation"):
`$$` is a literal `$`; `$VAR` and `${VAR}` are the value, or empty when
unset; `${VAR:-d}` is d when VAR is unset or empty, `${VAR-d}` only when
unset; `${VAR:?msg}` fails with msg when VAR is unset or empty, `${VAR?msg}`
only when unset; `${VAR:+r}` is r when VAR is set and not empty, `${VAR+r}`
when set. Defaults, messages and replacements are interpolated in turn
(`${A:-${B}}`). A `$` followed by anything else is an invalid template.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

_NAME = re.compile(r"[_A-Za-z][_A-Za-z0-9]*")
_OPERATORS = (":?", ":-", ":+", "?", "-", "+")


class InterpolationError(ValueError):
    """A required variable is missing (`${VAR:?msg}`), or a template is invalid."""


def interpolate(text: str, env: Mapping[str, str]) -> str:
    out: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char != "$":
            out.append(char)
            i += 1
            continue
        nxt = text[i + 1 : i + 2]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "{":
            end = _closing_brace(text, i + 2)
            out.append(_braced(text[i + 2 : end], env, text))
            i = end + 1
        elif (name := _NAME.match(text, i + 1)) is not None:
            out.append(env.get(name.group(), ""))
            i = name.end()
        else:
            raise InterpolationError(f"invalid interpolation format in {text!r}")
    return "".join(out)


def _closing_brace(text: str, start: int) -> int:
    depth = 1
    i = start
    while i < len(text):
        if text.startswith("$$", i):
            i += 2
            continue
        if text.startswith("${", i):
            depth += 1
            i += 2
            continue
        if text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise InterpolationError(f"invalid interpolation format in {text!r}: unclosed ${{")


def _braced(body: str, env: Mapping[str, str], whole: str) -> str:
    name = _NAME.match(body)
    if name is None:
        raise InterpolationError(f"invalid interpolation format in {whole!r}")
    var, rest = name.group(), body[name.end():]
    if not rest:
        return env.get(var, "")
    op = next((o for o in _OPERATORS if rest.startswith(o)), None)
    if op is None:
        raise InterpolationError(f"invalid interpolation format in {whole!r}")
    arg = rest[len(op):]
    value = env.get(var)
    set_ = value is not None
    nonempty = bool(value)
    present = nonempty if op.startswith(":") else set_
    kind = op[-1]
    if kind == "-":
        return value if present else interpolate(arg, env)  # type: ignore[return-value]
    if kind == "+":
        return interpolate(arg, env) if present else ""
    if not present:
        message = interpolate(arg, env)
        raise InterpolationError(f"required variable {var} is missing a value: {message}")
    return value  # type: ignore[return-value]


def _walk(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, dict):
        return {key: _walk(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [_walk(value, env) for value in node]
    return node


def render(path: Path, env: Mapping[str, str]) -> dict[str, Any]:
    """The compose file at `path`, interpolated from `env` alone."""
    return _walk(yaml.safe_load(path.read_text()), env)

"""The one YAML loader: text -> validated pydantic model, or every problem with its line.

Parsing follows yaml.safe_load, but the document is composed into nodes first so
that every field path can be traced back to the line it came from. Problems of
all kinds (YAML syntax, duplicate keys, types, unknown keys, cross-field
references) come out as one ConfigError listing `source:line: path: message`.
"""

from __future__ import annotations

import difflib
import os
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from qosgate.config.models import PolicyConfig

__all__ = [
    "ConfigError",
    "ConfigIssue",
    "load_model",
    "load_model_text",
    "load_policy",
    "load_policy_text",
]

M = TypeVar("M", bound=BaseModel)

FieldPath = tuple[str | int, ...]
Position = tuple[int, int]
"""0-based line and column of a node in the document."""

_MERGE_TAG = "tag:yaml.org,2002:merge"
_NULL_TAG = "tag:yaml.org,2002:null"
_YAML_LINE_BREAK = re.compile("\r\n|[\n\r\x85\u2028\u2029]")
_EXPECTED_PREFIX = "Input should be "
# A line of a cross-field error message that starts with the field it is about,
# e.g. "tenants.3.tier: unknown tier 'gold'". Spaces are not allowed in the path
# so that prose such as "tier name 'a b': ..." is not mistaken for one.
_EMBEDDED_PATH = re.compile(r"^(?P<path>[A-Za-z_][\w\-]*(?:\.[\w\-]+)*): (?P<message>.+)$")


@dataclass(frozen=True)
class ConfigIssue:
    """One problem in a config file. `path` is dotted (`tenants.3.tier`, '' for the
    whole file); `line` is 1-based, None when no line applies (e.g. a missing file)."""

    path: str
    line: int | None
    message: str

    def render(self, source: str) -> str:
        where = source if self.line is None else f"{source}:{self.line}"
        return f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"


class ConfigError(ValueError):
    """A config file that cannot be used; `issues` lists every problem found."""

    def __init__(self, source: str, issues: list[ConfigIssue]) -> None:
        self.source = source
        self.issues = issues
        super().__init__("\n".join(issue.render(source) for issue in issues))


def load_policy(path: str | os.PathLike[str]) -> PolicyConfig:
    """Read and validate a policy file."""
    return load_model(PolicyConfig, Path(path))


def load_policy_text(text: str, source: str = "<string>") -> PolicyConfig:
    """Validate policy YAML given as text; `source` names it in error messages."""
    return load_model_text(PolicyConfig, text, source)


def load_model(model_cls: type[M], path_or_text: str | os.PathLike[str]) -> M:
    """Load any YAML-backed model (policy, scenario, ...).

    A path object is a file; a str is YAML text when it holds a newline and a
    file path otherwise (use load_model_text for one-line YAML).
    """
    if isinstance(path_or_text, str) and "\n" in path_or_text:
        return load_model_text(model_cls, path_or_text)
    source = os.fspath(path_or_text)
    try:
        text = Path(source).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise _file_error(source, "file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise _file_error(source, f"cannot read file: {exc}") from None
    # Paths written in a file (a profile file, say) are relative to that file.
    return load_model_text(model_cls, text, source, base_dir=Path(source).resolve().parent)


def load_model_text(
    model_cls: type[M], text: str, source: str = "<string>", *, base_dir: Path | None = None
) -> M:
    """Validate YAML text against `model_cls`; raise ConfigError listing every
    issue. Relative paths in it resolve against `base_dir` (default: the
    working directory)."""
    data, lines = _parse(text, source)
    context = {"base_dir": base_dir} if base_dir is not None else None
    try:
        return model_cls.model_validate(data, context=context)
    except ValidationError as exc:
        raise ConfigError(source, _validation_issues(exc, lines, model_cls)) from None
    except RecursionError:
        raise _file_error(source, "document is nested too deeply") from None


def _file_error(source: str, message: str, line: int | None = None) -> ConfigError:
    """A problem of the whole file, not of one field."""
    return ConfigError(source, [ConfigIssue("", line, message)])


# --- YAML -> data + line map -------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """SafeLoader whose constructor failures always carry the offending node's line."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except yaml.YAMLError:
            raise
        except Exception as exc:
            # SafeConstructor raises bare ValueError/AttributeError/... on some
            # malformed scalars (`2001-02-30`, `!!timestamp x`); they are input errors.
            tag = str(node.tag).rsplit(":", 1)[-1]
            what = _shown(node.value) if isinstance(node, yaml.ScalarNode) else "this value"
            # int()'s refusal of a very long number ends by advising a change
            # to Python's settings, which is no advice to the policy's author.
            detail = f": {str(exc).split('; use sys.')[0]}" if isinstance(exc, ValueError) else ""
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read {what} as {tag}{detail}", node.start_mark
            ) from exc


def _parse(text: str, source: str) -> tuple[dict[Any, Any], dict[FieldPath, int]]:
    lines: dict[FieldPath, int] = {}
    positions: dict[Position, FieldPath] = {}
    loader: _Loader | None = None
    try:
        loader = _Loader(text)
        root = loader.get_single_node()
        if root is None or (isinstance(root, yaml.ScalarNode) and root.tag == _NULL_TAG):
            raise _file_error(source, "file is empty; expected a mapping of settings")
        if not isinstance(root, yaml.MappingNode):
            if isinstance(root, yaml.SequenceNode):
                kind = "a list"
            else:
                kind = f"a single value ({root.value!r})"
            message = f"top level must be a mapping of settings, found {kind}"
            raise _file_error(source, message, _line(root))
        duplicates: list[ConfigIssue] = []
        _walk(root, (), lines, positions, duplicates, set())
        if duplicates:
            raise ConfigError(source, duplicates)
        data = loader.construct_document(root)
    except yaml.MarkedYAMLError as exc:
        raise ConfigError(source, [_yaml_issue(exc, lines, positions)]) from None
    except yaml.reader.ReaderError as exc:
        # Raised before any mark exists; its position is a character offset.
        line = len(_YAML_LINE_BREAK.findall(text, 0, exc.position)) + 1
        message = f"invalid YAML: character #x{exc.character:04x} is not allowed in YAML"
        raise _file_error(source, message, line) from None
    except yaml.YAMLError as exc:
        raise _file_error(source, f"invalid YAML: {exc}") from None
    except RecursionError:
        raise _file_error(source, "document is nested too deeply") from None
    finally:
        if loader is not None:
            loader.dispose()
    return data, lines


def _yaml_issue(
    exc: yaml.MarkedYAMLError, lines: dict[FieldPath, int], positions: dict[Position, FieldPath]
) -> ConfigIssue:
    mark = exc.problem_mark or exc.context_mark
    message = exc.problem or exc.context or str(exc)
    if mark is None:
        return ConfigIssue("", None, f"invalid YAML: {message}")
    line = mark.line + 1
    if exc.problem and exc.context:
        if exc.problem.startswith("but "):
            message = f"{exc.context}, {exc.problem}"
        elif exc.context_mark is not None:
            # e.g. an unclosed '{': the problem shows at the end, the cause is where it opened.
            message += f" ({exc.context} at line {exc.context_mark.line + 1})"
    # Errors found while building values come after the line map exists: name
    # the field whose value starts where the error points, else the deepest field
    # written on that line. Syntax errors come before it and get ''.
    path = positions.get((mark.line, mark.column))
    if path is None:
        on_line = [path for path, path_line in lines.items() if path_line == line]
        path = max(on_line, key=len, default=())
    return ConfigIssue(_dotted(path), line, f"invalid YAML: {message}")


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _shown(text: str, limit: int = 40) -> str:
    """`text` quoted, cut short when long (a 5,000-digit number says nothing more in full)."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def _walk(
    node: yaml.Node,
    path: FieldPath,
    lines: dict[FieldPath, int],
    positions: dict[Position, FieldPath],
    duplicates: list[ConfigIssue],
    visited: set[int],
) -> None:
    """Record the line of every field path below `node`, where each value
    starts, and every duplicate key."""
    lines.setdefault(path, _line(node))
    positions.setdefault((node.start_mark.line, node.start_mark.column), path)
    # An alias shares its anchor's node: descending again would loop on recursive
    # anchors and blow up on alias bombs. Paths inside it fall back to the alias's line.
    if id(node) in visited:
        return
    visited.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _walk(item, (*path, index), lines, positions, duplicates, visited)
    elif isinstance(node, yaml.MappingNode):
        first_line: dict[tuple[str, str], int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                # Keys that override merged-in ones are allowed; merged entries have no line here.
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                continue  # the constructor reports unhashable keys with their line
            identity = (key_node.tag, key_node.value)
            child = (*path, key_node.value)
            if identity in first_line:
                duplicates.append(
                    ConfigIssue(
                        _dotted(child),
                        _line(key_node),
                        f"duplicate key {key_node.value!r} (first at line {first_line[identity]}); "
                        "YAML would silently keep only the last one",
                    )
                )
                continue
            first_line[identity] = _line(key_node)
            # A field's line is where its key is written, which is where people look.
            lines[child] = _line(key_node)
            _walk(value_node, child, lines, positions, duplicates, visited)


# --- pydantic errors -> issues ---------------------------------------------------------


def _validation_issues(
    exc: ValidationError, lines: dict[FieldPath, int], model_cls: type[BaseModel]
) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    # Errors from the branches of one plain union (e.g. str | int | bool) land on the
    # same field; they are merged into one "should be a or b" issue.
    alternatives: dict[tuple[str, int | None], list[str]] = {}

    def at(path: FieldPath, message: str) -> ConfigIssue:
        # A path not in the document (a missing field) is at its parent's line.
        return ConfigIssue(_dotted(path), _line_of(path, lines), message)

    errors = exc.errors()
    for error in errors:
        loc = tuple(error["loc"])
        if error["type"] == "too_short" and _has_deeper_error(loc, errors):
            continue  # a list emptied by its items' own errors; those say what is wrong
        resolved, unresolved = _resolve(loc, lines)
        kind = error["type"]
        raised = _raised(error)
        if kind == "missing" and unresolved:
            # The missing field is the last element; unresolved ones before it are labels.
            issues.append(at((*resolved, unresolved[-1]), "required field is missing"))
        elif kind == "extra_forbidden":
            issues.append(at(resolved, _unknown_key(model_cls, loc)))
        elif kind == "value_error" and isinstance(raised, ConfigError):
            # A field that names another file (a scenario's policy) failed to load:
            # keep that file's issues whole, at the field that refers to it.
            issues.extend(at(resolved, inner.render(raised.source)) for inner in raised.issues)
        elif kind == "value_error" and raised is not None and not unresolved:
            for path, message in _split_embedded(resolved, str(raised), lines):
                issues.append(at(path, message))
        else:
            message = _describe(error)
            issue = at(resolved, message)
            if unresolved:
                key = (issue.path, issue.line)
                if key not in alternatives:
                    issues.append(issue)
                    alternatives[key] = []
                alternatives[key].append(message)
            else:
                issues.append(issue)
    merged = [_merge_alternatives(issue, alternatives) for issue in issues]
    unique = list(dict.fromkeys(merged))
    return sorted(unique, key=lambda issue: (issue.line is not None, issue.line or 0))


def _has_deeper_error(loc: tuple[Any, ...], errors: list[Any]) -> bool:
    return any(
        len(other["loc"]) > len(loc) and tuple(other["loc"][: len(loc)]) == loc for other in errors
    )


def _resolve(loc: tuple[Any, ...], lines: dict[FieldPath, int]) -> tuple[FieldPath, FieldPath]:
    """Split a pydantic loc into the part present in the document and the rest.

    Elements that are not in the document are pydantic's own labels (a union
    branch like 'str', a discriminator tag like 'openai', '[key]') or, for a
    missing field, the field itself; they are skipped while walking down.
    """
    resolved: FieldPath = ()
    unresolved: list[str | int] = []
    for element in loc:
        for candidate in (element, str(element)):
            if (*resolved, candidate) in lines:
                resolved = (*resolved, candidate)
                break
        else:
            unresolved.append(element)
    return resolved, tuple(unresolved)


def _line_of(path: FieldPath, lines: dict[FieldPath, int]) -> int | None:
    """The line of `path`, or of its nearest ancestor written in the document."""
    while path not in lines and path:
        path = path[:-1]
    return lines.get(path)


def _dotted(path: FieldPath) -> str:
    return ".".join(str(part) for part in path)


def _raised(error: Any) -> Exception | None:
    """The exception a validator raised (pydantic's msg prefixes it with "Value error, ")."""
    return error.get("ctx", {}).get("error")


def _describe(error: Any) -> str:
    message = error["msg"]
    if error["type"] == "value_error" and _raised(error) is not None:
        message = str(_raised(error))
    value = error.get("input")
    if isinstance(value, (str, int, float, bool)) or value is None:
        shown = repr(value)
        if len(shown) <= 60:
            message = f"{message} (got {shown})"
    return message


def _merge_alternatives(
    issue: ConfigIssue, alternatives: dict[tuple[str, int | None], list[str]]
) -> ConfigIssue:
    options = alternatives.get((issue.path, issue.line), [])
    if len(options) < 2:
        return issue
    if all(option.startswith(_EXPECTED_PREFIX) for option in options):
        # "Input should be a valid string (got [1])" -> "a valid string"
        expected = [option[len(_EXPECTED_PREFIX) :].split(" (got ")[0] for option in options]
        message = _EXPECTED_PREFIX + ", or ".join(dict.fromkeys(expected))
    else:
        message = "; or ".join(dict.fromkeys(options))
    return ConfigIssue(issue.path, issue.line, message)


def _split_embedded(
    base: FieldPath, text: str, lines: dict[FieldPath, int]
) -> list[tuple[FieldPath, str]]:
    """Cross-field validators report several problems, one per line, each starting
    with the field path it is about (relative to the validated model)."""
    found: list[tuple[FieldPath, str]] = []
    for raw in text.splitlines():
        if not raw.strip():
            continue
        match = _EMBEDDED_PATH.match(raw)
        if match is None:
            found.append((base, raw))
            continue
        found.append((_resolve_dotted(base, match["path"].split("."), lines), match["message"]))
    return found


def _resolve_dotted(base: FieldPath, parts: list[str], lines: dict[FieldPath, int]) -> FieldPath:
    """Turn dotted parts into a field path, rejoining parts of keys that contain dots
    (a tier named `gpt.4`) when the document says so."""
    path = base
    index = 0
    while index < len(parts):
        for end in range(len(parts), index, -1):
            key = ".".join(parts[index:end])
            candidate = (*path, int(key)) if _is_index(key) and end == index + 1 else None
            if candidate is not None and candidate in lines:
                path, index = candidate, end
                break
            if (*path, key) in lines:
                path, index = (*path, key), end
                break
        else:
            # Not in the document (e.g. a defaulted field): keep the text as written.
            part = parts[index]
            path, index = (*path, int(part) if _is_index(part) else part), index + 1
    return path


def _is_index(part: str) -> bool:
    return part.isascii() and part.isdigit()


def _unknown_key(model_cls: type[BaseModel], loc: tuple[Any, ...]) -> str:
    key = loc[-1] if loc else "?"
    message = f"unknown key {key!r}"
    owner = _model_at(model_cls, loc[:-1])
    if owner is None:
        return message
    allowed = sorted(owner.model_fields)
    close = difflib.get_close_matches(str(key), allowed, n=1)
    if close:
        message += f"; did you mean {close[0]!r}?"
    return f"{message} (allowed: {', '.join(allowed)})"


def _model_at(model_cls: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model class that validates the value at `loc`, found from the type hints."""
    current: Any = model_cls
    remaining = list(loc)
    while True:
        current = _unwrap(current)
        origin = typing.get_origin(current)
        if origin in (typing.Union, types.UnionType):
            models = [m for m in map(_unwrap, typing.get_args(current)) if _is_model(m)]
            if len(models) == 1:
                current = models[0]  # `Model | None`: pydantic adds nothing to the loc
                continue
            if not remaining:
                return None
            # Discriminated union: pydantic's loc holds the tag ('openai'), which names the member.
            current = _union_member(models, remaining.pop(0))
            if current is None:
                return None
            continue
        if not remaining:
            return current if _is_model(current) else None
        element = remaining.pop(0)
        if _is_model(current):
            field = current.model_fields.get(str(element))
            if field is None:
                return None
            current = field.annotation
        elif origin is dict and len(typing.get_args(current)) == 2:
            current = typing.get_args(current)[1]
        elif origin in (tuple, list) and typing.get_args(current):
            current = typing.get_args(current)[0]
        else:
            return None


def _is_model(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, BaseModel)


def _unwrap(hint: Any) -> Any:
    while typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    return hint


def _union_member(models: list[type[BaseModel]], tag: Any) -> type[BaseModel] | None:
    for model in models:
        for field in model.model_fields.values():
            if typing.get_origin(field.annotation) is typing.Literal and tag in typing.get_args(
                field.annotation
            ):
                return model
    return None

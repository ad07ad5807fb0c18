"""The simulated GPUs' cost profiles: data, read by config validation (a
policy names a profile) and by the simulated engine (which runs one).

A profile is a YAML file of CostProfile's fields (docs/SIMULATE.md, "Profile
files"). The built-in ones are such files, shipped in `qosgate/sim_profiles/`;
wherever a profile is named, a path to a file of one's own works as well.

Kept apart from the engine so that the config package imports no backend.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

MAX_COST_MS = 1e6
"""Any one cost coefficient, in ms (per token, sequence or step)."""
MAX_TOKENS = 10**9


def _no_bool(value: object) -> object:
    # YAML reads yes/no/true/false as booleans, which pydantic would count as 1 and 0.
    if isinstance(value, bool):
        raise ValueError(f"Input should be a number, not {str(value).lower()}")
    return value


_Cost = Annotated[float, Field(ge=0, le=MAX_COST_MS, allow_inf_nan=False), BeforeValidator(_no_bool)]
_Count = Annotated[int, Field(ge=1, le=MAX_TOKENS), BeforeValidator(_no_bool)]


class CostProfile(BaseModel):
    """One simulated GPU + model: the step cost model and the engine's limits.

    A step costs, in ms, `t0 + c_p*P + c_q*sum(l_i^2) + c_chunk*C +
    c_d*D**decode_exponent + c_kv*K` (docs/SIMULATE.md), with P the prefill
    tokens of the step, l_i each of its C prefill chunks' length, D the
    decoding sequences and K their total context tokens. A request also holds
    its slot for `request_overhead_ms` before the engine sees it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    name: Annotated[str, Field(min_length=1, max_length=128)]
    """What reports call it."""
    description: str = ""
    t0_ms: _Cost
    """Fixed cost of a step (weights streamed once, kernel launches)."""
    c_p: _Cost
    """ms per prefill token."""
    c_q: _Cost
    """ms per squared prefill-chunk token (attention within the chunk)."""
    c_chunk: _Cost = 0.0
    """ms per prefill chunk in the step: a sequence's own set-up (blocks,
    sampling its first token), which a lone prefill pays beside the step's t0."""
    c_d: _Cost
    """ms per decoding sequence (per D**decode_exponent)."""
    c_kv: _Cost
    """ms per context token read by the decoding sequences."""
    kv_capacity_tokens: _Count
    """KV-cache size in tokens."""
    max_num_seqs: _Count
    """Sequences running at once."""
    max_num_batched_tokens: _Count
    """Tokens per engine step."""
    decode_exponent: Annotated[
        float, Field(gt=0, le=4, allow_inf_nan=False), BeforeValidator(_no_bool)
    ] = 1.0
    """1.0 is the linear model above. Below 1, the per-sequence decode cost
    falls as the batch fills the GPU; only a profile whose table no linear
    model can fit sets it (see `a100-llama3-8b`)."""
    enable_chunked_prefill: bool = True
    """Whether the engine splits long prefills across steps."""
    request_overhead_ms: _Cost = 0.0
    """Time a dispatched request holds its slot before the engine takes it
    in: the HTTP hop to the engine and the server's own handling. Zero for a
    GPU in the gateway's process; a remote engine under load can spend more
    here than in its steps."""

    def step_ms(
        self, prefill_chunks: Sequence[int], decode_seqs: int, decode_context_tokens: int
    ) -> float:
        p = sum(prefill_chunks)
        q = sum(chunk * chunk for chunk in prefill_chunks)
        d = decode_seqs if self.decode_exponent == 1.0 else decode_seqs**self.decode_exponent
        return (
            self.t0_ms
            + self.c_p * p
            + self.c_q * q
            + self.c_chunk * len(prefill_chunks)
            + self.c_d * d
            + self.c_kv * decode_context_tokens
        )


def is_profile_path(reference: str) -> bool:
    """A profile reference is a file when it looks like a path; else a built-in's name."""
    return "/" in reference or reference.endswith((".yaml", ".yml"))


def _issues(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(part) for part in error['loc']) or '(top level)'}: {error['msg']}"
        for error in exc.errors()
    )


def load_profile_file(path: str | Path) -> CostProfile:
    """A profile file, validated. Raises ValueError naming the file and each
    bad field."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"profile file {str(path)!r} not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"profile file {str(path)!r}: cannot read it ({exc})") from None
    try:
        data: Any = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"profile file {str(path)!r}: invalid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"profile file {str(path)!r}: must be a mapping of CostProfile's fields")
    try:
        return CostProfile.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"profile file {str(path)!r}: {_issues(exc)}") from None


def _builtins() -> dict[str, CostProfile]:
    folder = resources.files("qosgate") / "sim_profiles"
    files = sorted(str(entry) for entry in folder.iterdir() if entry.name.endswith(".yaml"))
    profiles = [load_profile_file(Path(file)) for file in files]
    return {profile.name: profile for profile in profiles}


PROFILES: dict[str, CostProfile] = _builtins()
"""The built-in profiles by name: the files of qosgate/sim_profiles/."""


def resolve_profile(reference: str, base_dir: str | Path | None = None) -> str:
    """The canonical reference of a profile: a built-in's name as it is, a
    file's path made absolute (relative to `base_dir`, else the working
    directory). The file is read and validated now; ValueError says what is
    wrong."""
    if not is_profile_path(reference):
        get_profile(reference)
        return reference
    path = Path(reference).expanduser()
    if not path.is_absolute():
        path = Path(base_dir or Path.cwd()) / path
    resolved = str(path.resolve())
    get_profile(resolved)
    return resolved


def get_profile(reference: str) -> CostProfile:
    """A built-in profile by name, or a profile file by path (read once)."""
    if is_profile_path(reference):
        return _profile_file(reference)
    try:
        return PROFILES[reference]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise ValueError(
            f"unknown profile {reference!r} (known: {known}; or the path of a profile file)"
        ) from None


@functools.lru_cache(maxsize=64)
def _profile_file(path: str) -> CostProfile:
    # Cached, so that every engine of one process runs the same object and a
    # file edited under a running gateway changes nothing until a restart.
    return load_profile_file(path)

"""What the gateway answers: OpenAI's response objects and the admin and
probe documents, as pydantic models.

They are the schema the OpenAPI document publishes (openapi.py generates its
answer schemas from them), and tests validate what the renderers in render.py
send against them. The renderers build plain dicts: a streamed chunk is
rendered for every token, and building a model per chunk costs several times
the dict it would serialize to.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, WithJsonSchema

Logprobs = Annotated[
    dict[str, Any] | None,
    # One schema for both endpoints' shapes (chat's `content`, completions'
    # `tokens`...): the gateway relays what its backend computed.
    WithJsonSchema({"type": ["object", "null"]}),
]


class _Open(BaseModel):
    # A backend may relay fields of its own (vLLM's stop_reason, tool calls):
    # clients ignore what they do not expect.
    model_config = ConfigDict(extra="allow")


class Usage(BaseModel):
    prompt_tokens: NonNegativeInt
    completion_tokens: NonNegativeInt
    total_tokens: NonNegativeInt


class ChatMessage(_Open):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(_Open):
    index: Literal[0]
    message: ChatMessage
    logprobs: Logprobs
    finish_reason: str


class CompletionChoice(_Open):
    index: Literal[0]
    text: str
    logprobs: Logprobs
    finish_reason: str


class _Answer(BaseModel):
    id: str
    created: int
    model: str


class ChatCompletion(_Answer):
    object: Literal["chat.completion"]
    choices: Annotated[list[ChatChoice], Field(min_length=1, max_length=1)]
    usage: Usage


class Completion(_Answer):
    object: Literal["text_completion"]
    choices: Annotated[list[CompletionChoice], Field(min_length=1, max_length=1)]
    usage: Usage


class ChatDelta(_Open):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Open):
    index: Literal[0]
    delta: ChatDelta
    logprobs: Logprobs
    finish_reason: str | None


class CompletionChunkChoice(CompletionChoice):
    finish_reason: str | None


class ChatCompletionChunk(_Answer):
    """One event of a streamed chat completion. The last one carries `usage`
    (asked for with stream_options.include_usage: alone, with no choice)."""

    object: Literal["chat.completion.chunk"]
    choices: Annotated[list[ChatChunkChoice], Field(max_length=1)]
    usage: Usage | None = None


class CompletionChunk(_Answer):
    """One event of a streamed text completion (OpenAI names it like the
    whole answer)."""

    object: Literal["text_completion"]
    choices: Annotated[list[CompletionChunkChoice], Field(max_length=1)]
    usage: Usage | None = None


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")

    message: Annotated[str, Field(min_length=1)]
    type: str
    code: str | None
    param: str | None = Field(description="The field at fault, e.g. `messages.0.role`.")


class Error(BaseModel):
    """OpenAI's error shape, for every error the gateway answers."""

    model_config = ConfigDict(extra="forbid")

    error: ErrorDetail


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str = Field(
        description=(
            "As vLLM lists it: the path or name the model was loaded from (vllm backend), "
            "else the id."
        )
    )
    parent: None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class Status(BaseModel):
    status: str


class QuotaLimit(BaseModel):
    limit: float
    used: float
    remaining: float
    reset_s: float


class TenantQuota(BaseModel):
    """A tenant of the policy: its tier and each of its limits."""

    tier: str
    limits: dict[str, QuotaLimit]


class FleetLevels(BaseModel):
    """Fleet mode: the shared queue as read from Redis."""

    queued: dict[str, NonNegativeInt]
    running: NonNegativeInt


class BatchJobs(BaseModel):
    """The Batch API's jobs by status, and per tenant its lines still to run."""

    jobs: dict[str, NonNegativeInt]
    queued: dict[str, NonNegativeInt]


class Stats(_Open):
    time: float
    ready: bool
    scheduler: dict[str, Any]
    backend: dict[str, Any]
    tiers: dict[str, dict[str, Any]]
    requests: dict[str, Any] | None = None
    slo: dict[str, Any] | None = None
    ttft: dict[str, Any] | None = None
    batches: dict[str, Any] | None = None
    quotas: dict[str, TenantQuota]
    fleet: FleetLevels | None = Field(
        None, description="Null on one node, or when Redis was not read in time."
    )
    batch_jobs: BatchJobs | None = Field(None, description="Null without `batch.data_dir`.")


class QuotaStore(_Open):
    """The quota store and the guard's counters (store errors, fallbacks...)."""

    kind: str
    on_error: str
    reachable: bool


class Quotas(BaseModel):
    store: QuotaStore
    tenants: dict[str, TenantQuota]


class Reloaded(BaseModel):
    status: Literal["reloaded"]
    path: str
    tiers: list[str]
    tenants: NonNegativeInt


class FileObject(BaseModel):
    """OpenAI's file object: a batch's input, output or error file."""

    model_config = ConfigDict(extra="forbid")

    id: str
    object: Literal["file"]
    bytes: NonNegativeInt
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["processed"]
    status_details: None
    expires_at: int | None


class FileList(BaseModel):
    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"]
    deleted: bool


class BatchRequestCounts(BaseModel):
    total: NonNegativeInt
    completed: NonNegativeInt
    failed: NonNegativeInt


class BatchError(BaseModel):
    code: str
    message: str
    line: int | None
    param: str | None


class BatchErrors(BaseModel):
    object: Literal["list"]
    data: list[BatchError]


class Batch(BaseModel):
    """OpenAI's batch object."""

    model_config = ConfigDict(extra="forbid")

    id: str
    object: Literal["batch"]
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: Literal[
        "validating", "failed", "in_progress", "finalizing", "completed", "expired",
        "cancelling", "cancelled",
    ]  # fmt: skip
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: BatchRequestCounts
    metadata: dict[str, str] | None


class BatchList(BaseModel):
    object: Literal["list"]
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool


ANSWERS: tuple[type[BaseModel], ...] = (
    ChatCompletion,
    Completion,
    ChatCompletionChunk,
    CompletionChunk,
    Error,
    ModelList,
    Status,
    Stats,
    Quotas,
    Reloaded,
    FileObject,
    FileList,
    FileDeleted,
    Batch,
    BatchList,
)
"""Every document the gateway answers with, by the name the OpenAPI document
gives its schema."""

CHOICES_WITH_LOGPROBS: tuple[type[BaseModel], ...] = (
    ChatChoice,
    CompletionChoice,
    ChatChunkChoice,
    CompletionChunkChoice,
)
"""The choices that carry `logprobs`: null where the backend cannot compute them."""

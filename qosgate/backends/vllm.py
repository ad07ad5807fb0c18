"""`backend.kind: vllm`: a vLLM `AsyncLLM` (the v1 engine) in the gateway's process.

qosgate owns the queue; the engine owns the batch. The dispatcher hands the
engine only what it can run now (free sequence slots and free KV tokens), so
the backlog waits in the tier queues, where it can be reordered, aged, expired
or refused, and the engine's own waiting queue stays short. Each request
carries its engine priority (the tier's, as lowered by the client) as vLLM's
`priority`, for `scheduling_policy: priority`.

Prompts are tokenized here, with the model's tokenizer (chat requests through
the model's chat template when it has one), once: the count admission and
quotas use is the length of the very ids the engine is given.

The engine starts in a worker thread, so the gateway answers /healthz (and
/readyz false) while it loads; requests wait in their queues meanwhile. An
engine that dies fails its running requests with 503 and leaves the gateway
unready, so queued requests end 503 with Retry-After at their deadline rather
than hang.

vLLM is an optional dependency (`pip install 'qosgate[vllm]'`, or the CPU
build: README). Nothing here imports it until the backend starts.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

from qosgate.backends.base import (
    BackendError,
    BackendUnavailable,
    Chunk,
    GenerationJob,
)
from qosgate.backends import support
from qosgate.config.models import VllmBackendConfig
from qosgate.core.scheduler import BackendCapacity

log = logging.getLogger(__name__)

_DEAD_RETRY_AFTER_S = 5.0
"""Retry-After for requests refused because the engine died: it does not come
back by itself; another replica can serve them."""

_TOKENIZED_KEPT = 4096
"""Prompts tokenized for their count and not yet run (queued, or refused)."""

# OpenAI request fields that map one to one onto SamplingParams.
_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos",
)  # fmt: skip

ENGINE_DEFAULTS: dict[str, Any] = {
    # The gateway passes priorities; vLLM honours them only under this policy.
    "scheduling_policy": "priority",
}


@dataclasses.dataclass(eq=False)
class _Run:
    """A request the engine holds."""

    prompt_tokens: int
    generated: int = 0
    aborted: bool = False


class VllmBackend:
    """The `Backend` port over a co-located vLLM `AsyncLLM`."""

    def __init__(self, cfg: VllmBackendConfig) -> None:
        self.cfg = cfg
        self.models: tuple[str, ...] = (cfg.served_model_name or cfg.model,)
        self.support = support.VLLM
        self.engine: Any = None
        """The AsyncLLM, once started."""
        self._tokenizer: Any = None
        self._starting: asyncio.Task[None] | None = None
        self._start_error: BaseException | None = None
        self._dead = False
        self._closed = False
        self._listener: Callable[[], None] = lambda: None
        self._runs: dict[str, _Run] = {}
        self._tokenized: collections.OrderedDict[int, tuple[dict[str, Any], list[int]]] = (
            collections.OrderedDict()
        )
        self._max_seqs = 0
        self._block_size = 16
        self._kv_tokens = 0
        self._aborts: set[asyncio.Task[None]] = set()
        self.died = asyncio.Event()
        """Set when the engine has died (it does not come back by itself)."""

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        """Start loading the engine and return at once; `ready()` turns true
        (and the capacity listener fires) when it is up."""
        args = self.engine_args()
        self._starting = asyncio.get_running_loop().create_task(
            self._start_engine(args), name="qosgate-vllm-start"
        )

    def engine_args(self) -> dict[str, Any]:
        """The engine arguments: the policy's, over qosgate's defaults."""
        return {**ENGINE_DEFAULTS, **self.cfg.engine_args, "model": self.cfg.model}

    async def _start_engine(self, args: dict[str, Any]) -> None:
        try:
            try:
                from vllm.engine.arg_utils import AsyncEngineArgs
                from vllm.v1.engine.async_llm import AsyncLLM
            except ImportError as exc:
                raise BackendError(
                    "backend.kind vllm needs vLLM: pip install 'qosgate[vllm]' (GPU) or the "
                    "CPU build (README, 'vLLM backend')"
                ) from exc
            known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
            unknown = sorted(set(args) - known)
            if unknown:
                raise BackendError(
                    f"backend.engine_args.{unknown[0]}: not a vLLM engine argument"
                )
            engine_args = AsyncEngineArgs(**args)
            # Building the engine waits for its EngineCore process to load the
            # model (tens of seconds): off the event loop, which keeps serving.
            engine = await asyncio.to_thread(AsyncLLM.from_engine_args, engine_args)
        except BaseException as exc:
            self._start_error = exc
            log.error("the vLLM engine did not start: %s", exc)
            raise
        if self._closed:
            await asyncio.to_thread(engine.shutdown)
            return
        self.engine = engine
        self._watch_engine(engine)
        self._tokenizer = engine.tokenizer
        cache = engine.vllm_config.cache_config
        self._block_size = int(cache.block_size)
        self._kv_tokens = int(cache.num_gpu_blocks or 0) * self._block_size
        self._max_seqs = int(engine.vllm_config.scheduler_config.max_num_seqs)
        log.info(
            "vLLM engine ready: %s, %d sequences, %d KV tokens",
            self.cfg.model, self._max_seqs, self._kv_tokens,
        )  # fmt: skip
        self._listener()

    def _watch_engine(self, engine: Any) -> None:
        """Learn of the engine's death when it happens, not at the next request:
        AsyncLLM's output handler task ends when its EngineCore is gone. It is
        started here (vLLM starts it lazily, at the first request)."""
        start_handler = getattr(engine, "_run_output_handler", None)
        if start_handler is not None:
            start_handler()
        handler = getattr(engine, "output_handler", None)
        if isinstance(handler, asyncio.Future):
            handler.add_done_callback(lambda _task: None if self._closed else self._died())

    async def wait_ready(self) -> None:
        """Until the engine is up (raises what stopped it from starting)."""
        if self._starting is not None:
            await asyncio.shield(self._starting)

    async def close(self) -> None:
        self._closed = True
        for request_id in list(self._runs):
            self.abort(request_id)
        if self._aborts:
            await asyncio.gather(*self._aborts, return_exceptions=True)
        if self._starting is not None and not self._starting.done():
            # The thread cannot be interrupted; the engine is shut down as
            # soon as it is built (see _start_engine).
            self._starting.cancel()
        engine, self.engine = self.engine, None
        if engine is not None:
            await asyncio.to_thread(engine.shutdown)

    # -- state -------------------------------------------------------------------

    def ready(self) -> bool:
        engine = self.engine
        if engine is None or self._closed:
            return False
        if not self._dead and engine.errored:
            self._died()
        return not self._dead

    def capacity(self) -> BackendCapacity:
        if not self.ready():
            return BackendCapacity(0, 0, self._kv_tokens or None)
        block = self._block_size
        held = sum(
            math.ceil((run.prompt_tokens + run.generated) / block) * block
            for run in self._runs.values()
        )
        return BackendCapacity(
            max(0, self._max_seqs - len(self._runs)),
            max(0, self._kv_tokens - held),
            self._kv_tokens,
        )

    def set_capacity_listener(self, listener: Callable[[], None]) -> None:
        self._listener = listener

    def gone(self) -> BackendUnavailable | None:
        """Set once the engine died or failed to start: it will not come back
        by itself (see the port)."""
        if self._dead or (self.engine is not None and self.engine.errored):
            return BackendUnavailable("the vLLM engine died", _DEAD_RETRY_AFTER_S)
        if self._start_error is not None:
            return BackendUnavailable(
                f"the vLLM engine did not start: {self._start_error}", _DEAD_RETRY_AFTER_S
            )
        return None

    def _died(self) -> None:
        if not self._dead:
            self._dead = True
            log.error("the vLLM engine died; the gateway is not ready")
            self.died.set()
            self._listener()

    # -- prompts ---------------------------------------------------------------

    def _prompt_ids(self, endpoint: str, body: dict[str, Any]) -> list[int]:
        tokenizer = self._tokenizer
        if endpoint == "chat":
            messages = body.get("messages") or []
            if getattr(tokenizer, "chat_template", None):
                text = tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True,
                    **({"tools": body["tools"]} if body.get("tools") else {}),
                )  # fmt: skip
            else:
                text = _plain_chat(messages)
            # The template writes any special tokens itself.
            return list(tokenizer.encode(text, add_special_tokens=False))
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            prompt = prompt[0] if prompt else ""
        return list(tokenizer.encode(prompt if isinstance(prompt, str) else ""))

    def count_prompt_tokens(self, endpoint: str, body: dict[str, Any]) -> int:
        if self._tokenizer is None:
            # Before the engine is up: the estimate, as the sim backend counts.
            from qosgate.backends.tokens import estimate_prompt_tokens

            return estimate_prompt_tokens(endpoint, body)
        ids = self._prompt_ids(endpoint, body)
        kept = self._tokenized
        kept[id(body)] = (body, ids)
        if len(kept) > _TOKENIZED_KEPT:
            kept.popitem(last=False)
        return max(1, len(ids))

    def _take_ids(self, job: GenerationJob) -> list[int]:
        entry = self._tokenized.pop(id(job.body), None)
        if entry is not None and entry[0] is job.body:
            return entry[1]
        return self._prompt_ids(job.endpoint, job.body)

    # -- requests ----------------------------------------------------------------

    def generate(self, job: GenerationJob) -> AsyncIterator[Chunk]:
        if not self.ready():
            if self._dead:
                raise BackendUnavailable("the vLLM engine died", _DEAD_RETRY_AFTER_S)
            raise BackendUnavailable("the vLLM engine is not ready")
        ids = self._take_ids(job)
        run = _Run(prompt_tokens=len(ids))
        # Counted from here, before the first await, as the port requires.
        self._runs[job.request_id] = run
        return self._stream(job, ids, run)

    def _sampling_params(self, job: GenerationJob) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        body = job.body
        fields = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        return SamplingParams(
            n=1,
            max_tokens=job.max_tokens,
            stop=stop or None,
            output_kind=RequestOutputKind.DELTA,
            **fields,
        )

    async def _stream(self, job: GenerationJob, ids: list[int], run: _Run) -> AsyncIterator[Chunk]:
        from vllm.v1.engine.exceptions import EngineDeadError

        engine = self.engine
        request_id = job.request_id
        try:
            try:
                params = self._sampling_params(job)
            except (TypeError, ValueError) as exc:
                raise BackendError(f"the engine refused the sampling parameters: {exc}") from exc
            outputs = engine.generate(
                {"prompt_token_ids": ids}, params, request_id, priority=job.priority
            )
            try:
                async for out in outputs:
                    if run.aborted:
                        break
                    completion = out.outputs[0] if out.outputs else None
                    if completion is None:
                        continue
                    delta = len(completion.token_ids)
                    run.generated += delta
                    if out.finished:
                        usage = {
                            "prompt_tokens": len(ids),
                            "completion_tokens": run.generated,
                            "total_tokens": len(ids) + run.generated,
                        }
                        yield Chunk(
                            text=completion.text, tokens=delta,
                            finish_reason=completion.finish_reason or "stop", usage=usage,
                        )  # fmt: skip
                        return
                    if completion.text or delta:
                        yield Chunk(text=completion.text, tokens=delta)
            finally:
                await outputs.aclose()
        except EngineDeadError as exc:
            self._died()
            raise BackendUnavailable("the vLLM engine died", _DEAD_RETRY_AFTER_S) from exc
        except (BackendError, GeneratorExit, asyncio.CancelledError):
            raise
        except Exception as exc:
            if engine.errored:
                self._died()
                raise BackendUnavailable("the vLLM engine died", _DEAD_RETRY_AFTER_S) from exc
            raise BackendError(f"the vLLM engine failed the request: {exc}") from exc
        finally:
            if self._runs.pop(request_id, None) is not None:
                self._listener()

    def abort(self, request_id: str) -> None:
        run = self._runs.get(request_id)
        engine = self.engine
        if run is None or run.aborted or engine is None:
            return
        run.aborted = True
        task = asyncio.get_running_loop().create_task(engine.abort(request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)


def _plain_chat(messages: list[Any]) -> str:
    """A model without a chat template: role-prefixed lines, then the
    assistant's turn."""
    lines = []
    for message in messages:
        if isinstance(message, dict):
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(
                    p.get("text", "") for p in content if isinstance(p, dict)
                )
            lines.append(f"{message.get('role', 'user')}: {content or ''}")
    lines.append("assistant:")
    return "\n".join(lines)

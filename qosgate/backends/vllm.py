"""`backend.kind: vllm`: a vLLM `AsyncLLM` (the v1 engine) in the gateway's process.

qosgate owns the queue; the engine owns the batch. The dispatcher hands the
engine only what it can run now (free sequence slots and free KV tokens), so
the backlog waits in the tier queues, where it can be reordered, aged, expired
or refused, and the engine's own waiting queue stays short. Each request
carries its engine priority (the tier's level as lowered by the client, then
its prompt's size class) as vLLM's `priority`, for `scheduling_policy: priority`.

Prompts are rendered here once, by the engine's own renderer (chat requests
through the model's chat template, content parts as vLLM's server renders
them; token-id prompts as given): the count admission and quotas use is the
length of the very ids the engine is given, and equals what vLLM's own server
would count.

Every value reaching the engine has been typed and ranged by the gateway's
request model; what the engine still refuses (an id past the vocabulary, a
`top_p` of 0) comes back as `BackendRejected`, a 400 naming the field.

The engine starts in a worker thread, so the gateway answers /healthz (and
/readyz false) while it loads; requests wait in their queues meanwhile.
Before it reports ready it answers one warm-up request with logprobs, a path
vLLM builds at its first use (2.7 s on its CPU engine, 30 ms after). An
engine that dies (its EngineCore process gone) or wedges (requests in flight
and no output for `stall_timeout_s`) is fenced at once: the gateway turns
unready, the requests it was running end 503 with Retry-After, and it is
restarted with backoff while queued requests wait within their budgets.

vLLM is an optional dependency (`pip install 'qosgate[vllm]'`, or the CPU
build: README). Nothing here imports it until the backend starts.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import re
from collections.abc import AsyncIterator
from typing import Any

from qosgate.backends import support
from qosgate.backends.base import (
    Backend,
    BackendError,
    BackendRejected,
    BackendUnavailable,
    Chunk,
    GenerationJob,
)
from qosgate.backends.tokens import estimate_prompt_tokens
from qosgate.config.models import VllmBackendConfig
from qosgate.core.scheduler import BackendCapacity

log = logging.getLogger(__name__)

_DOWN_RETRY_AFTER_S = 5.0
"""Retry-After for requests ended because the engine died or wedged: it is
being restarted (tens of seconds); another replica can serve them sooner."""

_MAX_BACKOFF_S = 60.0
"""The longest wait between two tries to restart the engine."""

_WARM_UP_S = 60.0
"""The longest the warm-up request may take before the engine is used without it."""

_RENDERED_KEPT = 4096
"""Prompts rendered for their count and not yet run (queued, or refused)."""

# Request fields that map one to one onto SamplingParams (typed and ranged by
# the gateway's request model).
_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos",
    "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
    "spaces_between_special_tokens",
)  # fmt: skip

# vLLM's names for what a client set under another name.
_PARAM_NAMES = {"structured_outputs": "response_format"}

ENGINE_DEFAULTS: dict[str, Any] = {
    # The gateway passes priorities; vLLM honours them only under this policy.
    "scheduling_policy": "priority",
}


@dataclasses.dataclass(eq=False)
class _Run:
    """A request the engine holds."""

    prompt_tokens: int
    submitted_at: float
    """loop.time() it was handed to the engine."""
    generated: int = 0
    answered: bool = False
    """Whether the engine gave it any output yet."""
    text_offset: int = 0
    """Characters of output so far (completions' logprobs `text_offset`)."""
    aborted: bool = False
    fenced: str | None = None
    """Why the engine was fenced under this run, if it was."""


class VllmBackend(Backend):
    """The `Backend` port over a co-located vLLM `AsyncLLM`."""

    def __init__(self, cfg: VllmBackendConfig) -> None:
        self.cfg = cfg
        self.models: tuple[str, ...] = (cfg.served_model_name or cfg.model,)
        # Clients such as vLLM's benchmark read a model's root to find its
        # tokenizer: the path or hub name loaded, which served_model_name hides.
        self.model_roots = {self.models[0]: cfg.model}
        self.support = support.VLLM
        # A priority means nothing to an engine told to go first come, first
        # served, and vLLM documents one there as an error.
        self._takes_priority = self.engine_args()["scheduling_policy"] == "priority"
        self.max_model_len: int | None = None
        """The engine's context, once it is up."""
        self.engine: Any = None
        """The AsyncLLM, while one is up."""
        self.restarts = 0
        """Engines started again after one died or wedged."""
        self.warm_ups = 0
        """Warm-up requests sent: one to each engine started (`_warm_up`)."""
        self.warm_up_s: float | None = None
        """How long the last one took (None: none answered)."""
        self._starting: asyncio.Task[None] | None = None
        self._start_error: BaseException | None = None
        self._dead = False
        self._closed = False
        self._runs: dict[str, _Run] = {}
        self._rendered: collections.OrderedDict[
            int, tuple[dict[str, Any], dict[str, Any] | BackendRejected]
        ] = collections.OrderedDict()
        self._max_seqs = 0
        self._step_tokens = cfg.engine_count("max_num_batched_tokens")
        """What engine_args set, then what the engine took (vLLM's own
        default when they set none), once it is up."""
        self._block_size = 16
        self._kv_tokens = 0
        self._aborts: set[asyncio.Task[None]] = set()
        self._progress_at = 0.0
        """loop.time() of the engine's last output (or of the first run of
        an idle engine): what the stall watchdog measures from."""
        self._watchdog: asyncio.TimerHandle | None = None
        self._restarting: asyncio.Task[None] | None = None
        self.died = asyncio.Event()
        """Set while the engine is down (died or wedged, not yet restarted)."""
        self.back = asyncio.Event()
        """Set once an engine restarted after a death is up (cleared at the next death)."""

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        """Start loading the engine and return at once; `ready()` turns true
        (and the capacity listener fires) when it is up."""
        self._starting = asyncio.get_running_loop().create_task(
            self._start_first(), name="qosgate-vllm-start"
        )

    @property
    def step_tokens(self) -> int | None:
        return self._step_tokens

    @property
    def arrival_order_queue(self) -> bool:  # type: ignore[override]
        return not self._takes_priority

    def engine_args(self) -> dict[str, Any]:
        """The engine arguments: the policy's, over qosgate's defaults."""
        return {**ENGINE_DEFAULTS, **self.cfg.engine_args, "model": self.cfg.model}

    async def _start_first(self) -> None:
        try:
            engine = await self._build_engine()
        except BaseException as exc:
            self._start_error = exc
            log.error("the vLLM engine did not start: %s", exc)
            raise
        if engine is not None:
            self._adopt(engine)

    async def _build_engine(self) -> Any:
        """A new AsyncLLM, or None when the backend was closed meanwhile."""
        args = self.engine_args()
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
            raise BackendError(f"backend.engine_args.{unknown[0]}: not a vLLM engine argument")
        engine_args = AsyncEngineArgs(**args)
        # Building the engine waits for its EngineCore process to load the
        # model (tens of seconds): off the event loop, which keeps serving.
        engine = await asyncio.to_thread(AsyncLLM.from_engine_args, engine_args)
        if not self._closed:
            await self._warm_up(engine)
        if self._closed:
            await asyncio.to_thread(engine.shutdown)
            return None
        return engine

    async def _warm_up(self, engine: Any) -> None:
        """One request of one token with logprobs, before the engine reports
        ready. vLLM builds that path at its first use: on its CPU engine the
        first such request took 2.7 s and every later one 30 ms, a wait that
        would otherwise be some client's, past a short queue budget. A
        failure is logged, not fatal: the engine then serves without it."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, logprobs=1)
        self.warm_ups += 1
        self.warm_up_s = None
        request_id = f"qosgate-warm-up-{self.warm_ups}"
        started = asyncio.get_running_loop().time()
        try:
            async with asyncio.timeout(_WARM_UP_S):
                async for _ in engine.generate({"prompt_token_ids": [0]}, params, request_id):
                    pass
        except Exception as exc:
            log.warning("the vLLM engine's warm-up request failed (%s); it serves without it",
                        exc)
            return
        self.warm_up_s = asyncio.get_running_loop().time() - started
        log.info("vLLM engine warmed up (one request with logprobs) in %.2f s", self.warm_up_s)

    @property
    def engine_metrics(self) -> tuple[Any, str] | None:  # type: ignore[override]
        """vLLM's own metrics (`vllm:*`, its v1 engine's PrometheusStatLogger),
        which it registers in prometheus_client's default registry of this
        process while it logs stats (its default)."""
        from prometheus_client import REGISTRY

        return (REGISTRY, "vllm:")

    def _adopt(self, engine: Any) -> None:
        self.engine = engine
        self._dead = False
        self.died.clear()
        self._watch_engine(engine)
        cache = engine.vllm_config.cache_config
        self._block_size = int(cache.block_size)
        self._kv_tokens = int(cache.num_gpu_blocks or 0) * self._block_size
        self._max_seqs = int(engine.vllm_config.scheduler_config.max_num_seqs)
        self._step_tokens = int(engine.vllm_config.scheduler_config.max_num_batched_tokens)
        self.max_model_len = int(engine.model_config.max_model_len)
        log.info(
            "vLLM engine ready: %s, %d sequences, %d KV tokens, context %d",
            self.cfg.model, self._max_seqs, self._kv_tokens, self.max_model_len,
        )  # fmt: skip
        self._notify()

    def _watch_engine(self, engine: Any) -> None:
        """Learn of the engine's death when it happens, not at the next request:
        AsyncLLM's output handler task ends when its EngineCore is gone. It is
        started here (vLLM starts it lazily, at the first request)."""
        start_handler = getattr(engine, "_run_output_handler", None)
        if start_handler is not None:
            start_handler()
        handler = getattr(engine, "output_handler", None)
        if isinstance(handler, asyncio.Future):

            def ended(_task: Any) -> None:
                if not self._closed and engine is self.engine:
                    self._fence("the vLLM engine died")

            handler.add_done_callback(ended)

    async def wait_ready(self) -> None:
        """Until the engine is up (raises what stopped it from starting)."""
        if self._starting is not None:
            await asyncio.shield(self._starting)

    async def close(self) -> None:
        self._closed = True
        self._stop_watchdog()
        for request_id in list(self._runs):
            self.abort(request_id)
        await asyncio.gather(*self._aborts, return_exceptions=True)
        for task in (self._starting, self._restarting):
            if task is not None and not task.done():
                # A thread building an engine cannot be interrupted; that
                # engine is shut down as soon as it is built (_build_engine).
                task.cancel()
        engine, self.engine = self.engine, None
        if engine is not None:
            await asyncio.to_thread(engine.shutdown)

    # -- state -------------------------------------------------------------------

    def ready(self) -> bool:
        engine = self.engine
        if engine is None or self._closed:
            return False
        if not self._dead and engine.errored:
            self._fence("the vLLM engine died")
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
            self._max_seqs,
        )

    def gone(self) -> BackendUnavailable | None:
        """Set only when the engine failed its first start: a dead or wedged
        engine is being restarted, so queued requests wait for it."""
        if self._start_error is not None:
            return BackendUnavailable(
                f"the vLLM engine did not start: {self._start_error}", _DOWN_RETRY_AFTER_S
            )
        return None

    # -- fencing and restarts ----------------------------------------------------

    def _fence(self, why: str) -> None:
        """Take the engine out of service now: unready, its runs ended 503,
        and a restart under way."""
        if self._dead or self._closed:
            return
        self._dead = True
        self.back.clear()
        self.died.set()
        self._stop_watchdog()
        log.error("%s; the gateway is not ready, restarting the engine", why)
        engine = self.engine
        for request_id, run in list(self._runs.items()):
            run.fenced = why
            if engine is not None and not run.aborted:
                # The local half of an abort ends the run's output stream at
                # once, whether or not the EngineCore still listens.
                self._abort_in_engine(engine, request_id)
        self._notify()
        self._restarting = asyncio.get_running_loop().create_task(
            self._restart(engine), name="qosgate-vllm-restart"
        )

    async def _restart(self, old: Any) -> None:
        await asyncio.gather(*self._aborts, return_exceptions=True)
        if old is not None:
            try:
                await asyncio.to_thread(old.shutdown)
            except Exception:
                log.exception("shutting down the failed vLLM engine")
        self.engine = None
        delay = self.cfg.restart_backoff_s
        while not self._closed:
            await asyncio.sleep(delay)
            try:
                engine = await self._build_engine()
            except Exception as exc:
                log.error("the vLLM engine did not restart (next try in %.0f s): %s", delay, exc)
                delay = min(delay * 2, _MAX_BACKOFF_S)
                continue
            if engine is None:
                return
            self.restarts += 1
            self._rendered.clear()
            self._adopt(engine)
            self.back.set()
            return

    def _stall_due(self) -> float:
        """When the engine is stalled if nothing changes: no output at all for
        the bound, or a request it took that long ago and has not answered
        (an engine whose input thread died still serves what it held)."""
        since = self._progress_at
        for run in self._runs.values():
            # Runs are in the order they were handed over: the first one not
            # yet answered is the oldest.
            if not run.answered:
                since = min(since, run.submitted_at)
                break
        return since + self.cfg.stall_timeout_s

    def _arm_watchdog(self) -> None:
        if self._watchdog is None and not self._dead:
            loop = asyncio.get_running_loop()
            self._watchdog = loop.call_at(self._stall_due(), self._check_stall)

    def _stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def _check_stall(self) -> None:
        self._watchdog = None
        if not self._runs or self._dead or self._closed:
            return
        loop = asyncio.get_running_loop()
        due = self._stall_due()
        if loop.time() < due:
            self._watchdog = loop.call_at(due, self._check_stall)
            return
        self._fence(
            f"the vLLM engine left a request unanswered, or produced nothing, for "
            f"{self.cfg.stall_timeout_s:g} s ({len(self._runs)} requests in flight)"
        )

    # -- prompts ---------------------------------------------------------------

    def _render(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        """The engine input for a request, as vLLM's own server renders it."""
        engine = self.engine
        try:
            if endpoint == "chat":
                from vllm.renderers.params import ChatParams

                params = ChatParams(chat_template_kwargs={"add_generation_prompt": True})
                _, (engine_input,) = engine.renderer.render_chat([body["messages"]], params)
            else:
                from vllm.renderers.inputs.preprocess import parse_model_prompt

                prompt = body["prompt"]
                if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                    prompt = prompt[0]  # the one prompt of a one-item array
                (engine_input,) = engine.renderer.render_cmpl(
                    [parse_model_prompt(engine.model_config, prompt)]
                )
        except Exception as exc:
            raise _rejected(exc, "messages" if endpoint == "chat" else "prompt") from exc
        return engine_input

    def count_prompt_tokens(self, endpoint: str, body: dict[str, Any]) -> int:
        if self.engine is None or self._dead:
            # Before the engine is up: the estimate, as the sim backend counts.
            return estimate_prompt_tokens(endpoint, body)
        try:
            rendered: dict[str, Any] | BackendRejected = self._render(endpoint, body)
            count = len(rendered["prompt_token_ids"])
        except BackendRejected as exc:
            # Refused when it runs, through the one mapping of backend errors.
            rendered, count = exc, estimate_prompt_tokens(endpoint, body)
        kept = self._rendered
        kept[id(body)] = (body, rendered)
        if len(kept) > _RENDERED_KEPT:
            kept.popitem(last=False)
        return max(1, count)

    def _take_input(self, job: GenerationJob) -> dict[str, Any]:
        entry = self._rendered.pop(id(job.body), None)
        rendered = entry[1] if entry is not None and entry[0] is job.body else None
        if rendered is None:
            rendered = self._render(job.endpoint, job.body)
        if isinstance(rendered, BackendRejected):
            raise rendered
        return rendered

    # -- requests ----------------------------------------------------------------

    def generate(self, job: GenerationJob) -> AsyncIterator[Chunk]:
        if not self.ready():
            if self._dead:
                raise BackendUnavailable(
                    "the vLLM engine is restarting", retry_after_s=_DOWN_RETRY_AFTER_S
                )
            raise BackendUnavailable("the vLLM engine is not ready")
        engine_input = self._take_input(job)
        params = self._sampling_params(job)
        now = asyncio.get_running_loop().time()
        run = _Run(prompt_tokens=len(engine_input["prompt_token_ids"]), submitted_at=now)
        # Counted from here, before the first await, as the port requires.
        if not self._runs:
            # An idle engine owes no output: the stall clock starts now.
            self._progress_at = now
        self._runs[job.request_id] = run
        self._arm_watchdog()
        return self._stream(job, engine_input, params, run)

    def _sampling_params(self, job: GenerationJob) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        body = job.body
        fields = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if body.get("logit_bias"):
            fields["logit_bias"] = {int(k): float(v) for k, v in body["logit_bias"].items()}
        top = _top_logprobs(job)
        if top is not None:
            fields["logprobs"] = top
        elif job.endpoint == "chat" and body.get("top_logprobs"):
            # As vLLM's server answers, rather than leave the field unread.
            raise BackendRejected(
                f"{_REFUSED}: top_logprobs is only allowed when logprobs is true",
                param="top_logprobs",
            )
        response_format = body.get("response_format") or {}
        if response_format.get("type") == "json_object":
            fields["structured_outputs"] = StructuredOutputsParams(json_object=True)
        elif response_format.get("type") == "json_schema":
            schema = response_format["json_schema"].get("schema") or {}
            fields["structured_outputs"] = StructuredOutputsParams(json=schema)
        try:
            return SamplingParams(
                n=1,
                max_tokens=job.max_tokens,
                stop=stop or None,
                output_kind=RequestOutputKind.DELTA,
                **fields,
            )
        except Exception as exc:
            raise _rejected(exc, _named_field(exc, body)) from exc

    async def _stream(
        self, job: GenerationJob, engine_input: dict[str, Any], params: Any, run: _Run
    ) -> AsyncIterator[Chunk]:
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        engine = self.engine
        request_id = job.request_id
        prompt_tokens = run.prompt_tokens
        top = _top_logprobs(job)
        try:
            outputs = engine.generate(engine_input, params, request_id,
                                      priority=job.priority if self._takes_priority else 0)
            try:
                async for out in outputs:
                    self._progress_at = asyncio.get_running_loop().time()
                    run.answered = True
                    if run.fenced is not None:
                        break
                    if run.aborted:
                        return
                    completion = out.outputs[0] if out.outputs else None
                    if completion is None:
                        continue
                    delta = len(completion.token_ids)
                    run.generated += delta
                    raw = (
                        {"logprobs": _logprobs(job.endpoint, completion, top, run)}
                        if top is not None and completion.logprobs
                        else {}
                    )
                    if out.finished:
                        usage = {
                            "prompt_tokens": prompt_tokens,
                            "completion_tokens": run.generated,
                            "total_tokens": prompt_tokens + run.generated,
                        }
                        yield Chunk(
                            text=completion.text, tokens=delta,
                            finish_reason=completion.finish_reason or "stop", usage=usage,
                            raw=raw,
                        )  # fmt: skip
                        return
                    if completion.text or delta:
                        yield Chunk(text=completion.text, tokens=delta, raw=raw)
            finally:
                await outputs.aclose()
            if run.fenced is not None:
                raise BackendUnavailable(run.fenced, retry_after_s=_DOWN_RETRY_AFTER_S)
        except EngineDeadError as exc:
            self._fence("the vLLM engine died")
            raise BackendUnavailable(
                "the vLLM engine died", retry_after_s=_DOWN_RETRY_AFTER_S
            ) from exc
        except VLLMClientError as exc:
            # Without a parameter of its own, a refusal at this stage is of
            # the prompt (a token id past the vocabulary) or of a field its
            # message begins with.
            where = "prompt" if job.endpoint == "completions" else "messages"
            raise _rejected(exc, _named_field(exc, job.body) or where) from exc
        except (BackendError, GeneratorExit, asyncio.CancelledError):
            raise
        except Exception as exc:
            if engine.errored:
                self._fence("the vLLM engine died")
                raise BackendUnavailable(
                    "the vLLM engine died", retry_after_s=_DOWN_RETRY_AFTER_S
                ) from exc
            raise BackendError(f"the vLLM engine failed the request: {exc}") from exc
        finally:
            if self._runs.pop(request_id, None) is not None:
                if not self._runs:
                    self._stop_watchdog()
                self._notify()

    def abort(self, request_id: str) -> None:
        run = self._runs.get(request_id)
        engine = self.engine
        if run is None or run.aborted or engine is None:
            return
        run.aborted = True
        self._abort_in_engine(engine, request_id)

    def _abort_in_engine(self, engine: Any, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(engine.abort(request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)


def _top_logprobs(job: GenerationJob) -> int | None:
    """Alternatives per token the client asked for (0: the chosen token's
    only), or None when it asked for no logprobs."""
    body = job.body
    if job.endpoint == "chat":
        return (body.get("top_logprobs") or 0) if body.get("logprobs") else None
    return body.get("logprobs")


def _logprobs(endpoint: str, completion: Any, top: int, run: _Run) -> dict[str, Any]:
    """A delta's logprobs in OpenAI's shape for the endpoint."""
    chosen: list[tuple[str, float]] = []
    alternatives: list[list[tuple[str, float]]] = []
    for token_id, position in zip(completion.token_ids, completion.logprobs, strict=False):
        ranked = sorted(position.items(), key=lambda item: item[1].rank or 0)
        pick = position.get(token_id) or ranked[0][1]
        chosen.append((pick.decoded_token or "", pick.logprob))
        alternatives.append([(lp.decoded_token or "", lp.logprob) for _, lp in ranked[:top]])
    if endpoint == "chat":

        def entry(token: str, logprob: float) -> dict[str, Any]:
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        return {
            "content": [
                {**entry(*pick), "top_logprobs": [entry(*alt) for alt in alts]}
                for pick, alts in zip(chosen, alternatives, strict=True)
            ]
        }
    offsets = []
    for token, _ in chosen:
        offsets.append(run.text_offset)
        run.text_offset += len(token)
    return {
        "tokens": [token for token, _ in chosen],
        "token_logprobs": [logprob for _, logprob in chosen],
        "top_logprobs": [dict(alts) for alts in alternatives],
        "text_offset": offsets,
    }


# vLLM appends "(parameter=x, value=y)" to its validation messages; the
# parameter travels as `param` instead, and the value may be long.
_VLLM_DETAIL = re.compile(r"\s*\(parameter=[^)]*\)$")


_REFUSED = "The vLLM engine refused the request"


def _named_field(exc: BaseException, body: dict[str, Any]) -> str | None:
    """The request field a message of the engine's begins with ("min_tokens
    must be ..."), when the request has it."""
    first = str(exc).split(" ", 1)[0]
    return first if first in body else None


def _rejected(exc: BaseException, param: str | None) -> BackendRejected:
    """The engine's "this request is invalid", as the client's 400."""
    name = getattr(exc, "parameter", None) or param
    message = _VLLM_DETAIL.sub("", str(exc)) or type(exc).__name__
    return BackendRejected(
        f"{_REFUSED}: {message[:500]}",
        param=_PARAM_NAMES.get(name, name) if name else None,
    )

"""The load generator's worker process: one asyncio loop, one aiohttp session.

A worker is started once (multiprocessing, spawn) and runs jobs the parent
sends over a pipe: `open` (send each request at its time) or `closed` (some
users of a concurrency level, each sending its next request when the last one
ended). A job is armed first and started by a separate `go` carrying the start
instant on the machine's monotonic clock, so every worker starts together.

Every request sent ends in exactly one record, whatever happens to it (a
refusal, a timeout, a broken stream, an exception in this code): a failure is
a result, never a missing one.

This module imports nothing heavy (no pydantic): it is what each spawned
process loads.

Record fields (a tuple, see `RECORD_FIELDS`): times are seconds after the
job's start instant; `first` is the first content chunk (streaming) or the
whole response (not streaming); `itl` the gaps between content chunks;
`prompt_tokens` the prompt's length as asked (about 4 characters a token),
`prompt_counted` as the server counted it (its `usage`; None when it said
nothing), which differs wherever the model's tokenizer does.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import aiohttp

RECORD_FIELDS = (
    "rid", "cls", "sent", "first", "end", "status", "outcome", "error_type", "error_code",
    "prompt_tokens", "output_tokens", "itl", "lag", "prompt_counted",
)  # fmt: skip

COMPLETED = "completed"
ERROR = "error"

_WORDS = ["the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "they", "you", "were", "her", "she", "there", "one", "all", "we", "their", "has", "been", "would", "when", "who", "will", "more", "no", "if", "out", "so", "said", "what", "up", "its", "about", "into", "than", "them", "can", "only", "other", "new", "some", "time", "could", "these", "two", "may", "then", "do", "first", "any", "my", "now", "such", "like", "our", "over", "man", "me", "even", "most", "made", "after", "also", "did", "many", "before", "must", "through", "back", "years", "where", "much", "your", "way", "well", "down", "should", "because", "each", "just", "those", "people", "how", "too", "little", "state", "good", "very", "make", "world", "still", "own", "see", "men", "work", "long", "get", "here", "between", "both", "life", "being", "under", "never", "day", "same", "another", "know", "while", "last", "might", "us", "great", "old", "year", "off", "come", "since", "against", "go", "came", "right", "used", "take", "three", "model", "token", "server", "request", "queue", "latency", "budget", "tenant", "tier", "stream", "batch", "cache"]
_TEXT_CHARS = 1 << 18
_ERROR_BODY_BYTES = 64 * 1024


def error_outcome(status: int, code: str | None) -> str:
    """What an HTTP refusal means for the report: 429, and 503 for overload,
    are refusals (quota when the code says so), 504 an expiry in the queue.
    Anything else is an error, including a 503 that says the backend is
    unavailable: counting that as a deliberate refusal would hide failures."""
    if status == 429:
        if code and ("quota" in code or code == "rate_limit_exceeded"):
            return "rejected_quota"
        return "rejected_queue_full"
    if status == 503:
        return "rejected_overload" if code in (None, "overloaded") else ERROR
    if status == 504:
        return "expired"
    return ERROR


def _seconds(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def _error_code(body: bytes) -> str | None:
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict):
            code = error.get("code") or error.get("type")
            return str(code)[:100] if code is not None else None
    return None


class Job:
    """One job's settings, shared by its requests."""

    def __init__(self, cfg: dict[str, Any], session: aiohttp.ClientSession, text: str) -> None:
        self.session = session
        self.text = text
        self.chat = cfg["endpoint"] == "chat"
        path = "/chat/completions" if self.chat else "/completions"
        self.urls = [url.rstrip("/") + path for url in cfg["urls"]]
        self.model = cfg["model"]
        self.stream = bool(cfg["stream"])
        self.extra = dict(cfg.get("extra_body") or {})
        self.priority: list[int | None] = list(cfg["priority"])
        self.headers: list[dict[str, str]] = []
        for key in cfg["keys"]:
            headers = {"Content-Type": "application/json"}
            if self.stream:
                headers["Accept"] = "text/event-stream"
            if key:
                headers["Authorization"] = f"Bearer {key}"
            self.headers.append(headers)
        self.sessions = int(cfg.get("sessions") or 0)
        self.timeout = aiohttp.ClientTimeout(total=float(cfg["timeout_s"]))
        self.honor_retry_after = bool(cfg.get("honor_retry_after", False))
        self.retry_after: dict[int, float] = {}
        """Request number -> the Retry-After it was refused with (when honoured)."""
        self.finished = 0
        """Requests answered so far (or failed), for the progress reports."""
        self.completed = 0

    def prompt(self, rid: int, tokens: int) -> str:
        """About 4 characters per token of ordinary words, different for every
        request (a shared prefix would let a prefix cache skip the work)."""
        head = f"[{rid}] "
        want = max(4 * tokens - len(head), 0)
        text = self.text
        start = (rid * 40503) % len(text)
        out = text[start : start + want]
        while len(out) < want:
            out += " " + text[: want - len(out) - 1]
        return head + out

    def body(self, rid: int, cls: int, prompt_tokens: int, max_tokens: int) -> bytes:
        body: dict[str, Any] = dict(self.extra)
        body["model"] = self.model
        prompt = self.prompt(rid, prompt_tokens)
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        body["max_tokens"] = max_tokens
        body["stream"] = self.stream
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        priority = self.priority[cls]
        if priority is not None:
            body["priority"] = priority
        return json.dumps(body, separators=(",", ":")).encode()

    async def one(self, spec: tuple, start: float, lag: float) -> tuple:
        """Send one request and return its record; never raises (but CancelledError)."""
        rid, _, cls, prompt_tokens, max_tokens = spec
        loop = asyncio.get_running_loop()
        payload = self.body(rid, cls, prompt_tokens, max_tokens)
        # By request number, not by arrival: every worker and every rerun then
        # sends the same request to the same replica.
        url = self.urls[rid % len(self.urls)]
        headers = self.headers[cls]
        if self.sessions:
            headers = {**headers, "X-Session-Id": f"s{rid % self.sessions}"}
        sent = loop.time()
        first: float | None = None
        status = 0
        outcome = ERROR
        error_type: str | None = None
        error_code: str | None = None
        output = 0
        counted: int | None = None
        itl: list[float] | None = None
        try:
            async with self.session.post(
                url, data=payload, headers=headers, timeout=self.timeout
            ) as response:
                status = response.status
                if status != 200:
                    if self.honor_retry_after:
                        wait = _seconds(response.headers.get("Retry-After"))
                        if wait is not None:
                            self.retry_after[rid] = wait
                    raw = await response.content.read(_ERROR_BODY_BYTES)
                    error_code = _error_code(raw)
                    outcome = error_outcome(status, error_code)
                    error_type = f"http_{status}"
                elif self.stream and response.content_type == "text/event-stream":
                    itl = []
                    first, output, counted, error_type, error_code = await self._read_stream(
                        response, itl)
                    outcome = COMPLETED if error_type is None else ERROR
                else:
                    raw = await response.read()
                    first = loop.time()
                    output, counted, error_type = self._read_body(raw)
                    outcome = COMPLETED if error_type is None else ERROR
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            error_type = "timeout"
        except aiohttp.ClientPayloadError:
            error_type = "incomplete_stream"
        except aiohttp.ClientConnectionError:
            error_type = "connection"
        except aiohttp.ClientError as exc:
            error_type = f"client_error:{type(exc).__name__}"
        except Exception as exc:  # noqa: BLE001 - a bug here is still this request's result
            error_type = f"exception:{type(exc).__name__}"
        end = loop.time()
        if error_type is not None and outcome == COMPLETED:
            outcome = ERROR
        self.finished += 1
        self.completed += outcome == COMPLETED
        return (
            rid, cls, sent - start, None if first is None else first - start, end - start,
            status, outcome, error_type, error_code, prompt_tokens, output,
            tuple(itl) if itl else None, lag, counted,
        )  # fmt: skip

    async def _read_stream(
        self, response: aiohttp.ClientResponse, itl: list[float]
    ) -> tuple[float | None, int, int | None, str | None, str | None]:
        loop = asyncio.get_running_loop()
        chat = self.chat
        first: float | None = None
        last = 0.0
        chunks = 0
        reported: int | None = None
        counted: int | None = None
        done = False
        async for line in response.content:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            try:
                event = json.loads(data)
            except ValueError:
                output = reported if reported is not None else chunks
                return first, output, counted, "protocol", None
            if not isinstance(event, dict):
                return first, chunks, counted, "protocol", None
            error = event.get("error")
            if error:
                code = error.get("code") if isinstance(error, dict) else None
                return first, chunks, counted, "stream_error", (
                    None if code is None else str(code)[:100])
            usage = event.get("usage")
            if isinstance(usage, dict):
                reported = _count(usage.get("completion_tokens"), reported)
                counted = _count(usage.get("prompt_tokens"), counted)
            for choice in event.get("choices") or ():
                if chat:
                    delta = choice.get("delta") or {}
                    token = bool(delta.get("content") if isinstance(delta, dict) else None)
                else:
                    # A token that decodes to no text yet (a piece of a
                    # character) is still a step's output; an empty closing
                    # chunk after the tokens is not.
                    text = choice.get("text")
                    token = bool(text) or (text == "" and (
                        choice.get("finish_reason") is None or first is None))
                if token:
                    now = loop.time()
                    if first is None:
                        first = now
                    else:
                        itl.append(now - last)
                    last = now
                    chunks += 1
        output = reported if reported is not None else chunks
        if not done:
            return first, output, counted, "incomplete_stream", None
        # Read on to the body's end, as OpenAI's own client does: a response
        # released with its body unread closes its connection, and a server
        # whose body ends a moment after [DONE] would pay for a new connection
        # on the next request (and its CPU figures with it).
        try:
            while await response.content.readany():
                pass
        except aiohttp.ClientPayloadError:
            pass  # the answer came whole; only the connection is not reused
        return first, output, counted, None, None

    def _read_body(self, raw: bytes) -> tuple[int, int | None, str | None]:
        try:
            payload = json.loads(raw)
            usage = payload.get("usage") or {}
            counted = _count(usage.get("prompt_tokens"))
            reported = _count(usage.get("completion_tokens"))
            if reported is not None:
                return reported, counted, None
            choice = payload["choices"][0]
            text = choice["message"]["content"] if self.chat else choice["text"]
            return -(-len(text or "") // 4), counted, None
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            return 0, None, "protocol"


def _count(value: object, otherwise: int | None = None) -> int | None:
    """A token count from a server's `usage`: a whole number of at least 0
    (JSON's true is not one, though Python's bool is an int), else `otherwise`."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return otherwise


async def run_open(job: Job, specs: list[tuple], start: float) -> list[tuple]:
    """Send each request at start + its t, whatever became of the earlier ones."""
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[tuple]] = []
    for spec in specs:
        due = start + spec[1]
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        lag = max(0.0, loop.time() - due)
        tasks.append(loop.create_task(job.one(spec, start, lag)))
    return await _settle(tasks, specs, start)


async def run_closed(job: Job, users: list[int], spec: dict[str, Any], start: float) -> list[tuple]:
    """Some users of one concurrency level: request number u + k * concurrency
    is user u's k-th (so ids are unique across workers)."""
    loop = asyncio.get_running_loop()
    concurrency: int = spec["concurrency"]
    pool: list[tuple] = spec["pool"]
    limit: int | None = spec.get("requests")
    duration: float | None = spec.get("duration_s")
    deadline = None if duration is None else start + duration
    delay = start - loop.time()
    if delay > 0:
        await asyncio.sleep(delay)
    records: list[tuple] = []

    async def user(u: int) -> None:
        k = 0
        while True:
            n = u + k * concurrency
            if limit is not None and n >= limit:
                return
            if deadline is not None and loop.time() >= deadline:
                return
            _, t, cls, prompt, out = pool[n % len(pool)]
            records.append(await job.one((n, t, cls, prompt, out), start, 0.0))
            wait = job.retry_after.pop(n, None)
            if wait is not None:
                if deadline is not None:
                    wait = min(wait, max(0.0, deadline - loop.time()))
                await asyncio.sleep(wait)
            k += 1

    results = await asyncio.gather(*(user(u) for u in users), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            # Cannot happen (one() returns a record for everything); if it
            # does, the parent sees missing records as lost.
            raise result
    return records


async def _settle(tasks: list[asyncio.Task[tuple]], specs: list[tuple], start: float) -> list[tuple]:
    results = await asyncio.gather(*tasks, return_exceptions=True)
    records = []
    loop = asyncio.get_running_loop()
    for spec, result in zip(specs, results):
        if isinstance(result, BaseException):
            now = loop.time() - start
            result = (
                spec[0], spec[2], spec[1], None, now, 0, ERROR,
                f"exception:{type(result).__name__}", None, spec[3], 0, None, 0.0, None,
            )  # fmt: skip
        records.append(result)
    return records


def _text(seed: int) -> str:
    rng = random.Random(f"{seed}/text")
    words = rng.choices(_WORDS, k=_TEXT_CHARS // 4)
    return " ".join(words)[:_TEXT_CHARS]


async def _serve(conn: Connection) -> None:
    session = aiohttp.ClientSession(
        # No pool cap: a cap would queue requests inside the client, out of sight.
        connector=aiohttp.TCPConnector(limit=0),
        read_bufsize=1 << 20,
    )
    texts: dict[int, str] = {}
    conn.send(("ready", os.getpid()))
    try:
        while True:
            message = conn.recv()
            if message[0] == "stop":
                return
            kind, cfg, payload = message
            try:
                seed = int(cfg.get("seed", 0))
                if seed not in texts:
                    texts[seed] = _text(seed)
                job = Job(cfg, session, texts[seed])
            except Exception:  # noqa: BLE001 - reported to the parent
                conn.send(("failed", traceback.format_exc()))
                continue
            conn.send(("armed",))
            go = conn.recv()
            if go[0] != "go":
                conn.send(("failed", f"expected go, got {go[0]!r}"))
                continue
            start = float(go[1])
            cpu = time.process_time()
            reporter = asyncio.get_running_loop().create_task(_report_progress(conn, job))
            try:
                if kind == "open":
                    records = await run_open(job, payload, start)
                else:
                    records = await run_closed(job, payload["users"], payload, start)
            except Exception:  # noqa: BLE001 - reported to the parent
                conn.send(("failed", traceback.format_exc()))
                continue
            finally:
                reporter.cancel()
            conn.send(("done", records, {"cpu_s": time.process_time() - cpu}))
    finally:
        await session.close()


PROGRESS_INTERVAL_S = 0.5
"""How often a worker tells the parent how far its share of a job has come."""


async def _report_progress(conn: Connection, job: Job) -> None:
    while True:
        await asyncio.sleep(PROGRESS_INTERVAL_S)
        conn.send(("progress", job.finished, job.completed))


def worker_main(conn: Connection) -> None:
    """Entry point of a spawned worker process."""
    try:
        asyncio.run(_serve(conn))
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        pass  # the parent went away

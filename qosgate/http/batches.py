"""OpenAI's Files and Batches routes (docs/BATCH.md): identity as for the
completions routes, then the batch service (qosgate/batch/runner.py). A
tenant sees only its own files and batches; another's are 404 to it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from qosgate.batch.runner import BatchService
from qosgate.batch.store import BatchRecord, FileRecord
from qosgate.runtime.errors import BadRequest, BatchesNotConfigured, RequestTimeout

from .completions import read_json
from .errors import MalformedRequest
from .identity import Identity
from .protocol import describe_parse_error
from .state import STATE, identify

_T = TypeVar("_T")
_CHUNK = 1 << 16
MAX_BATCH_PAGE = 100
MAX_FILE_PAGE = 10_000
_MAX_METADATA = 16


def _service(request: web.Request) -> tuple[BatchService, Identity]:
    state = request.app[STATE]
    identity = identify(request, state)
    if state.batches is None:
        raise BatchesNotConfigured()
    return state.batches, identity


def _page_limit(request: web.Request, default: int, most: int) -> int:
    raw = request.query.get("limit")
    if raw is None:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise BadRequest(f"limit must be an integer from 1 to {most}", param="limit")
    return int(raw)


def _page(items: list[Any], limit: int, render: Callable[[Any], dict[str, Any]]) -> web.Response:
    """OpenAI's cursor page: `items` holds up to one more than `limit`."""
    shown = items[:limit]
    return web.json_response({
        "object": "list", "data": [render(item) for item in shown],
        "first_id": shown[0].id if shown else None, "last_id": shown[-1].id if shown else None,
        "has_more": len(items) > limit,
    })  # fmt: skip


# -- files ------------------------------------------------------------------------


async def post_file(request: web.Request) -> web.Response:
    service, identity = _service(request)
    if not request.content_type.startswith("multipart/"):
        raise BadRequest("Upload the file as multipart/form-data (fields purpose and file).")
    # An upload may take long, but may not stop: a gap of body_timeout_s
    # between two reads is a 408, so a client sending nothing cannot hold
    # the handler.
    stall_s = request.app[STATE].policy.server.body_timeout_s
    purpose: str | None = None
    received: tuple[Any, int] | None = None
    filename = "upload.jsonl"
    try:
        reader = await request.multipart()
        while (part := await _within(reader.next(), stall_s)) is not None:
            if not isinstance(part, BodyPartReader):
                raise BadRequest("Nested multipart bodies are not taken.")
            if part.name == "purpose":
                value = await _within(part.read(decode=True), stall_s)
                purpose = value[:100].decode("utf-8", "replace")
            elif part.name == "file" and received is None:
                filename = part.filename or filename
                received = await service.receive(_chunks(part, stall_s))
            else:
                await _within(part.release(), stall_s)
    except BaseException as exc:
        if received is not None:
            received[0].unlink(missing_ok=True)
        if isinstance(exc, (ValueError, AssertionError, HttpProcessingError)):
            raise MalformedRequest(
                f"Malformed multipart body: {describe_parse_error(exc)}."
            ) from None
        raise
    if received is None:
        raise BadRequest("The upload has no `file` field.", param="file")
    if purpose is None:
        received[0].unlink(missing_ok=True)
        raise BadRequest("The upload has no `purpose` field.", param="purpose")
    record = await service.add_file(identity.tenant, filename, purpose, *received)
    return web.json_response(record.api())


async def _within(step: Awaitable[_T], stall_s: float) -> _T:
    try:
        async with asyncio.timeout(stall_s):
            return await step
    except TimeoutError:
        raise RequestTimeout(f"The upload stalled: nothing arrived for {stall_s:g} s.") from None


async def _chunks(part: BodyPartReader, stall_s: float) -> AsyncIterator[bytes]:
    while chunk := await _within(part.read_chunk(_CHUNK), stall_s):
        yield chunk


async def list_files(request: web.Request) -> web.Response:
    service, identity = _service(request)
    limit = _page_limit(request, MAX_FILE_PAGE, MAX_FILE_PAGE)
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest("order must be asc or desc", param="order")
    records = await service.store.list_files(
        identity.tenant, after=request.query.get("after"), limit=limit + 1,
        purpose=request.query.get("purpose"), newest_first=order == "desc",
    )  # fmt: skip
    return _page(records, limit, FileRecord.api)


async def get_file(request: web.Request) -> web.Response:
    service, identity = _service(request)
    record = await service.file(identity.tenant, request.match_info["file_id"])
    return web.json_response(record.api())


async def get_file_content(request: web.Request) -> web.StreamResponse:
    service, identity = _service(request)
    record = await service.file(identity.tenant, request.match_info["file_id"])
    return web.FileResponse(
        service.file_path(record), headers={"Content-Type": "application/octet-stream"}
    )


async def delete_file(request: web.Request) -> web.Response:
    service, identity = _service(request)
    file_id = request.match_info["file_id"]
    await service.delete_file(identity.tenant, file_id)
    return web.json_response({"id": file_id, "object": "file", "deleted": True})


# -- batches ------------------------------------------------------------------------


async def post_batch(request: web.Request) -> web.Response:
    service, identity = _service(request)
    body = await read_json(request, request.app[STATE])
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    for name in ("input_file_id", "endpoint", "completion_window"):
        if not isinstance(body.get(name), str):
            raise BadRequest(f"{name} is required (a string)", param=name)
    unknown = set(body) - {"input_file_id", "endpoint", "completion_window", "metadata"}
    if unknown:
        raise BadRequest(f"Unknown field {sorted(unknown)[0][:64]!r}.", param=sorted(unknown)[0])
    metadata = _metadata(body.get("metadata"))
    record = await service.create(
        identity.tenant, identity.tier, body["input_file_id"], body["endpoint"],
        body["completion_window"], metadata,
    )  # fmt: skip
    return web.json_response(record.api())


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if (
        not isinstance(value, dict) or len(value) > _MAX_METADATA
        or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                   for k, v in value.items())
    ):  # fmt: skip
        raise BadRequest(
            "metadata must be at most 16 string pairs (keys up to 64 characters, values up "
            "to 512)", param="metadata",
        )  # fmt: skip
    return value


async def list_batches(request: web.Request) -> web.Response:
    service, identity = _service(request)
    limit = _page_limit(request, 20, MAX_BATCH_PAGE)
    records = await service.list(identity.tenant, request.query.get("after"), limit + 1)
    return _page(records, limit, BatchRecord.api)


async def get_batch(request: web.Request) -> web.Response:
    service, identity = _service(request)
    record = await service.batch(identity.tenant, request.match_info["batch_id"])
    return web.json_response(record.api())


async def cancel_batch(request: web.Request) -> web.Response:
    service, identity = _service(request)
    record = await service.cancel(identity.tenant, request.match_info["batch_id"])
    return web.json_response(record.api())


def add_routes(app: web.Application) -> None:
    router = app.router
    router.add_post("/v1/files", post_file)
    router.add_get("/v1/files", list_files)
    router.add_get("/v1/files/{file_id}", get_file)
    router.add_get("/v1/files/{file_id}/content", get_file_content)
    router.add_delete("/v1/files/{file_id}", delete_file)
    router.add_post("/v1/batches", post_batch)
    router.add_get("/v1/batches", list_batches)
    router.add_get("/v1/batches/{batch_id}", get_batch)
    router.add_post("/v1/batches/{batch_id}/cancel", cancel_batch)

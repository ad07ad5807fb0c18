"""Batch files: the input's lines checked as they stream by, and the output
and error lines in OpenAI's format. Nothing here holds a whole file."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from qosgate.runtime.errors import InvalidBatchFile

from .store import ENDPOINTS

MAX_CUSTOM_ID = 512
_UNRUN_MESSAGES = {
    "expired": "This request could not be executed before the completion window expired.",
    "cancelled": "This request was not executed because the batch was cancelled.",
}


def new_id(prefix: str) -> str:
    return prefix + os.urandom(12).hex()


def input_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number from 1, raw line) of each non-blank line."""
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if raw.strip():
                yield number, raw


def parse_item(number: int, raw: bytes) -> dict[str, Any]:
    """One input line as a request item, or InvalidBatchFile naming the line."""

    def bad(what: str) -> InvalidBatchFile:
        return InvalidBatchFile(f"line {number}: {what}", param="file")

    try:
        item = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad(f"not valid JSON ({exc.msg})") from None
    if not isinstance(item, dict):
        raise bad("each line must be a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise bad("custom_id is missing (a non-empty string)")
    if len(custom_id) > MAX_CUSTOM_ID:
        raise bad(f"custom_id is longer than {MAX_CUSTOM_ID} characters")
    if item.get("method") != "POST":
        raise bad('method must be "POST"')
    if item.get("url") not in ENDPOINTS:
        raise bad(f"url must be one of {', '.join(ENDPOINTS)}")
    if not isinstance(item.get("body"), dict):
        raise bad("body must be a JSON object (the request's body)")
    return item


def check_input(path: Path, max_lines: int, max_line_bytes: int) -> int:
    """Check a batch input file line by line; the number of requests it holds.
    Raises InvalidBatchFile naming the first bad line. A line may be no longer
    than a request body the completions routes take (`max_line_bytes`)."""
    seen: set[str] = set()
    count = 0
    for number, raw in input_lines(path):
        if len(raw) > max_line_bytes:
            raise InvalidBatchFile(
                f"line {number}: longer than {max_line_bytes} bytes (server.max_body_bytes)",
                param="file",
            )
        item = parse_item(number, raw)
        count += 1
        if count > max_lines:
            raise InvalidBatchFile(
                f"line {number}: the file holds more than {max_lines} requests "
                "(batch.max_lines)", param="file",
            )  # fmt: skip
        custom_id = item["custom_id"]
        if custom_id in seen:
            raise InvalidBatchFile(
                f"line {number}: custom_id {custom_id[:100]!r} is used by an earlier line; "
                "each must be unique", param="file",
            )  # fmt: skip
        seen.add(custom_id)
    if count == 0:
        raise InvalidBatchFile("the file holds no requests", param="file")
    return count


def check_endpoint(path: Path, endpoint: str) -> None:
    """Every line's url must be the batch's endpoint."""
    for number, raw in input_lines(path):
        url = orjson.loads(raw).get("url")
        if url != endpoint:
            raise InvalidBatchFile(
                f"line {number}: url {url!r} is not the batch's endpoint {endpoint!r}",
                param="input_file_id",
            )


def output_line(custom_id: str, request_id: str, status: int, body: dict[str, Any]) -> str:
    """A line that got an answer: 200 in the output file, an error status in
    the error file."""
    return orjson.dumps({
        "id": new_id("batch_req_"), "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": None,
    }).decode()  # fmt: skip


def unrun_line(custom_id: str, why: str) -> str:
    """A line that never got an answer: its batch `expired` or was `cancelled`."""
    return orjson.dumps({
        "id": new_id("batch_req_"), "custom_id": custom_id, "response": None,
        "error": {"code": f"batch_{why}", "message": _UNRUN_MESSAGES[why]},
    }).decode()  # fmt: skip

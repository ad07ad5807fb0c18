"""The OpenAPI document and the response models it is generated from, against
what the gateway sends.

The renderers build dicts (a model per streamed chunk would cost more than
the dict), so these tests hold them to the models: every kind of answer a
live gateway sends, streamed chunks included, validates strictly against its
model. And the document lists every error code the code base can emit: the
codes are read out of the source, not out of the document's own table.
"""

from __future__ import annotations

import ast
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema_rs  # schemathesis' validator
import pytest
from http_support import ALICE_KEY, ENV, MODEL, POLICY_YAML, ScriptedBackend, live_app, make_policy
from pydantic import BaseModel

import qosgate
from qosgate.backends.base import Chunk, GenerationJob
from qosgate.backends.support import PASSTHROUGH, SIM, VLLM
from qosgate.http import responses
from qosgate.http.openapi import STREAM_ONLY_CODES, build_openapi, error_codes
from qosgate.runtime.errors import GatewayError

ADMIN_TOKEN = "test-admin-token"
SOURCE = Path(qosgate.__file__).parent


def _emitted_codes() -> dict[str, int | None]:
    """Every error code written in the package, with its status where the
    source says it: the `code` of each error class (status from the class
    itself), the code handed to `error_payload` (OpenAI's error body built by
    hand), and a `code` assigned as a value."""
    found: dict[str, int | None] = {}
    for path in SOURCE.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for statement in node.body:
                    if (
                        isinstance(statement, ast.Assign)
                        and [getattr(t, "id", None) for t in statement.targets] == ["code"]
                        and isinstance(statement.value, ast.Constant)
                    ):
                        found[statement.value.value] = None
            elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "error_payload":
                code = node.args[2] if len(node.args) > 2 else None
                if isinstance(code, ast.Constant) and code.value is not None:
                    found[code.value] = None
            elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple):
                names = [getattr(t, "id", None) for t in node.targets[0].elts]
                if "code" in names and isinstance(node.value, ast.Tuple):
                    value = node.value.elts[names.index("code")]
                    if isinstance(value, ast.Constant):
                        found[value.value] = None
    for cls in _subclasses(GatewayError):
        found[cls.code] = cls.status
    return found


def _subclasses(cls: type[GatewayError]) -> list[type[GatewayError]]:
    return [cls, *(sub for child in cls.__subclasses__() for sub in _subclasses(child))]


def test_the_document_lists_every_error_code_the_gateway_can_emit() -> None:
    emitted = _emitted_codes()
    # The scan sees what it must: class codes, hand-built bodies, /readyz's pair.
    assert {"quota_lease_lost", "client_too_slow", "not_ready", "policy_rejected",
            "internal_error", "model_not_found"} <= set(emitted)  # fmt: skip
    schemas = build_openapi([MODEL], max_body_bytes=1024)["components"]["schemas"]
    listed = set(schemas["ErrorCode"]["enum"])
    assert set(emitted) == listed, (set(emitted) - listed, listed - set(emitted))
    for code, status in emitted.items():
        if status is not None:
            narrowed = schemas[f"Error{status}"]["allOf"][1]["properties"]["error"]
            assert code in narrowed["properties"]["code"]["enum"], (code, status)
    # A code that ends streams only is no status's.
    assert not set(STREAM_ONLY_CODES) & {c for codes in error_codes().values() for c in codes}


@pytest.mark.parametrize("cls", _subclasses(GatewayError), ids=lambda cls: cls.__name__)
def test_every_error_body_is_the_error_model(cls: type[GatewayError]) -> None:
    error = cls.__new__(cls)
    GatewayError.__init__(error, "what went wrong", param="messages.0.role")
    parsed = responses.Error.model_validate_json(json.dumps(error.body()), strict=True)
    assert parsed.error.code == cls.code and parsed.error.param == "messages.0.role"


@pytest.mark.parametrize(
    ("support", "logprobs"),
    [(PASSTHROUGH, True), (VLLM, True), (SIM, False)],
    ids=["openai", "vllm", "sim"],
)
def test_answer_schemas_allow_logprobs_only_where_the_backend_computes_them(
    support: Any, logprobs: bool
) -> None:
    document = build_openapi([MODEL], max_body_bytes=1024, support=support)
    schemas = document["components"]["schemas"]
    for choice in responses.CHOICES_WITH_LOGPROBS:
        allowed = schemas[choice.__name__]["properties"]["logprobs"]["type"]
        assert ("object" in allowed) is logprobs, choice
    # Building one backend's document leaves the next one's untouched.
    again = build_openapi([MODEL], max_body_bytes=1024)["components"]["schemas"]
    assert "object" in again["ChatChoice"]["properties"]["logprobs"]["type"]


def test_media_parts_are_in_the_document_only_where_the_backend_reads_them() -> None:
    def part_kinds(support: Any) -> set[str]:
        schemas = build_openapi([MODEL], max_body_bytes=1024, support=support)["components"]
        messages = schemas["schemas"]["ChatCompletionRequest"]["properties"]["messages"]
        user = messages["items"]["anyOf"][0]["properties"]["content"]["anyOf"][1]
        return {part["properties"]["type"]["const"] for part in user["items"]["anyOf"]}

    assert part_kinds(PASSTHROUGH) == {"text", "refusal", "image_url", "input_audio", "file"}
    assert part_kinds(SIM) == {"text", "refusal"}


async def _with_extras(job: GenerationJob) -> AsyncIterator[Chunk]:
    """Text, then a finishing chunk carrying what an upstream relays."""
    logprobs = {"content": [{"token": "w", "logprob": -0.1, "bytes": [119], "top_logprobs": []}]}
    yield Chunk(text="w0 ", tokens=1, raw={"logprobs": logprobs})
    yield Chunk(text="w1", tokens=1, finish_reason="stop", raw={"stop_reason": None})


_ADMIN_YAML = POLICY_YAML.replace(
    "  trusted_header_secret_env: QG_TEST_SECRET\n",
    "  trusted_header_secret_env: QG_TEST_SECRET\n  admin_token_env: QG_TEST_ADMIN_TOKEN\n",
).replace(
    "    tier: interactive\n",
    "    tier: interactive\n    quotas:\n      tokens_per_minute: 100000\n",
)


def _events(text: str) -> list[dict[str, Any]]:
    data = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert data[-1] == "[DONE]", data[-1]
    return [json.loads(item) for item in data[:-1]]


async def test_every_answer_validates_against_its_model_and_the_document(tmp_path: Path) -> None:
    """Whole and streamed completions of both endpoints (with and without
    include_usage, with relayed logprobs), errors, the model list, the
    probes and the admin documents: each strictly its model, and each JSON
    body its operation's schema in the served document."""
    assert _ADMIN_YAML.count("admin_token_env") == 1 and "quotas:" in _ADMIN_YAML
    policy_yaml = _ADMIN_YAML + f"batch:\n  data_dir: {tmp_path / 'batches'}\n"
    policy_path = tmp_path / "policy.yaml"
    policy_path.write_text(policy_yaml)
    checked: list[type[BaseModel]] = []
    async with (
        live_app(
            make_policy(policy_yaml),
            ScriptedBackend(_with_extras),
            policy_path=str(policy_path),
            environ={**ENV, "QG_TEST_ADMIN_TOKEN": ADMIN_TOKEN},
        ) as live,
        aiohttp.ClientSession() as http,
    ):
        async with http.get(live.url + "/openapi.json") as r:
            document = await r.json()
        defs = {"components": document["components"]}

        async def call(
            method: str, path: str, status: int, model: type[BaseModel], *,
            route: str | None = None, **kwargs: Any,
        ) -> Any:  # fmt: skip
            token = ADMIN_TOKEN if path.startswith("/admin") else ALICE_KEY
            headers = {"Authorization": f"Bearer {token}"}
            async with http.request(method, live.url + path, headers=headers, **kwargs) as r:
                assert r.status == status, await r.text()
                text = await r.text()
            path = route or path
            if r.content_type == "text/event-stream":
                assert model in (responses.ChatCompletionChunk, responses.CompletionChunk)
                for event in _events(text):
                    model.model_validate(event, strict=True)
            else:
                model.model_validate_json(text, strict=True)
                operation = document["paths"][path][method.lower()]
                schema = operation["responses"][str(status)]
                if "$ref" in schema:
                    schema = document["components"]["responses"][schema["$ref"].split("/")[-1]]
                described = {**schema["content"]["application/json"]["schema"], **defs}
                jsonschema_rs.Draft202012Validator(described).validate(json.loads(text))
            checked.append(model)
            return json.loads(text) if r.content_type == "application/json" else None

        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        text = {"model": MODEL, "prompt": "hi"}
        usage = {"stream_options": {"include_usage": True}}
        for endpoint, body, whole, chunk in (
            ("chat/completions", chat, responses.ChatCompletion, responses.ChatCompletionChunk),
            ("completions", text, responses.Completion, responses.CompletionChunk),
        ):
            path = f"/v1/{endpoint}"
            await call("POST", path, 200, whole, json=body)
            await call("POST", path, 200, chunk, json={**body, "stream": True})
            await call("POST", path, 200, chunk, json={**body, "stream": True, **usage})
            await call("POST", path, 400, responses.Error, json={**body, "max_tokens": 0})
            await call("POST", path, 404, responses.Error, json={**body, "model": "nope"})
        await call("GET", "/v1/models", 200, responses.ModelList)
        await call("GET", "/healthz", 200, responses.Status)
        await call("GET", "/readyz", 200, responses.Status)
        await call("GET", "/admin/stats", 200, responses.Stats)
        await call("GET", "/admin/quotas", 200, responses.Quotas)
        await call("POST", "/admin/reload", 200, responses.Reloaded)

        line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": text}
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", json.dumps(line).encode(), filename="in.jsonl")
        uploaded = await call("POST", "/v1/files", 200, responses.FileObject, data=form)
        file_route, batch_route = "/v1/files/{file_id}", "/v1/batches/{batch_id}"
        await call("GET", f"/v1/files/{uploaded['id']}", 200, responses.FileObject,
                   route=file_route)  # fmt: skip
        await call("GET", "/v1/files", 200, responses.FileList)
        batch = await call("POST", "/v1/batches", 200, responses.Batch, json={
            "input_file_id": uploaded["id"], "endpoint": "/v1/completions",
            "completion_window": "24h", "metadata": {"k": "v"},
        })  # fmt: skip
        await live.batches.wait(batch["id"])
        ended = await call("GET", f"/v1/batches/{batch['id']}", 200, responses.Batch,
                           route=batch_route)  # fmt: skip
        assert ended["status"] == "completed" and ended["output_file_id"]
        await call("GET", "/v1/batches", 200, responses.BatchList)
        await call("POST", f"/v1/batches/{batch['id']}/cancel", 409, responses.Error,
                   route=batch_route + "/cancel")  # fmt: skip
        await call("GET", "/v1/batches/batch_none", 404, responses.Error, route=batch_route)
        await call("DELETE", f"/v1/files/{uploaded['id']}", 200, responses.FileDeleted,
                   route=file_route)  # fmt: skip
    assert set(responses.ANSWERS) == set(checked)

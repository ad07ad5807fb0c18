"""A batch round trip with the official `openai` client: upload a JSONL file
of requests, run it as a batch, read the answers back (docs/BATCH.md).

    make demo                                 # in another terminal (its .venv has the openai client)
    .venv/bin/python examples/batch_client.py

QOSGATE_URL and QOSGATE_KEY override the demo's URL and key (the example
policy's batch-tier key).
"""

import io
import json
import os
import time

from openai import OpenAI

client = OpenAI(
    base_url=os.environ.get("QOSGATE_URL", "http://127.0.0.1:8080/v1"),
    api_key=os.environ.get("QOSGATE_KEY", "demo-batch-key"),
)
model = client.models.list().data[0].id

requests = [
    {"custom_id": f"question-{i}", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": model, "max_tokens": 32,
              "messages": [{"role": "user", "content": f"Tell me fact number {i}."}]}}
    for i in range(10)
]
jsonl = "".join(json.dumps(r) + "\n" for r in requests).encode()
uploaded = client.files.create(file=("questions.jsonl", io.BytesIO(jsonl)), purpose="batch")
batch = client.batches.create(
    input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
)
while batch.status in ("validating", "in_progress", "finalizing", "cancelling"):
    time.sleep(0.5)
    batch = client.batches.retrieve(batch.id)
print("batch:", batch.id, batch.status, batch.request_counts)

for line in client.files.content(batch.output_file_id).text.splitlines():
    result = json.loads(line)
    body = result["response"]["body"]
    print(result["custom_id"], "->", body["choices"][0]["message"]["content"][:40], body["usage"])

"""Call qosgate with the official `openai` client: one plain and one streamed chat.

    make demo                                 # in another terminal
    .venv/bin/python examples/openai_client.py

QOSGATE_URL and QOSGATE_KEY override the demo's URL and key (the example
policy's interactive-tier key).
"""

import os

from openai import OpenAI

client = OpenAI(
    base_url=os.environ.get("QOSGATE_URL", "http://127.0.0.1:8080/v1"),
    api_key=os.environ.get("QOSGATE_KEY", "demo-interactive-key"),
)
model = client.models.list().data[0].id

reply = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Hello!"}], max_tokens=32
)
print("reply:", reply.choices[0].message.content)
print("usage:", reply.usage)

print("stream:", end=" ", flush=True)
stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Count to ten."}],
    max_tokens=32,
    stream=True,
    # qosgate's own extension: run this request one level below the tier.
    extra_body={"priority": 1},
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
print()

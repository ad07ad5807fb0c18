#!/usr/bin/env sh
# qosgate over plain HTTP, against `make demo` (URL and key can be overridden).
set -eu
URL=${QOSGATE_URL:-http://127.0.0.1:8080/v1}
KEY=${QOSGATE_KEY:-demo-interactive-key}

# The models the backend serves.
curl -s "$URL/models" -H "Authorization: Bearer $KEY"; echo

# A chat completion as one JSON body.
curl -s "$URL/chat/completions" -H "Authorization: Bearer $KEY" \
  -H 'Content-Type: application/json' \
  -d '{"model": "sim-llama3-8b", "max_tokens": 16,
       "messages": [{"role": "user", "content": "Hello!"}]}'; echo

# The same, streamed as server-sent events (usage on the last chunk).
curl -sN "$URL/chat/completions" -H "Authorization: Bearer $KEY" \
  -H 'Content-Type: application/json' \
  -d '{"model": "sim-llama3-8b", "max_tokens": 16, "stream": true,
       "messages": [{"role": "user", "content": "Hello!"}]}'

# A wrong key: 401 in OpenAI's error shape.
curl -s "$URL/chat/completions" -H 'Authorization: Bearer wrong' \
  -H 'Content-Type: application/json' -d '{}'; echo

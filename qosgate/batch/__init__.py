"""OpenAI's Batch API: files of requests run at a low tier as the backend
has room, each line through the same runtime path as an HTTP request, kept
in a `BatchStore` so that a restart resumes them (docs/BATCH.md)."""

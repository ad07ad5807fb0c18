"""`qosgate bench`: a load generator for OpenAI-compatible endpoints (real clock).

scenario (the `kind: bench` YAML), plan (the requests, drawn up front), client
(the worker process: one asyncio loop and aiohttp session), pool (the worker
processes), report (the result JSON, tables and plots) and commands (the CLI).
"""

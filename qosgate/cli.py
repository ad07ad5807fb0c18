"""`qosgate serve | validate | schema | simulate | bench | calibrate | demo`."""

from __future__ import annotations

import argparse
import os
import pkgutil
import secrets
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from qosgate import __version__

if TYPE_CHECKING:
    from qosgate.config.models import PolicyConfig


def _port(text: str) -> int:
    # The socket layer would take 70000 as 70000 - 65536 and listen there.
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (0-65535)")
    return port


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qosgate", description="QoS gateway for LLM inference")
    parser.add_argument("--version", action="version", version=f"qosgate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    validate = sub.add_parser("validate", help="check a policy file and print its summary")
    validate.add_argument("file", help="policy YAML")

    sub.add_parser("schema", help="print the JSON Schema of policy files")

    simulate = sub.add_parser("simulate", help="replay a scenario on a simulated GPU (virtual clock)")
    simulate.add_argument("scenario", help="scenario YAML")
    simulate.add_argument("--load", type=float, action="append", default=None,
                          help="offered load as a multiple of the engine's capacity (repeatable)")
    simulate.add_argument("--policies", default=None,
                          help="comma-separated scheduler policies to compare (default: the scenario's)")
    simulate.add_argument("--json", dest="json_path", default=None, help="write results JSON here")
    simulate.add_argument("--plot", dest="plot_path", default=None, help="write a PNG plot here")
    simulate.add_argument("--seed", type=int, default=None, help="override the scenario's seed")
    simulate.add_argument("--quiet", action="store_true", help="no progress output")

    bench = sub.add_parser(
        "bench", help="load-test an OpenAI-compatible endpoint with a bench scenario (real clock)"
    )
    bench.add_argument("url", help="API base URL, e.g. http://127.0.0.1:8080/v1; a comma-separated "
                       "list spreads requests round-robin over several replicas")
    bench.add_argument("scenario", help="bench scenario YAML (kind: bench)")
    bench.add_argument("--json", dest="json_path", default=None, help="write results JSON here")
    bench.add_argument("--plot", dest="plot_path", default=None,
                       help="write a PNG here (sweep: throughput against latency)")
    bench.add_argument("--workers", type=int, default=None,
                       help="load-generator processes (default: min(4, CPUs))")
    bench.add_argument("--label", default="run",
                       help="name of this run under `policies` in the JSON (default: run)")
    bench.add_argument("--seed", type=int, default=None, help="override the scenario's seed")
    bench.add_argument("--record", dest="record_path", default=None,
                       help="write the requests as a JSONL trace `qosgate simulate` replays")
    bench.add_argument("--quiet", action="store_true", help="no progress output")

    calibrate = sub.add_parser(
        "calibrate", help="fit a simulator profile to an OpenAI-compatible engine (real clock)"
    )
    calibrate.add_argument("url", help="API base URL, e.g. http://127.0.0.1:8000/v1")
    calibrate.add_argument("--model", required=True, help="model name to request")
    calibrate.add_argument("--api-key", default=None, help="bearer key (default: none)")
    calibrate.add_argument("--out", required=True, help="write the profile YAML here")
    calibrate.add_argument("--plot", dest="plot_path", default=None,
                           help="write a PNG of measured against fitted here")
    calibrate.add_argument("--name", default=None,
                           help="the profile's name (default: calibrated-<model>)")
    calibrate.add_argument("--quick", action="store_true",
                           help="a short sweep (under a minute on a fast engine), for tests")
    calibrate.add_argument("--max-num-seqs", type=int, default=None,
                           help="the engine's max_num_seqs, for the profile (default: 256)")
    calibrate.add_argument("--max-num-batched-tokens", type=int, default=None,
                           help="the engine's tokens per step (default: 2048); prefill "
                           "prompts stay within it")
    calibrate.add_argument("--max-model-len", type=int, default=None,
                           help="the engine's context in tokens; no request of the sweep goes "
                           "beyond it (default: the server's /v1/models, else no limit)")
    calibrate.add_argument("--max-batch", type=int, default=None,
                           help="the largest batch of the sweep (default: --max-num-seqs, "
                           "so that no batch queues in the engine)")
    calibrate.add_argument("--kv-capacity-tokens", type=int, default=None,
                           help="KV-cache size in tokens (default: from vLLM's /metrics)")
    calibrate.add_argument("--metrics-url", default=None,
                           help="the server's Prometheus metrics (default: /metrics on URL's host)")
    calibrate.add_argument("--no-metrics", action="store_true", help="do not read /metrics")
    calibrate.add_argument("--no-ignore-eos", action="store_true",
                           help="do not send ignore_eos (for servers that refuse it; outputs "
                           "may then end early)")
    calibrate.add_argument("--quiet", action="store_true", help="no progress output")

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API with a policy")
    serve.add_argument("--config", required=True, help="policy YAML")
    serve.add_argument("--host", default=None,
                       help="listen address (default: the policy's server.host)")
    serve.add_argument("--port", type=_port, default=None,
                       help="TCP port (default: the policy's server.port)")
    serve.add_argument("--role", choices=("gateway", "engine"), default=None,
                       help="distributed mode: this process's fleet.role (overrides the policy's)")
    serve.add_argument("--node-id", default=None,
                       help="distributed mode: this process's fleet.node_id")

    demo = sub.add_parser("demo", help="serve the example policy on the simulated GPU")
    demo.add_argument("--config", default=None,
                      help="policy YAML (default: the example policy shipped with qosgate)")
    demo.add_argument("--host", default=None, help="listen address (default: the policy's)")
    demo.add_argument("--port", type=_port, default=None, help="TCP port (default: the policy's)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except BrokenPipeError:
        # `qosgate schema | head`: the reader left; that is not an error.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        return 130


def _run(args: argparse.Namespace) -> int:
    if getattr(args, "plot_path", None):
        from qosgate.sim.report import plotting_missing

        if missing := plotting_missing():
            print(f"qosgate {args.command}: --plot: {missing}", file=sys.stderr)
            return 2
    if args.command in ("serve", "demo"):
        return _serve_command(args, demo=args.command == "demo")
    # Imported when run: each command loads only what it needs.
    return pkgutil.resolve_name(_COMMANDS[args.command])(args)


_COMMANDS = {
    "validate": "qosgate.config.commands:validate_command",
    "schema": "qosgate.config.commands:schema_command",
    "simulate": "qosgate.sim.commands:simulate_command",
    "bench": "qosgate.bench.commands:bench_command",
    "calibrate": "qosgate.calibrate.commands:calibrate_command",
}


DEMO_KEY = "demo-interactive-key"
"""Plain demo key of policies/example.yaml (its comments list them); only the
digest is in the file."""


def _loop_factory():
    """uvloop's event loop where it is installed: it roughly halves the CPU
    the loop itself spends per request (benchmarks/RESULTS.md, B1)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _serve_command(args: argparse.Namespace, *, demo: bool) -> int:
    import asyncio

    from qosgate.backends import BackendNotImplemented
    from qosgate.backends.base import BackendError
    from qosgate.config.loader import ConfigError, load_policy
    from qosgate.config.secrets import SecretError
    from qosgate.http.identity import KeyRingError
    from qosgate.observability.otel import TracingUnavailable
    from qosgate.http.server import serve
    from qosgate.wiring import with_fleet_role

    if args.config is None:
        from qosgate.policies import example_policy

        args.config = example_policy()
    try:
        policy = load_policy(args.config)
    except ConfigError as exc:
        print(f"qosgate: invalid policy\n{exc}", file=sys.stderr)
        return 2
    try:
        role, node_id = getattr(args, "role", None), getattr(args, "node_id", None)
        policy = with_fleet_role(policy, role, node_id)
    except ValueError as exc:
        print(f"qosgate: {exc}", file=sys.stderr)
        return 2
    from qosgate.observability import configure_logging

    configure_logging(policy.observability.log_format)
    on_ready: Callable[[str], None] | None = None
    environ = dict(os.environ)
    if demo:
        # The dashboard reads /admin/stats, which needs the admin token: the
        # demo makes one up for this run unless one is set.
        name = policy.server.admin_token_env
        token = environ.get(name) if name else None
        if name and not token:
            token = environ[name] = secrets.token_urlsafe(16)

        def banner(url: str) -> None:
            print(demo_banner(url, _served_model(policy), token), flush=True)

        on_ready = banner

    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(serve(
                policy, args.host, args.port, on_ready=on_ready, policy_path=args.config,
                environ=environ, freeze_startup=True,
            ))
    except (BackendNotImplemented, KeyRingError, SecretError, TracingUnavailable) as exc:
        print(f"qosgate: {exc}", file=sys.stderr)
        return 2
    except BackendError as exc:
        # The backend could not start (an upstream key variable unset, ...).
        print(f"qosgate: the backend did not start: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        # Port in use, address not available: say so, not a traceback.
        print(f"qosgate: cannot listen: {exc}", file=sys.stderr)
        return 1
    return 0


def _served_model(policy: PolicyConfig) -> str:
    backend = policy.backend
    if backend.kind == "openai":
        return backend.models[0] if backend.models else "<model>"
    return backend.model


def demo_banner(url: str, model: str, admin_token: str | None = None) -> str:
    base = url.removesuffix("/v1")
    dashboard = (
        f"dashboard: {base}/dashboard#token={admin_token}\nmetrics:   {base}/metrics\n"
        if admin_token else f"metrics: {base}/metrics\n"
    )
    return f"""qosgate demo: the example policy on a simulated GPU, at {url}
(keys: {DEMO_KEY}, demo-standard-key, demo-batch-key; Ctrl-C stops)
{dashboard}
curl:
  curl -N {url}/chat/completions \\
    -H 'Authorization: Bearer {DEMO_KEY}' -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "max_tokens": 64, "stream": true,
         "messages": [{{"role": "user", "content": "Hello!"}}]}}'

Python (pip install openai):
  from openai import OpenAI
  client = OpenAI(base_url="{url}", api_key="{DEMO_KEY}")
  reply = client.chat.completions.create(
      model="{model}", messages=[{{"role": "user", "content": "Hello!"}}], max_tokens=64)
  print(reply.choices[0].message.content, reply.usage)
"""


if __name__ == "__main__":
    sys.exit(main())

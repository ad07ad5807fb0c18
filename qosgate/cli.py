"""`qosgate serve | validate | schema | simulate | bench | demo`."""

from __future__ import annotations

import argparse
import os
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qosgate", description="QoS gateway for LLM inference")
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

    demo = sub.add_parser("demo", help="serve the example policy on the simulated GPU")
    demo.add_argument("--config", default="policies/example.yaml")
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
    if args.command == "validate":
        from qosgate.config.commands import validate_command

        return validate_command(args.file)
    if args.command == "schema":
        from qosgate.config.commands import schema_command

        return schema_command()
    if args.command == "simulate":
        from qosgate.sim.commands import simulate_command

        return simulate_command(args)
    if args.command == "demo":
        from qosgate.config.commands import validate_command

        print("qosgate: the HTTP gateway is not built yet; this is the policy it will serve:\n")
        code = validate_command(args.config)
        print("\nTry the scheduler offline meanwhile:\n"
              "  .venv/bin/qosgate simulate benchmarks/b3_overload.yaml --load 2.0")
        return code
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())

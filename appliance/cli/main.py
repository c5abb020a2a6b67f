"""`llm-appliance`: parse the command line, run the command, turn each known failure into a clear message
and its exit code (see commands.py), never a traceback."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from appliance.cli.commands import EXIT_APPLY, EXIT_ENGINE, EXIT_INVALID, EXIT_USAGE
from appliance.cli.parser import parser
from appliance.health.exporter import ExporterUnavailable
from appliance.health.privileges import PrivilegeError
from appliance.health.router import RouterError
from appliance.measure.config import BenchError, BenchUsage
from appliance.ops import engine_build, models
from appliance.ops.engine_proof import EngineUnproven
from appliance.ops.layout import LayoutError
from appliance.plan.resolved import SnapshotError
from appliance.render.apply import ApplyError
from appliance.render.check import RenderRejected
from appliance.spec.problems import SpecInvalid, format_problems
from appliance.system.run import CommandFailed

# Each failure a command may meet, and its exit code; the message names what failed and how to fix it.
EXIT_CODES: tuple[tuple[tuple[type[Exception], ...], int], ...] = (
    ((SnapshotError, RenderRejected), EXIT_INVALID),
    ((BenchUsage, PrivilegeError), EXIT_USAGE),  # BenchUsage before BenchError, which it is
    ((ApplyError, ExporterUnavailable, CommandFailed, BenchError, LayoutError, RouterError), EXIT_APPLY),
    ((engine_build.EngineError, EngineUnproven, models.ModelFetchError), EXIT_ENGINE),
)
FAILURES = tuple(kind for kinds, _ in EXIT_CODES for kind in kinds)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except SpecInvalid as exc:
        print(format_problems(exc.problems), file=sys.stderr)
        count = len(exc.errors)
        print(f"{count} error{'s' if count != 1 else ''}; nothing was written", file=sys.stderr)
        return EXIT_INVALID
    except FAILURES as exc:
        print(f"{args.command}: {exc}", file=sys.stderr)
        return next(code for kinds, code in EXIT_CODES if isinstance(exc, kinds))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

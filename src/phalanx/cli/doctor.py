"""``phalanx doctor``: run a training script for a few instrumented steps, explain its step, predict scaling.

The script runs twice under :mod:`phalanx.doctor.session`: on ``N`` workers, and on one (the
reference that separates per-sample from per-step work, and says whether ``N`` workers beat one).
Each worker stops itself after the warm-up and the measured steps and leaves its records in a
temporary folder, which this process reads and analyses (:mod:`phalanx.doctor`).
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from phalanx.cli.config import LaunchConfig
from phalanx.cli.launcher import Supervisor
from phalanx.doctor import plot, report, trace
from phalanx.doctor.diagnosis import Diagnosis, diagnose_records
from phalanx.errors import ConfigurationError, PhalanxError, WorkerFailedError

logger = logging.getLogger(__name__)

DEFAULT_STEPS = 20
DEFAULT_WARMUP = 5
DEFAULT_TIMEOUT_S = 300.0


def collect(script: str, args: Sequence[str], workers: int, steps: int, warmup: int,
            timeout_s: float = DEFAULT_TIMEOUT_S) -> list[dict[str, Any]]:
    """Every rank's records of ``script`` run on ``workers`` local workers for ``warmup + steps`` steps."""
    logger.info("doctor: %s on %d worker(s), %d warm-up and %d measured steps", script, workers, warmup, steps)
    with tempfile.TemporaryDirectory(prefix="phalanx-doctor-") as folder:
        config = LaunchConfig(target="phalanx.doctor.session", is_module=True, nproc_per_node=workers,
                              args=("--out", folder, "--steps", str(steps), "--warmup", str(warmup),
                                    "--deadline", f"{timeout_s:g}", script, *args),
                              timeout_s=timeout_s)
        output = io.StringIO()
        result = Supervisor(config, output, output).run()
        records = [json.loads(path.read_text()) for path in sorted(Path(folder).glob("rank-*.json"))]
        if any(record.get("started_ray") for record in records):
            raise ConfigurationError(
                "the script trains through Ray: its steps run in Ray's worker processes, which the doctor does not "
                "instrument. Run the doctor on the training itself (the function your TorchTrainer runs, called "
                "from a plain script: px.fit works the same under phalanx run), see docs/ray.md.")
        if result.exit_code != 0:
            raise WorkerFailedError(f"the script failed under the doctor on {workers} worker(s):\n"
                                    f"{result.describe() or output.getvalue()[-4000:]}")
    incomplete = [r["rank"] for r in records if not r["complete"]]
    if len(records) != workers or incomplete:
        raise ConfigurationError(
            f"the script ended before {warmup} warm-up and {steps} measured steps on {workers} worker(s): give it "
            "more data or epochs, or pass a smaller --steps.")
    return records


def diagnose(script: str, args: Sequence[str] = (), workers: int = 2, steps: int = DEFAULT_STEPS,
             warmup: int = DEFAULT_WARMUP, bandwidths_gbit: Sequence[float] = (),
             timeout_s: float = DEFAULT_TIMEOUT_S) -> Diagnosis:
    """``px.diagnose``: run ``script`` on ``workers`` workers and on one, and diagnose its steps."""
    if workers < 1 or steps < 2 or warmup < 1:
        raise ConfigurationError("the doctor needs at least 1 worker, 2 measured steps and 1 warm-up step.")
    run = collect(script, args, workers, steps, warmup, timeout_s)
    reference = collect(script, args, 1, steps, warmup, timeout_s) if workers > 1 else None
    return diagnose_records(run, reference, list(bandwidths_gbit))


DESCRIPTION = """\
Run a training script (px.fit or px.DataParallel) for a few instrumented steps on N local workers
and on one, then report where each step's time goes (data, forward, backward, exposed
communication, optimizer), the transport's measured figures, oversubscription, the gradient noise
scale, predicted step times from 1 to 1024 workers, and recommendations ranked by predicted gain.
See docs/doctor.md."""

EPILOG = """\
examples (in a checkout of phalanx):
  phalanx doctor -n 2 examples/digits.py
  phalanx doctor -n 4 --bandwidth 1,10 --trace trace.json examples/digits.py --epochs 3"""


def build_parser() -> argparse.ArgumentParser:
    """The ``phalanx doctor`` parser: its options, then the script and the script's arguments untouched."""
    parser = argparse.ArgumentParser(prog="phalanx doctor", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("-n", "--nproc-per-node", type=int, default=2, metavar="N", help="workers (default 2)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, metavar="K",
                        help=f"measured steps after the warm-up (default {DEFAULT_STEPS}; half are timed, half give "
                             "gradient norms)")
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, metavar="W",
                        help=f"steps run before measuring (default {DEFAULT_WARMUP})")
    parser.add_argument("--bandwidth", action="append", default=[], metavar="GBIT",
                        help="also predict across hosts linked at GBIT Gbit/s (repeat, or 1,10,100)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    parser.add_argument("--trace", metavar="FILE", help="write a Chrome trace (Perfetto) of the measured steps")
    parser.add_argument("--plot", metavar="FILE", default="phalanx-doctor.png",
                        help="the predicted scaling curve (PNG; default phalanx-doctor.png)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                        help=f"bound on each run and collective (default {DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("target", metavar="script.py", help="the training script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments, unchanged")
    return parser


def run(namespace: argparse.Namespace) -> int:
    """Diagnose, then print the report (or the JSON object) and write the plot and the trace."""
    bandwidths = parse_bandwidths(namespace.bandwidth)
    if namespace.plot and not plot.available():  # say so before minutes of measuring, then go on
        print("phalanx doctor: matplotlib is not installed, so no plot is drawn "
              "(pip install 'phalanx[doctor]', or --plot '' to silence this)", file=sys.stderr)
        namespace.plot = None
    diagnosis = diagnose(namespace.target, namespace.args, namespace.nproc_per_node, namespace.steps, namespace.warmup,
                         bandwidths, namespace.timeout)
    if namespace.trace:
        trace.write(diagnosis.records, namespace.trace)
    if diagnosis.predictions and namespace.plot:
        plot.write(diagnosis.predictions, namespace.plot, f"phalanx doctor: {Path(namespace.target).name}")
    if namespace.json:
        print(json.dumps(diagnosis.as_dict()))
    else:
        sys.stdout.write(report.render(diagnosis, namespace.target))
        written = [f for f in (namespace.trace, namespace.plot if diagnosis.predictions else None) if f]
        if written:
            print("written: " + ", ".join(written))
    return 0


def parse_bandwidths(values: Sequence[str]) -> list[float]:
    """``["1", "10,100"]`` -> ``[1.0, 10.0, 100.0]``; a clear error for anything else."""
    try:
        found = [float(part) for value in values for part in value.split(",") if part]
    except ValueError:
        raise ConfigurationError(
            f"--bandwidth takes Gbit/s as numbers, got {values}; for example --bandwidth 1,10.") from None
    if any(b <= 0 for b in found):
        raise ConfigurationError(f"--bandwidth must be positive Gbit/s, got {found}.")
    return found


def main(argv: list[str]) -> int:
    """``phalanx doctor``: parse (the script's arguments stay untouched), run; errors print what to do."""
    namespace = build_parser().parse_args(argv)
    try:
        return run(namespace)
    except PhalanxError as error:
        print(f"phalanx doctor: error: {error}", file=sys.stderr)
        return 2 if isinstance(error, ConfigurationError) else 1

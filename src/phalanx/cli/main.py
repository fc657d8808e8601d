"""The ``phalanx`` command line. ``main(argv)`` parses, runs, and returns the exit code.

Everything after the script (or the ``-m`` module) belongs to the script, untouched: the
launcher's own options must come before it, as with ``python`` itself and torchrun. A command
that looks written for another launcher (phalanx's options after the script, ``python`` as the
script) gets a one-line hint with the command meant.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from dataclasses import dataclass
from typing import IO, Mapping, Sequence

from phalanx.cli import tune
from phalanx.cli.config import (
    DEFAULT_GRACE_S,
    DEFAULT_MASTER_ADDR,
    LaunchConfig,
    parse_hosts,
    read_hostfile,
    this_host_index,
)
from phalanx.cli.elastic import ElasticSupervisor
from phalanx.cli.launcher import Supervisor
from phalanx.comm.environment import DEVICES
from phalanx.errors import ConfigurationError
from phalanx.host import ensure_open_files, oversubscription, usable_cores

PROG = "phalanx"
INTERPRETER = re.compile(r"python[\d.]*")  # `phalanx run python train.py`, mpirun's habit

MAIN_EPILOG = """\
examples (in a checkout of phalanx; every command's --help has more):
  phalanx run -n 2 examples/digits.py                        # train on 2 local workers
  phalanx tune -j 2 --space examples/batch_size_space.json --trials 8 \\
      examples/digits.py --epochs 3                          # a hyperparameter search
  phalanx doctor -n 2 examples/digits.py                     # where the step time goes
  phalanx bench comm -n 2                                    # this host's links and allreduce"""

DOCTOR_HELP = "say where a script's step time goes, and what more workers buy"
BENCH_HELP = "measure latency, bandwidth and allreduce between local workers"
BENCH_COMM_DESCRIPTION = """\
Measure latency and bandwidth between workers of this host and time every allreduce algorithm
against its alpha-beta prediction (see docs/transport.md)."""
BENCH_COMM_EPILOG = """\
examples:
  phalanx bench comm -n 2
  phalanx bench comm -n 4 --reps 15 --transport gloo"""

RUN_DESCRIPTION = """\
Start N worker processes on this host running a script or module, each told its rank through
PHALANX_RANK/PHALANX_WORLD_SIZE (and torch's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT). The
launcher hosts the rendezvous store, prefixes every output line with the worker's rank, and
stops all workers as soon as one fails.

Across hosts, run one launcher per host with the same --nnodes, --master-addr (node 0's address)
and --master-port, and its own --node-rank; node 0's launcher hosts the store and global ranks
are node_rank * N + local rank. With --min-workers (or --nnodes MIN:MAX) the job is elastic: a
lost worker does not stop the others, which re-form the group and go on from their last commit
(see docs/elastic.md); workers started later join at a step boundary."""

RUN_EPILOG = """\
arguments:
  Everything after the script (or -m module) goes to the script, as with python and torchrun;
  phalanx's options go before it. phalanx's options after the script, or `python` as the script,
  print a one-line hint with the command meant (-- before the script silences it). More workers
  than cores print a warning: each then runs slower, and every collective waits for the slowest.

failures:
  A worker's traceback is held back until it exits (for 3 s while it runs on: an error it
  handled). The first worker to fail, which printed its traceback first, shows it in full
  (with its [rank] prefix); the launcher then names that worker and its error, and gives one line
  per reason the others stopped ("[0,2-5] stopped by the launcher: signal SIGTERM ...").

exit status:
  0        every worker exited with 0 (elastic: the job completed, lost workers are listed)
  N        the first worker to fail exited with N (128+S if killed by signal S)
  1        elastic: fewer than --min-workers workers remained
  2        invalid arguments
  130/143  the launcher was stopped by SIGINT (Ctrl-C) / SIGTERM

examples:
  phalanx run -n 2 examples/digits.py                        # in a checkout of phalanx
  phalanx run -n 4 train.py --epochs 3
  phalanx run -np 2 train.py                                 # horovodrun's spelling of -n
  phalanx run -np 8 -H node1:4,node2:4 train.py              # on each host: derives nnodes, node rank, -n
  phalanx run -n 2 -m mypackage.train --lr 0.1
  phalanx run -n 4 --min-workers 2 train.py                  # elastic, one host
  phalanx run -n 3 --servers 2 train.py                      # 3 workers, 2 parameter servers
  phalanx run -n 2 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 train.py
  phalanx run -n 2 --nnodes 1:4 --node-rank 3 --master-addr 10.0.0.1 --master-port 29500 train.py"""


def entry() -> None:
    """The ``phalanx`` command (and ``python -m phalanx``): :func:`main`, then the exit handlers, and
    an exit that skips the interpreter's teardown, which with torch imported took a second here:
    every job ended a second after its last worker."""
    from phalanx.cli.worker_main import end

    end(main())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``phalanx`` command line on ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["run"]:
            return _run(argv[1:])
        if argv[:1] == ["tune"]:
            return _tune(argv[1:])
        if argv[:2] == ["bench", "comm"]:
            return _bench_comm(argv[2:])
        if argv[:1] == ["doctor"]:
            from phalanx.cli import doctor  # its analysis loads only when asked for
            return doctor.main(argv[1:])
        return _other_command(argv)
    except SystemExit as exit_:  # argparse's --help and usage errors
        return exit_.code if isinstance(exit_.code, int) else 2
    except KeyboardInterrupt:  # Ctrl-C before the launcher took over the signal
        return 130


def _run(argv: list[str]) -> int:
    """``phalanx run``: parse, validate, launch. Configuration errors print one line and exit 2."""
    parser, flags = build_parser()
    launcher_args, target_args = split_run_argv(argv, flags.values)
    namespace = parser.parse_args(["run", *launcher_args, *(["--", target_args[0]] if target_args else [])])
    explicit = argv[len(launcher_args):len(launcher_args) + 1] == ["--"]
    hint = None if explicit else run_hint(launcher_args, target_args, flags)
    try:
        config = config_from_args(namespace, target_args[1:])
        config.validate()
        ensure_open_files(config.local_processes)
    except ConfigurationError as error:
        _print(f"{PROG} run: error: {error}", hint)
        return 2
    _print(hint, oversubscription_warning(config, "run"))
    return _launch(config, "run")


def _tune(argv: list[str]) -> int:
    """``phalanx tune``: parse (the script's arguments stay untouched), run; errors print one line, exit 2."""
    parser, value_options = tune_parser()
    own, target = split_run_argv(argv, value_options)
    namespace = parser.parse_args([*own, *(["--", target[0]] if target else [])])
    try:
        return tune.run(namespace, target[1:])
    except ConfigurationError as error:
        print(f"{PROG} tune: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG} tune: stopped; run the same command again to continue the study", file=sys.stderr)
        return 130


def _bench_comm(argv: list[str]) -> int:
    """``phalanx bench comm [-n N] [--reps R] [--transport T]``: measure the link and every algorithm."""
    namespace = build_parser()[0].parse_args(["bench", "comm", *argv])
    config = LaunchConfig(target="phalanx.cli.bench_comm", is_module=True, nproc_per_node=namespace.nproc_per_node,
                          args=("--reps", str(namespace.reps), "--transport", namespace.transport), prefix_output=False)
    try:
        config.validate()
    except ConfigurationError as error:
        _print(f"{PROG} bench comm: error: {error}")
        return 2
    _print(oversubscription_warning(config, "bench comm"))
    return _launch(config, "bench comm")


def _launch(config: LaunchConfig, command: str) -> int:
    """:func:`launch`, with a store that cannot be hosted or workers that cannot start said in one line."""
    try:
        return launch(config)
    except ConfigurationError as error:
        _print(f"{PROG} {command}: error: {error}")
        return 2
    except OSError as error:  # e.g. the process table is full
        _print(f"{PROG} {command}: error: could not start the workers: {error}")
        return 1


def _print(*lines: str | None) -> None:
    """Print each line that is not None to stderr."""
    for line in lines:
        if line is not None:
            print(line, file=sys.stderr, flush=True)


def _other_command(argv: list[str]) -> int:
    """Anything but ``run``: help, ``--version``, or a usage error."""
    parser, _ = build_parser()
    namespace = parser.parse_args(argv)
    if namespace.command is None:
        parser.print_help(sys.stderr)
        return 2
    return 0


def oversubscription_warning(config: LaunchConfig, command: str) -> str | None:
    """A warning when this host's workers outnumber its cores: what it costs and the -n that avoids it."""
    cores = usable_cores()
    cost = oversubscription(config.local_processes, cores)
    if cost is None:
        return None
    fewer = cores - config.servers_per_node
    return (f"{PROG} {command}: warning: {cost}, and every collective waits for the slowest worker"
            + (f"; -n {fewer} gives each worker a core." if fewer > 0 else "."))


def run_hint(launcher_args: Sequence[str], target_args: Sequence[str], flags: RunFlags) -> str | None:
    """A one-line hint with the command meant, when ``python`` is the script (mpirun's habit) or the
    script's arguments hold phalanx's own options that phalanx was not given (they go to the script)."""
    if not target_args:
        return None
    interpreter = INTERPRETER.fullmatch(os.path.basename(target_args[0])) is not None
    words = _without_interpreter(target_args[1:]) if interpreter else list(target_args)
    head = 2 if words[:1] == ["-m"] else 1
    moved, kept = _misplaced_options(words[head:], _given(launcher_args, flags), flags)
    if not (interpreter or moved):
        return None
    reasons = [f"phalanx runs the script with its own Python, so leave out {target_args[0]!r}"] if interpreter else []
    if moved:
        reasons.append(f"{shlex.join(moved)} after the script goes to the script, not to phalanx")
    command = shlex.join([PROG, "run", *launcher_args, *moved, *words[:head], *kept])
    return (f"{PROG} run: hint: {'; '.join(reasons)}. You may mean: {command}"
            + (" (-- before the script silences this)" if moved else ""))


def _without_interpreter(args: Sequence[str]) -> list[str]:
    """``python``'s arguments without its own options (``-u``, ``-O``...): the script or ``-m module`` on."""
    index = 0
    while index < len(args) and args[index].startswith("-") and args[index] != "-m":
        index += 1
    return list(args[index:])


def _misplaced_options(args: Sequence[str], given: set[str], flags: RunFlags) -> tuple[list[str], list[str]]:
    """Split the script's arguments into phalanx's options that phalanx was not given (with their
    values), and the rest. Nothing after ``--`` is looked at."""
    moved: list[str] = []
    kept: list[str] = []
    index = 0
    while index < len(args) and args[index] != "--":
        flag = args[index].split("=", 1)[0]
        width = 2 if args[index] in flags.values else 1
        misplaced = flag in flags.dest and flags.dest[flag] not in given
        (moved if misplaced else kept).extend(args[index:index + width])
        index += width
    return moved, kept + list(args[index:])


def _given(args: Sequence[str], flags: RunFlags) -> set[str]:
    """What the ``phalanx run`` options among ``args`` set (``-n`` and ``--nproc-per-node`` alike)."""
    return {flags.dest[word.split("=", 1)[0]] for word in args if word.split("=", 1)[0] in flags.dest}


def split_run_argv(argv: Sequence[str], value_options: frozenset[str]) -> tuple[list[str], list[str]]:
    """Split ``run``'s arguments into the launcher's options and ``[target, *target_args]``.

    The target is the first word that is neither an option nor an option's value (or the word
    after ``--``). Nothing after it is parsed here, so the script's own ``--flags`` and ``--``
    reach it exactly as written.
    """
    index = 0
    while index < len(argv):
        token = argv[index]
        if token == "--":
            return list(argv[:index]), list(argv[index + 1:])
        if token == "-" or not token.startswith("-"):
            return list(argv[:index]), list(argv[index:])
        index += 2 if token in value_options else 1
    return list(argv), []


def config_from_args(namespace: argparse.Namespace, target_args: Sequence[str]) -> LaunchConfig:
    """The :class:`LaunchConfig` a parsed ``phalanx run`` command line asks for."""
    nnodes, max_nnodes = parse_nnodes(namespace.nnodes)
    nproc, node_rank = namespace.nproc_per_node, namespace.node_rank
    if namespace.np is not None:
        nproc = _per_host([("", namespace.np)] * nnodes, namespace.np)
    master_addr, master_port, hostname = namespace.master_addr, namespace.master_port, None
    if namespace.hosts or namespace.hostfile:
        hosts = parse_hosts(namespace.hosts) if namespace.hosts else read_hostfile(namespace.hostfile)
        nnodes, nproc = len(hosts), _per_host(hosts, namespace.np)
        node_rank = node_rank if node_rank is not None else this_host_index(hosts)
        hostname = hosts[node_rank][0] if 0 <= node_rank < len(hosts) else None
        if len(hosts) > 1:
            master_addr = hosts[0][0] if master_addr == DEFAULT_MASTER_ADDR else master_addr
            master_port = master_port or HOROVOD_DEFAULT_PORT
    return LaunchConfig(
        target=namespace.target or "",
        args=tuple(target_args),
        is_module=namespace.module,
        nproc_per_node=nproc,
        nnodes=nnodes,
        node_rank=node_rank or 0,
        master_addr=master_addr,
        master_port=master_port,
        timeout_s=namespace.timeout,
        grace_s=namespace.grace,
        prefix_output=not namespace.no_prefix,
        fork_server=not namespace.no_fork_server,
        max_nnodes=max_nnodes,
        min_workers=namespace.min_workers,
        heartbeat_timeout_s=namespace.heartbeat_timeout,
        servers_per_node=namespace.servers,
        hostname=hostname,
        device=namespace.device,
    )


HOROVOD_DEFAULT_PORT = 29500  # -H over several hosts without --master-port: node 0's store listens here


def _per_host(hosts: list[tuple[str, int]], total: int | None) -> int:
    """Workers per host for -H/--hostfile: ``-np`` shared equally (at most the slots), else the slots.

    Phalanx numbers ranks ``node_rank * N + local_rank``, so every host runs the same number.
    """
    slots = {count for _, count in hosts}
    if total is None:
        if len(slots) > 1:
            raise ConfigurationError(f"the hosts have different slot counts {sorted(slots)}: phalanx runs the same "
                                     "number of workers on every host; pass -np N to run N / hosts on each.")
        return slots.pop()
    if total % len(hosts) or total // len(hosts) > min(slots):
        raise ConfigurationError(f"-np {total} cannot be shared equally among {len(hosts)} host(s) with at most "
                                 f"{min(slots)} slot(s) each: phalanx runs the same number of workers on every host.")
    return total // len(hosts)


def parse_nnodes(text: str) -> tuple[int, int | None]:
    """``"2"`` gives ``(2, None)`` (a fixed number of hosts); ``"1:4"`` gives ``(1, 4)`` (elastic)."""
    low, colon, high = text.partition(":")
    try:
        return (int(low), int(high)) if colon else (int(low), None)
    except ValueError:
        raise ConfigurationError(
            f"--nnodes takes a number of hosts or a range MIN:MAX, got {text!r}; for example --nnodes 2 or --nnodes 1:4."
        ) from None


@dataclass(frozen=True)
class RunFlags:
    """``phalanx run``'s own options: each flag's destination (aliases share one), those taking a value."""

    dest: Mapping[str, str]
    values: frozenset[str]


def build_parser() -> tuple[argparse.ArgumentParser, RunFlags]:
    """The ``phalanx`` parser, listing every command, and ``run``'s options (for :func:`split_run_argv`)."""
    from phalanx import __version__

    parser = argparse.ArgumentParser(prog=PROG, description="Distributed data-parallel training for PyTorch.",
                                     epilog=MAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = commands.add_parser("run", help="start N local workers and supervise them", description=RUN_DESCRIPTION,
                              epilog=RUN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
                              allow_abbrev=False)
    flags = _add_run_arguments(run)
    tune.add_parser(commands)
    commands.add_parser("doctor", help=DOCTOR_HELP, add_help=False)  # listed; phalanx.cli.doctor parses it
    _add_bench_parser(commands)
    return parser, flags


def _add_bench_parser(commands: argparse._SubParsersAction) -> None:
    """``phalanx bench comm``: the only benchmark so far."""
    bench = commands.add_parser("bench", help=BENCH_HELP, description=BENCH_HELP, epilog=BENCH_COMM_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    benchmarks = bench.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    comm = benchmarks.add_parser("comm", help="latency, bandwidth and every allreduce algorithm",
                                 description=BENCH_COMM_DESCRIPTION, epilog=BENCH_COMM_EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    comm.add_argument("-n", "--nproc-per-node", type=int, default=2, metavar="N", help="workers (default 2)")
    comm.add_argument("--reps", type=int, default=7, help="repetitions per measurement (default 7)")
    comm.add_argument("--transport", default="auto", choices=("auto", "shm", "gloo"))


def tune_parser() -> tuple[argparse.ArgumentParser, frozenset[str]]:
    """The ``phalanx tune`` parser, and its options that take a value."""
    parser = argparse.ArgumentParser(prog=PROG, allow_abbrev=False)
    return tune.add_parser(parser.add_subparsers(dest="command"))


def _add_run_arguments(run: argparse.ArgumentParser) -> RunFlags:
    dests: dict[str, str] = {}
    value_options: list[str] = []

    def option(*flags: str, **kwargs: object) -> None:
        action = run.add_argument(*flags, **kwargs)  # type: ignore[arg-type]
        dests.update(dict.fromkeys(flags, action.dest))
        if kwargs.get("action") is None:
            value_options.extend(flags)

    option("-n", "--nproc-per-node", type=int, default=1, metavar="N",
           help="worker processes to start (default 1; more than this host's cores prints a warning)")
    option("-np", "--num-proc", dest="np", type=int, default=None, metavar="N",
           help="horovodrun's -np: workers in all, shared equally among the hosts (-H, or --nnodes)")
    option("-H", "--hosts", default=None, metavar="HOST:SLOTS,...",
           help="horovodrun's host list: on each host the launcher takes nnodes from it, its node rank from "
                "this host's place, -n from the slots (or -np) and the master address from the first host")
    option("--hostfile", default=None, metavar="FILE", help="the host list as a file: `host slots=N` per line")
    option("-m", "--module", action="store_true", help="run the target as a module, like `python -m`")
    option("--nnodes", default="1", metavar="N|MIN:MAX",
           help="hosts taking part, one launcher each (default 1); a range MIN:MAX makes the job elastic")
    option("--node-rank", type=int, default=None, metavar="I",
           help="this host's index, 0 to nnodes-1 (default 0, or this host's place in -H); node 0 hosts the store")
    option("--min-workers", type=int, default=None, metavar="K",
           help="elastic: go on after losing workers while at least K remain (default: stop at the first failure)")
    option("--servers", type=int, default=0, metavar="S",
           help="also start S parameter-server processes on this host running the same script "
                "(px.role() == 'server'; see docs/strategies.md)")
    option("--heartbeat-timeout", type=float, default=None, metavar="SECONDS",
           help="elastic: a worker silent this long is declared dead and killed (default: half of --timeout, at most 30)")
    option("--master-addr", default=DEFAULT_MASTER_ADDR, metavar="ADDR",
           help=f"address the rendezvous store listens on and workers connect to (default {DEFAULT_MASTER_ADDR})")
    option("--master-port", type=int, default=0, metavar="PORT",
           help="port of the rendezvous store (default 0: a free port)")
    option("--timeout", type=float, default=None, metavar="SECONDS",
           help="rendezvous and collective timeout, passed to workers as PHALANX_TIMEOUT (default 300)")
    option("--grace", type=float, default=DEFAULT_GRACE_S, metavar="SECONDS",
           help=f"after a failure, how long workers get between SIGTERM and SIGKILL (default {DEFAULT_GRACE_S:g})")
    option("--no-prefix", action="store_true", help="do not prefix output lines with the worker's [rank]")
    option("--no-fork-server", action="store_true",
           help="start each worker as a fresh python (each importing torch) instead of forking it from a "
                "process that imported torch once")
    option("--device", default="auto", choices=DEVICES,
           help="what the workers train on: cuda (NCCL, a GPU per worker: more workers than GPUs is refused), "
                "cpu (Gloo, even where GPUs are) or auto (default: GPUs when visible)")
    run.add_argument("target", nargs="?", metavar="script.py | module", help="the script, or with -m the module")
    run.add_argument("args", nargs="*", metavar="args", help="arguments passed to the script unchanged")
    return RunFlags(dests, frozenset(value_options))


def launch(config: LaunchConfig, stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> int:
    """Run ``config`` to the end, print why it failed if it did, and return the launcher's exit code."""
    supervisor = ElasticSupervisor if config.elastic else Supervisor
    result = supervisor(config, stdout, stderr).run()
    message = result.describe(shown=True)  # the workers' stderr went where the message goes
    if message:
        err = stderr or sys.stderr
        err.write(message + "\n")
        err.flush()
    return result.exit_code


if __name__ == "__main__":
    raise SystemExit(main())

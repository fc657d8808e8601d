"""px.Sharded (levels 1-3) against DDP, px.DataParallel, ZeroRedundancyOptimizer and FSDP2, on this host
or on two.

    python benchmarks/bench_shard.py [--reps 3] [--workers 2,4] [--models mlp,cnn,transformer]
                                     [--parts memory,speed] [--steps 10] [--variants ...]
    python benchmarks/bench_shard.py --netns 1gbit --workers 4 --parts speed --variants px,s1,s2,s3,fsdp2

With ``--netns RATE`` (root) every job runs on two network namespaces joined by a veth shaped to RATE
(bench_ddp.py's), half of its workers in each, one ``phalanx run`` per namespace: two hosts, shared
memory within each. There s1-s3 are what a user gets between hosts (level 3 gathers its blocks).

Every measurement is one ``python -m phalanx run -n W`` job of this same file running one variant
(for the speed part, every model in turn). Within each repetition every variant runs once, in a
shuffled order (different each repetition, the same for both parts), so a drift of the machine hits
all variants alike; figures are medians over repetitions, ratios are medians of the per-repetition
ratios to a baseline of the same repetition. Each job has a timeout; a variant that fails or times
out is reported as failed, with its error, and the others go on. Every worker runs with one
intra-op thread (torch.set_num_threads(1)); all optimizers are Adam (lr 1e-3).

Variants:
  ddp    torch.nn.parallel.DistributedDataParallel(model) on the process group px.init() made, Adam
  px     px.DataParallel(model), Adam (the unsharded phalanx engine, 25 MB buckets)
  s1     px.Sharded(level=1): Adam's state sharded (ZeRO-1), buckets all-reduced
  s2     px.Sharded(level=2): also the gradients (buckets reduce-scattered, freed after the step);
         between hosts s1 and s2 keep one copy per host by default where it holds no more (as s1h,
         s2h; at 2 hosts of 2 workers with Adam it does), else shard across the hosts (as s1x, s2x)
  s3     px.Sharded(level=3): also the parameters; on one host the units live once in shared memory
         (each worker's share of them is its chunk) and nothing is gathered
  s1x, s2x, s3x  the same with shared_memory=False, as between hosts: each worker its own copy of the
         parameters (levels 1-2), or its own chunks gathered per block around forward and backward
         (level 3: fusion_threshold_mb set to FSDP2's largest unit, so its blocks are FSDP2's: equal memory)
  s3xf   s3x gathering in float32 under --precision bf16 (s3, s3x and s3h gather in bfloat16 there, as
         px.fit's precision="bf16-mixed" has them)
  s1h, s2h, s3h  the same with shared_memory=True: between hosts each host keeps the units once in its
         shared memory, its workers sharding them and the hosts replicas of each other (hybrid
         sharding: 16 / workers-per-host bytes a parameter); on one host s1-s3 themselves
  zero   DDP + torch.distributed.optim.ZeroRedundancyOptimizer(Adam)
  fsdp2  fully_shard on each Linear/Conv2d (the transformer: each encoder layer), then the root, on
         init_device_mesh("cpu", (W,)); Adam over the DTensor parameters
  hsdp   the same on a (hosts, workers per host) mesh: FSDP2's hybrid sharding, sharded within a
         host and replicated across hosts (the peer of s1h-s3h)
  Under --precision bf16 every forward and loss runs under torch.autocast(bfloat16), and FSDP2 and
  HSDP gather their units in bfloat16 and reduce in float32 (MixedPrecisionPolicy(param_dtype=
  torch.bfloat16, reduce_dtype=torch.float32)), as px.Sharded's level 3 does; the root's own
  parameters (the CNN's BatchNorms) in float32, since batch_norm refuses bfloat16 weights beside its
  float32 running statistics.

Parts:
  memory  an MLP of 16.81 M parameters (2048-2048-2048-2048-2048-10, batch 32 per worker), 3 Adam steps.
          Per rank, bytes per parameter (of the whole model) held in parameters / gradients / optimizer
          state, counting each tensor storage once (a DTensor: its local shard), after the third step
          and, for the gradients, also at the third step (after backward, before optimizer.step);
          phalanx's buckets and the sharded chunks' gradients count as gradients, DDP's own buckets
          (invisible to Python) are read from DDP's logging data. Peak: VmHWM during the third step
          (reset just before it through /proc/self/clear_refs) minus VmRSS just before the model was
          built, with MALLOC_MMAP_THRESHOLD_=131072 (set in the job's environment and by mallopt) so
          freed tensors go back to the system; "peak, whole job" is the same from before the model
          was built to the end, set-up included.
  speed   median step time on rank 0 (zero_grad, forward, cross-entropy, backward, optimizer.step)
          over --steps steps after --warmup, per variant, for the models of benchmarks/bench_ddp.py:
          mlp (5.26 M parameters, 1024-2048-1024-1024-10, batch 96 per worker), cnn (0.34 M, six
          conv+BatchNorm blocks, 3x32x32, batch 32), transformer (0.40 M, 2 encoder layers of width 128
          over 32 tokens, batch 32). Throughput ratios (baseline step / variant step, >1: faster):
          s1/px, s2/px, s3/fsdp2, and px/ddp, zero/ddp for reference.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import hashlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ddp import (MODEL_SPECS, NETNS, NETNS_ADDR, ForeignLoad, build_model, netns_down, netns_up,  # noqa: E402
                       timed_step)

from phalanx.doctor.footprint import shared_ranges  # noqa: E402  (the doctor counts shared memory as this does)

VARIANTS = ["ddp", "px", "s1", "s2", "s3", "s1x", "s2x", "s3x", "s3xf", "s1h", "s2h", "s3h", "zero", "fsdp2", "hsdp"]
MEMORY_SPEC = {"batch": 32, "input": [2048], "classes": 10}
MEMORY_STEPS = 3
LR = 1e-3
#: (variant, baseline) pairs whose throughput ratios are reported, and the issue's targets.
RATIOS = [("s1", "px", 1.0), ("s2", "px", 1.0), ("s1x", "px", 1.0), ("s2x", "px", 1.0), ("s3", "fsdp2", 1.5),
          ("s3x", "fsdp2", 1.5), ("s3xf", "fsdp2", None), ("s3x", "s3xf", None), ("s1h", "px", 1.0), ("s2h", "px", 1.0), ("s3h", "hsdp", 1.5), ("px", "ddp", None),
          ("zero", "ddp", None), ("fsdp2", "ddp", None), ("hsdp", "ddp", None)]
#: Bytes per parameter at 4 workers (issue 43, item 6).
MEMORY_TARGETS = {"s1": 10.5, "s2": 7.5, "s1x": 10.5, "s2x": 7.5, "s3": 4.5, "s3x": 4.5}


def memory_model() -> nn.Module:
    """16.81 M parameters in 10 tensors: four 2048x2048 layers and a 10-way head."""
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(2048, 2048), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(2048, 10))


# ---------------------------------------------------------------------------------------------
# Worker side (runs inside phalanx run)
# ---------------------------------------------------------------------------------------------


def _status(field: str) -> int:
    """A /proc/self/status field, in bytes."""
    with open("/proc/self/status") as status:
        return int(re.search(rf"{field}:\s+(\d+)", status.read()).group(1)) * 1024


def _reset_peak() -> None:
    """VmHWM := VmRSS now (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one (before the root): encoder layers, else Linear and Conv2d."""
    layers = [m for m in model.modules() if isinstance(m, nn.TransformerEncoderLayer)]
    return layers or [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]


def largest_unit_mb(model: nn.Module) -> float:
    return max(sum(p.numel() * p.element_size() for p in m.parameters()) for m in fsdp_units(model)) / 2**20


def set_up(variant: str, model: nn.Module, dtype: torch.dtype | None = None) -> tuple[nn.Module, Any, Any, dict[str, Any]]:
    """The variant's training model and optimizer (and the strategy to finish, and facts to report);
    ``dtype``: the autocast dtype the steps compute in, which level 3 and FSDP2 gather in."""
    import phalanx as px
    world = px.size()
    facts: dict[str, Any] = {}
    if variant == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
        return model, torch.optim.Adam(model.parameters(), lr=LR), None, facts
    if variant == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        model = nn.parallel.DistributedDataParallel(model)
        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=LR), None, facts
    if variant == "px":
        return px.DataParallel(model), torch.optim.Adam(model.parameters(), lr=LR), None, facts
    if variant in ("s1", "s2", "s3", "s1x", "s2x", "s3x", "s3xf", "s1h", "s2h", "s3h"):
        level = int(variant[1])
        options: dict[str, Any] = {"x": {"shared_memory": False}, "h": {"shared_memory": True}}.get(variant[2:3], {})
        if level == 3 and dtype is not None:
            options["gather_dtype"] = torch.float32 if variant == "s3xf" else dtype
        if variant in ("s3x", "s3xf"):  # blocks as FSDP2's units (a little over the largest, which is then a block)
            options["fusion_threshold_mb"] = largest_unit_mb(model) * 1.001
            facts["threshold_mb"] = options["fusion_threshold_mb"]
        strategy = px.Sharded(level=level, **options)
        wrapped, optimizer = strategy.setup(model, torch.optim.Adam(model.parameters(), lr=LR))
        facts["units"] = len(optimizer.units)
        facts["shared"] = bool(getattr(optimizer, "shared", False))
        if strategy.gathering is not None:
            facts["blocks"] = len(strategy.gathering.blocks)
        return wrapped, optimizer, strategy, facts
    if variant in ("fsdp2", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        hosts = world // px.local_size() if variant == "hsdp" else 1
        # ranks host-major (phalanx run's node_rank * workers per host + local rank): the shard dim is a host
        mesh = init_device_mesh("cpu", (hosts, world // hosts), mesh_dim_names=("replicate", "shard")) if hosts > 1 \
            else init_device_mesh("cpu", (world,))
        facts["mesh"] = list(mesh.shape)
        units = fsdp_units(model)
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype is not None else None)
        for unit in units:
            fully_shard(unit, mesh=mesh, mp_policy=policy)
        # the root's own parameters (the CNN's BatchNorms) stay float32: batch_norm refuses bfloat16
        # weights beside its float32 running statistics ("expected scalar type BFloat16 but found Float")
        fully_shard(model, mesh=mesh)
        facts["blocks"] = len(units) + 1
        return model, torch.optim.Adam(model.parameters(), lr=LR), None, facts
    raise ValueError(f"unknown variant {variant!r}")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _storages(tensors: Any) -> dict[int, int]:
    """data_ptr -> bytes of each distinct storage (a DTensor: its local shard's)."""
    found: dict[int, int] = {}
    for tensor in tensors:
        if tensor is None or not torch.is_tensor(tensor):
            continue
        storage = _local(tensor).untyped_storage()
        if storage.nbytes():
            found[storage.data_ptr()] = storage.nbytes()
    return found


def _reachable() -> dict[int, int]:
    """Every tensor storage Python can reach (after a collection of reference cycles)."""
    gc.collect()
    return _storages(obj for obj in gc.get_objects() if torch.is_tensor(obj))


def held(variant: str, model: nn.Module, optimizer: Any, others: dict[int, int] | None = None) -> dict[str, int]:
    """Bytes this rank holds in parameters, gradients and optimizer state, each storage counted once
    (in the first of those it belongs to); with ``others`` (the storages there were before the model
    was built), also every other tensor Python can reach that is not one of those."""
    params = list(model.parameters())
    grads: list[Any] = [p.grad for p in params]
    if variant.startswith("s"):
        chunks = [p for group in optimizer.stepping.param_groups for p in group["params"]]
        params += chunks
        grads += [p.grad for p in chunks]
    reducer = getattr(model, "reducer", None)
    if variant.startswith(("px", "s")) and reducer is not None:
        grads += [bucket.flat for bucket in reducer._buckets]
    inner = optimizer.optim if variant == "zero" else optimizer
    state = [value for entry in inner.state.values() for value in entry.values()]
    counted: dict[int, int] = {}
    sizes = {}
    shared = shared_ranges()
    for name, tensors in (("params", params), ("grads", grads), ("state", state)):
        mine = {ptr: n for ptr, n in _storages(tensors).items() if ptr not in counted}
        counted.update(mine)
        sizes[name] = sum(mine.values())
        # memory every worker of the host maps (px.Sharded's units at levels 1-2): each rank's share
        sizes[name + "_shared"] = sum(n for ptr, n in mine.items() if any(lo <= ptr < hi for lo, hi in shared))
    if variant in ("ddp", "zero"):  # DDP's own gradient buckets, which Python does not see
        sizes["ddp_buckets"] = _ddp_bucket_bytes(model)
    if others is not None:  # e.g. buffers a finished collective's handle still holds
        sizes["other"] = sum(n for ptr, n in _reachable().items() if ptr not in counted and ptr not in others)
    return sizes


def _ddp_bucket_bytes(model: Any) -> int:
    """DDP's reducer buckets, from its logging data ("bucket_sizes", bytes) when it has them."""
    data = model._get_ddp_logging_data()
    sizes = data.get("bucket_sizes")
    if isinstance(sizes, str):
        sizes = [int(s) for s in sizes.split(",") if s.strip()]
    return int(sum(sizes)) if sizes else -1


def _batch(spec: dict[str, Any], rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn([spec["batch"], *spec["input"]], generator=generator)
    return x, torch.randint(0, spec["classes"], (spec["batch"],), generator=generator)


def _tiny_run(variant: str, x: torch.Tensor, y: torch.Tensor) -> None:
    """Two steps of a tiny model through the same variant: the imports and one-time set-ups it
    triggers (torch.optim alone imports ~800 modules, ~68 MB) happen before the baseline."""
    torch.manual_seed(0)
    wrapped, optimizer, strategy, _ = set_up(variant, nn.Sequential(nn.Linear(x.shape[1], 64), nn.ReLU(),
                                                                     nn.Linear(64, 10)))
    for _ in range(2):
        optimizer.zero_grad()
        F.cross_entropy(wrapped(x), y).backward()
        optimizer.step()
    if strategy is not None:
        strategy.finish()
    del wrapped, optimizer, strategy
    gc.collect()


def job_memory(variant: str) -> None:
    import phalanx as px
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 131072)  # M_MMAP_THRESHOLD: as MALLOC_MMAP_THRESHOLD_ does (both set)
    px.init()
    rank = px.rank()
    x, y = _batch(MEMORY_SPEC, rank)
    _tiny_run(variant, x, y)
    existing = _reachable()
    _reset_peak()
    before, shmem_before = _status("VmRSS"), _status("RssShmem")
    torch.manual_seed(0)
    model = memory_model()
    count = sum(p.numel() for p in model.parameters())
    wrapped, optimizer, strategy, facts = set_up(variant, model)
    setup_rss, setup_peak = _status("VmRSS") - before, _status("VmHWM") - before
    gc.collect()  # what set-up left in reference cycles (freed here so that the steps compare alike)
    setup_garbage = setup_rss - (_status("VmRSS") - before)
    at_step: dict[str, int] = {}
    for step in range(MEMORY_STEPS):
        last = step == MEMORY_STEPS - 1
        if last:
            job_peak = _status("VmHWM") - before
            _reset_peak()
        optimizer.zero_grad()
        F.cross_entropy(wrapped(x), y).backward()
        if last:
            at_step = held(variant, wrapped, optimizer)
        optimizer.step()
    step_peak = _status("VmHWM") - before
    rss_after = _status("VmRSS") - before
    shmem = _status("RssShmem") - shmem_before  # pages other ranks of this host map too
    after = held(variant, wrapped, optimizer, others=existing)
    result = {"rank": rank, "params": count, "before": before, "setup_rss": setup_rss, "setup_peak": setup_peak,
              "setup_garbage": setup_garbage, "peak_step": step_peak, "peak_job": max(step_peak, job_peak),
              "rss_after": rss_after, "shmem": shmem, "world": px.size(), "per_host": px.local_size(), "held": after, "held_at_step": at_step, **facts}
    print("RESULT " + json.dumps(result), flush=True)
    if strategy is not None:
        strategy.finish()


def job_speed(variant: str, models: str, steps: str, warmup: str, precision: str = "32") -> None:
    import phalanx as px
    px.init()
    dtype = torch.bfloat16 if precision == "bf16" else None
    rank, world = px.rank(), px.size()
    probe = ForeignLoad(px.allgather_object(os.getpid()))
    for name in models.split(","):
        spec = MODEL_SPECS[name]
        x, y = _batch(spec, rank)
        torch.manual_seed(0)
        model = build_model(name)
        count = sum(p.numel() for p in model.parameters())
        wrapped, optimizer, strategy, facts = set_up(variant, model, dtype)
        times, phases = [], []
        for step in range(int(warmup) + int(steps)):
            if step == int(warmup):
                probe.start()
            started = time.perf_counter()
            forward, backward = timed_step(wrapped, optimizer, x, y, dtype)
            ended = time.perf_counter()
            if step >= int(warmup):
                times.append(ended - started)
                phases.append((forward - started, backward - forward, ended - backward))
        foreign = probe.stop()
        if rank == 0:
            result = {"model": name, "params": count, "world": world, "source": os.path.dirname(px.__file__), "step_ms": 1e3 * statistics.median(times),
                      "phases_ms": [1e3 * statistics.median(column) for column in zip(*phases)],
                      "foreign": foreign, **facts}
            print("RESULT " + json.dumps(result), flush=True)
        if strategy is not None:
            strategy.finish()
        del wrapped, optimizer, model, strategy
        gc.collect()


# ---------------------------------------------------------------------------------------------
# Driver side
# ---------------------------------------------------------------------------------------------


def launch(part: str, variant: str, workers: int, args: argparse.Namespace) -> dict[str, Any]:
    """One job; {"ok": [results]} or {"error": text}. Never raises for the job's own failure."""
    job = [os.path.abspath(__file__), "--job", part, variant]
    if part == "speed":
        job += [",".join(args.models), str(args.steps), str(args.warmup), args.precision]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    env["OMP_NUM_THREADS"] = "1"
    if getattr(args, "source", None):  # the copy of src/ taken at the start (ahead of the editable install's path)
        env["PYTHONPATH"] = os.pathsep.join([args.source, *filter(None, [env.get("PYTHONPATH")])])
    if part == "memory":
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    run = [sys.executable, "-m", "phalanx", "run", "--timeout", str(int(args.timeout))]
    if args.netns:  # one launcher per namespace, half of the workers each: two hosts, holding one secret
        env["PHALANX_SECRET"] = os.urandom(24).hex()
        port = str(29600 + random.randrange(300))
        commands = [["ip", "netns", "exec", NETNS[node], *run, "-n", str(workers // 2), "--nnodes", "2",
                     "--node-rank", str(node), "--master-addr", NETNS_ADDR[0], "--master-port", port, *job]
                    for node in range(2)]
    else:
        commands = [[*run, "-n", str(workers), *job]]
    started = time.monotonic()
    # sessions of their own, so that a job that times out goes with its workers (their process groups)
    logs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in commands]  # no pipe to fill
    processes = [subprocess.Popen(command, stdout=out, stderr=err, text=True, env=env, start_new_session=True)
                 for command, (out, err) in zip(commands, logs)]
    # a launcher that fails (or the timeout) ends the others: a host alone would wait for its peer
    while any(process.poll() is None for process in processes):
        failed = any(process.returncode not in (None, 0) for process in processes)
        if failed or time.monotonic() - started > args.timeout:
            for process in processes:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
            for process in processes:
                process.wait()
            if not failed:
                return {"error": f"{part} {variant} at {workers} workers timed out after {args.timeout:.0f} s\n"
                                 f"{_read(err for _, err in logs)[-1500:]}"}
            break
        time.sleep(0.1)
    stdout, stderr = _read(out for out, _ in logs), _read(err for _, err in logs)
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in stdout.splitlines() if "RESULT " in line]
    failed = next((process.returncode for process in processes if process.returncode != 0), 0)
    if failed or not results:
        tail = (stderr or stdout)[-1500:]
        return {"error": f"{part} {variant} at {workers} workers failed (exit {failed})\n{tail}"}
    return {"ok": results, "wall_s": time.monotonic() - started}


def _read(files: Any) -> str:
    """The text written to each of ``files`` (temporary files), one after the other; closes them."""
    texts = []
    for handle in files:
        handle.seek(0)
        texts.append(handle.read())
        handle.close()
    return "".join(texts)


def measure(args: argparse.Namespace) -> dict[tuple[str, int, str], list[dict[str, Any]]]:
    """Every (part, workers, variant) once per repetition, variants shuffled within each."""
    measured: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for rep in range(args.reps):
        for part in args.parts:
            if part == "memory" and rep >= args.memory_reps:
                continue
            for workers in args.workers:
                order = args.variants[:]
                random.Random(f"{rep}").shuffle(order)
                for variant in order:
                    outcome = launch(part, variant, workers, args)
                    measured.setdefault((part, workers, variant), []).append(outcome)
                    if "error" in outcome:
                        print(f"FAILED: {outcome['error']}", file=sys.stderr, flush=True)
                    else:
                        print(f"  rep {rep + 1} {part} W={workers} {variant}: {outcome['wall_s']:.1f} s",
                              file=sys.stderr, flush=True)
        print(f"repetition {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
    return measured


def _failed(outcomes: list[dict[str, Any]]) -> str | None:
    errors = [o["error"].splitlines()[0] for o in outcomes if "error" in o]
    return f"failed {len(errors)}/{len(outcomes)}: {errors[0]}" if errors else None


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _own(sizes: dict[str, int], name: str, per_host: int) -> float:
    """A category's bytes on one rank, memory that every worker of the host maps counted 1/(its workers)."""
    return sizes[name] - sizes.get(name + "_shared", 0) * (1 - 1 / per_host)


def report_memory(measured: dict, args: argparse.Namespace) -> None:
    for workers in args.workers:
        print(f"\n#### Memory, {workers} workers: MLP of 16.81 M parameters, Adam, bytes per parameter of the model "
              f"per rank (median over ranks and repetitions; the largest rank's in brackets where it differs; "
              "memory all workers of a host map counted 1/(its workers) per rank, marked *)\n")
        print("| variant | parameters | gradients | optimizer state | **held after a step** | other tensors | "
              "resident after a step | gradients at the step | **peak during a step** | peak, whole job | "
              "target at 4 workers |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        garbage = {}
        for variant in args.variants:
            outcomes = measured.get(("memory", workers, variant), [])
            ranks = [r for o in outcomes if "ok" in o for r in o["ok"]]
            failure = _failed(outcomes)
            if not ranks:
                print(f"| {variant} | {failure or 'not run'} |" + " |" * 9)
                continue
            n = ranks[0]["params"]

            def cell(values: list[float], mark: bool = False) -> str:
                med, top = _median(values) / n, max(values) / n
                return f"{med:.2f}{'*' if mark else ''}" + (f" [{top:.2f}]" if top - med >= 0.05 else "")

            def category(name: str, sizes_of: str = "held") -> tuple[list[float], bool]:
                values = [_own(r[sizes_of], name, r["per_host"]) for r in ranks]
                return values, any(r[sizes_of].get(name + "_shared", 0) for r in ranks)

            hidden = [max(r["held"].get("ddp_buckets", 0), 0) for r in ranks]
            (params, p_mark), (grads, g_mark), (state, s_mark) = (category(c) for c in ("params", "grads", "state"))
            grads = [g + h for g, h in zip(grads, hidden)]
            total = [a + b + c for a, b, c in zip(params, grads, state)]
            grads_step, gs_mark = category("grads", "held_at_step")
            grads_step = [g + h for g, h in zip(grads_step, hidden)]
            unshare = [r["shmem"] * (1 - 1 / r["per_host"]) for r in ranks]
            shm = any(r["shmem"] > n / 2 for r in ranks)  # more than the transport's own buffers
            target = MEMORY_TARGETS.get(variant)
            target_cell = "" if target is None else f"<= {target}" + (" + gathered layers" if variant == "s3x" else "")
            hidden_note = " (DDP's buckets included)" if any(hidden) else ""
            print(f"| {variant}{' (' + failure + ')' if failure else ''} | {cell(params, p_mark)} | "
                  f"{cell(grads, g_mark)}{hidden_note} | {cell(state, s_mark)} | **{cell(total, p_mark or g_mark)}** | "
                  f"{cell([r['held']['other'] for r in ranks])} | "
                  f"{cell([r['rss_after'] - u for r, u in zip(ranks, unshare)], shm)} | {cell(grads_step, gs_mark)} | "
                  f"**{cell([r['peak_step'] - u for r, u in zip(ranks, unshare)], shm)}** | "
                  f"{cell([r['peak_job'] - u for r, u in zip(ranks, unshare)], shm)} | {target_cell} |")
            if _median([r["setup_garbage"] for r in ranks]) > 2**20:
                garbage[variant] = _median([r["setup_garbage"] for r in ranks]) / n
        facts = {v: measured[("memory", workers, v)][0]["ok"][0] for v in args.variants
                 if measured.get(("memory", workers, v)) and "ok" in measured[("memory", workers, v)][0]}
        notes = [f"{v}: {f['units']} units" + (f" in {f['blocks']} blocks" if "blocks" in f else "")
                 + (", in shared memory" if f.get("shared") else "") for v, f in facts.items() if "units" in f]
        notes += [f"{v}: {f['blocks']} fully_shard calls" for v, f in facts.items() if v in ("fsdp2", "hsdp")]
        if notes:
            print("\n" + "; ".join(notes) + ".")
        if garbage:
            print("Freed by gc.collect() right after set-up (reference cycles set-up left), B/param: "
                  + ", ".join(f"{v} {g:.2f}" for v, g in garbage.items()) + ".")


def report_speed(measured: dict, args: argparse.Namespace) -> None:
    for model in args.models:
        for workers in args.workers:
            steps: dict[str, list[float | None]] = {}
            info: dict[str, dict[str, Any]] = {}
            failures: dict[str, str] = {}
            for variant in args.variants:
                row = []
                for outcome in measured.get(("speed", workers, variant), []):
                    found = [r for r in outcome.get("ok", []) if r["model"] == model]
                    row.append(found[0]["step_ms"] if found else None)
                    if found:
                        info.setdefault(variant, found[0])
                        info[variant].setdefault("all", []).append(found[0])
                steps[variant] = row
                failure = _failed(measured.get(("speed", workers, variant), []))
                if failure:
                    failures[variant] = failure
            params = next((i["params"] for i in info.values()), 0)
            foreign = [r.get("foreign") for i in info.values() for r in i["all"] if r.get("foreign") is not None]
            print(f"\n#### Speed, {model} ({params / 1e6:.2f} M parameters, batch {MODEL_SPECS[model]['batch']} per "
                  f"worker), {workers} workers, {args.reps} reps x {args.steps} steps"
                  + (f" (others used {_median(foreign):.0%} of the CPUs, median)" if foreign else "") + "\n")
            print("| variant | step ms (median) | forward / backward / step ms | samples/s |")
            print("|---|---:|---:|---:|")
            for variant in args.variants:
                values = [v for v in steps[variant] if v is not None]
                if not values:
                    print(f"| {variant} | {failures.get(variant, 'not run')} | | |")
                    continue
                phases = [statistics.median(p) for p in zip(*(r["phases_ms"] for r in info[variant]["all"]))]
                note = f" ({failures[variant]})" if variant in failures else ""
                blocks = f", {info[variant]['blocks']} blocks" if "blocks" in info[variant] else ""
                print(f"| {variant}{blocks}{note} | {_median(values):.1f} | "
                      f"{' / '.join(f'{p:.1f}' for p in phases)} | "
                      f"{MODEL_SPECS[model]['batch'] * workers / _median(values) * 1e3:.0f} |")
            print("\n| ratio (throughput) | median [min..max] over reps | target |\n|---|---:|---|")
            for variant, base, target in RATIOS:
                if variant not in steps or base not in steps:
                    continue
                ratios = [b / v for v, b in zip(steps[variant], steps[base]) if v and b]
                cell = (f"{_median(ratios):.2f}x [{min(ratios):.2f}..{max(ratios):.2f}]" if ratios else "failed")
                print(f"| {variant} / {base} | {cell} | {f'>= {target}x' if target else ''} |")


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _revision() -> str:
    """The commit measured, and whether src/ differed from it (other work in progress)."""
    def git(*command: str) -> str:
        return subprocess.run(["git", *command], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout

    try:
        head = git("log", "-1", "--format=%h %cd", "--date=iso").strip()
        changed = git("diff", "HEAD", "--name-only", "--", "src").split()
        digest = hashlib.sha1(git("diff", "HEAD", "--", "src").encode()).hexdigest()[:10]
    except (OSError, subprocess.SubprocessError):
        return "revision unknown"
    return head + (f", with uncommitted changes (diff sha1 {digest}) in {', '.join(changed)}" if changed
                   else ", src/ as committed")


def _snapshot() -> str:
    """A copy of src/ that every job imports, so that edits made while the benchmark runs do not mix in."""
    target = tempfile.mkdtemp(prefix="bench-shard-src-")
    shutil.copytree(os.path.join(ROOT, "src", "phalanx"), os.path.join(target, "phalanx"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--workers", default="2,4")
    parser.add_argument("--models", default="mlp,cnn,transformer")
    parser.add_argument("--parts", default="memory,speed")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--memory-reps", type=int, default=1,
                        help="repetitions that also run the memory part (its tensor counts do not vary)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per speed measurement")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--precision", choices=["32", "bf16"], default="32",
                        help="speed: bf16 runs forward and loss under autocast(bfloat16) (see the variants)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per job before it counts as failed")
    parser.add_argument("--json", help="also write every job's raw results here")
    parser.add_argument("--netns", metavar="RATE", help="run every job on two network namespaces joined by a veth "
                        "shaped to RATE (tc tbf, e.g. 1gbit), half of the workers in each: two hosts (root)")
    parser.add_argument("--job", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.job:
        {"memory": job_memory, "speed": job_speed}[args.job[0]](*args.job[1:])
        return
    args.workers = [int(w) for w in args.workers.split(",")]
    args.models, args.parts, args.variants = args.models.split(","), args.parts.split(","), args.variants.split(",")
    for name in args.models + args.variants + args.parts:
        if name not in {*MODEL_SPECS, *VARIANTS, "memory", "speed"}:
            raise SystemExit(f"unknown model, variant or part {name!r}")
    print(f"# torch {torch.__version__}, {os.cpu_count()} CPUs, Gloo, 1 intra-op thread per worker; load average "
          f"{os.getloadavg()[0]:.2f} at the start")
    print(f"# command: python {' '.join([os.path.relpath(__file__)] + sys.argv[1:])}")
    print(f"# phalanx: {_revision()}; jobs import a copy of src/ taken now", flush=True)
    args.source = _snapshot()
    started = time.monotonic()
    try:
        if args.netns:
            print(f"# two hosts: network namespaces {NETNS[0]} and {NETNS[1]} joined at {args.netns}, "
                  "half of each job's workers in each", flush=True)
            netns_up(args.netns)
        measured = measure(args)
    finally:
        if args.netns:
            netns_down()
        shutil.rmtree(args.source, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({" ".join(map(str, key)): value for key, value in measured.items()}, handle, indent=1)
    if "memory" in args.parts:
        report_memory(measured, args)
    if "speed" in args.parts:
        report_speed(measured, args)
    print(f"\n# {time.monotonic() - started:.0f} s of running; load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()

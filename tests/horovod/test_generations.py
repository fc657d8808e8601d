"""What Horovod holds per generation of the job (layout, process sets, negotiation, operations in
flight) hangs on the generation's communicator: a new generation starts it afresh, the old one's
end closes it, and nothing is registered or kept in module globals at import. The elastic re-form
is checked by tests/horovod/test_elastic.py (the job records what its reset saw)."""

from __future__ import annotations

import ast
from pathlib import Path

import phalanx.horovod.torch as hvd_package
from tests.harness import run_workers
from tests.horovod.test_collectives import _raised

HOROVOD = Path(hvd_package.__file__).parent
# The timeline is the one process-wide state: a trace file spans init and shutdown, as Horovod's does.
PROCESS_WIDE = {"timeline.py"}


def _module_state(tree: ast.Module) -> list[str]:
    """What a module does at import beyond defining names: calls (registering a hook somewhere) and
    mutable containers bound to names that are not constants."""
    containers = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
    found = []
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            found.append(ast.unparse(node))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, containers):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [target.id for target in targets if isinstance(target, ast.Name)]
            if any(not name.isupper() and not name.startswith("__") for name in names):
                found.append(ast.unparse(node))
    return found


def test_nothing_is_registered_at_import_and_no_module_keeps_a_generation_in_globals() -> None:
    for path in sorted(HOROVOD.glob("*.py")):
        if path.name in PROCESS_WIDE:
            continue
        tree = ast.parse(path.read_text())
        assert not _module_state(tree), (path.name, _module_state(tree))
        rebound = [node.names for node in ast.walk(tree) if isinstance(node, ast.Global)]
        assert not rebound, (path.name, rebound)


def _two_generations() -> dict:
    """hvd.init, a user's process set and an unnamed operation; shutdown; init again: what the second
    generation holds is new, and what the first held is closed."""
    import torch

    import phalanx as px
    import phalanx.horovod.torch as hvd
    from phalanx.horovod.torch import basics, negotiation, process_sets

    hvd.init(process_sets="dynamic")
    generation = px.communicator()
    first = (negotiation.current(), process_sets.registry(), basics.require_init())
    pair = hvd.add_process_set([0, 1])
    hvd.allreduce(torch.ones(1), process_set=pair)
    hvd.allreduce(torch.ones(1))  # the first unnamed allreduce of the global set
    hvd.shutdown()
    stale = negotiation.Submission((0, "stale"), {"kind": "barrier", "ranks": [0, 1]}, lambda: None)
    first[0].submit(stale)
    out = {"generation_closed": generation.closed, "negotiator_closed": first[0].closed,
           "stale": type(stale.future.exception(timeout=5)).__name__, "pair_id": pair.process_set_id,
           "initialized": hvd.is_initialized()}
    hvd.init()
    second = (negotiation.current(), process_sets.registry(), basics.require_init())
    out["new"] = [mine is not theirs for mine, theirs in zip(first, second)]
    out["sets"], out["dynamic"] = list(second[1].sets), second[1].dynamic
    out["pair_refused"] = "not registered" in _raised(lambda: hvd.allreduce(torch.ones(1), process_set=pair))
    # Unnamed operations are counted afresh: the first of this generation matches the other rank's.
    out["unnamed"] = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
    hvd.shutdown()
    return out


def test_shutdown_and_init_give_horovod_a_new_generation_and_close_the_old_one() -> None:
    for out in run_workers(_two_generations, 2):
        assert out["generation_closed"] and out["negotiator_closed"] and not out["initialized"], out
        assert out["stale"] == "HorovodInternalError", out  # the old negotiation has ended
        assert out["pair_id"] is None and out["pair_refused"], out  # the user's set went with its generation
        assert out["new"] == [True, True, True], out
        assert out["sets"] == [0] and out["dynamic"] is False, out
        assert out["unnamed"] == 2.0, out

"""A worker that starts after its elastic job finished is never admitted: it says so, trains nothing,
is master of nothing, and cannot save an untrained model over the job's result."""

from __future__ import annotations

import datetime
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.cli.test_coordinator import SECRET, form, make, post, spawn
from tests.elastic.launch import clean_env

SCRIPT = textwrap.dedent('''
    import sys, torch, torch.nn.functional as F
    import phalanx as px

    px.init()
    model = torch.nn.Linear(4, 2)
    if sys.argv[2] == "fit":
        px.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy,
               (torch.randn(8, 4), torch.randint(0, 2, (8,))), epochs=1, global_batch_size=4, verbose=0)
    else:  # a loop of one's own under px.elastic.run
        state = px.elastic.State(model=model)
        print("returned", px.elastic.run(lambda state: "trained")(state))
    print("master" if px.is_master() else "not master", flush=True)
    if px.is_master():
        torch.save(model.state_dict(), sys.argv[1])  # README's habit: would overwrite the trained model
''')


@pytest.mark.parametrize("loop", ["fit", "elastic.run"])
def test_a_worker_started_after_the_job_finished_trains_nothing_and_saves_nothing(tmp_path: Path, loop: str) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    coordinator = make(store, min_workers=1)  # node 0's coordinator, driven as in test_coordinator.py
    form(store, coordinator, [1, 2])
    for member in (1, 2):  # the job ends: both members exit cleanly
        post(store, type="exit", member=member, code=0)
    spawn(store, 9)  # a launcher started late announces its worker
    coordinator.start()
    script, model = tmp_path / "late.py", tmp_path / "model.pt"
    script.write_text(SCRIPT)
    env = clean_env(PHALANX_SECRET=SECRET.hex(), PHALANX_ELASTIC="1", PHALANX_MEMBER_ID="9", PHALANX_RANK="0",
                    PHALANX_WORLD_SIZE="1", PHALANX_LOCAL_RANK="0", PHALANX_LOCAL_WORLD_SIZE="1",
                    PHALANX_STORE_HOSTED="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                    PHALANX_TIMEOUT="20")
    try:
        done = subprocess.run([sys.executable, str(script), str(model), loop], env=env, capture_output=True,
                              text=True, timeout=120)
    finally:
        coordinator.stop()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "this worker was never admitted" in done.stderr and "finished before this worker joined" in done.stderr
    assert not model.exists(), "a worker that never trained saved a model as if it were the master"
    if loop == "fit":
        assert "master" not in done.stdout, done.stdout  # px.fit ended the process: nothing after it ran
    else:
        assert done.stdout.split() == ["returned", "None", "not", "master"], done.stdout

"""horovodrun's spellings in ``phalanx run`` (-np, -H, --hostfile, HOROVOD_* variables), and the
Horovod example script running unchanged but for its import under ``phalanx run -np 2``."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.cli.main import build_parser, config_from_args
from phalanx.errors import ConfigurationError
from tests.elastic.launch import clean_env
from tests import warm

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "horovod_mnist.py"


def _config(*argv: str):
    parser, _ = build_parser()
    return config_from_args(parser.parse_args(["run", *argv, "--", "train.py"]), [])


def test_horovodrun_host_lists_give_each_launcher_its_place(tmp_path: Path) -> None:
    here = socket.gethostname()
    assert _config("-np", "3").nproc_per_node == 3
    assert _config("-np", "4", "--nnodes", "2", "--master-port", "1").nproc_per_node == 2  # -np counts every host
    first = _config("-np", "4", "-H", f"{here}:2,other:2")
    assert (first.nnodes, first.node_rank, first.nproc_per_node, first.master_addr, first.master_port,
            first.hostname) == (2, 0, 2, here, 29500, here)
    second = _config("-H", f"other:2,{here}:2", "--master-port", "1234")
    assert (second.node_rank, second.nproc_per_node, second.master_addr, second.master_port) == (1, 2, "other", 1234)
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"# workers\nother slots=2\n{here} slots=2\n")
    assert _config("--hostfile", str(hostfile)).node_rank == 1
    assert _config("-H", "localhost:2").master_addr == "127.0.0.1"  # one host: the store stays on loopback
    spec = _config("-np", "4", "-H", f"{here}:2,other:2").worker_specs(29500)[1]
    assert {k: v for k, v in spec.variables.items() if k.startswith("HOROVOD_")} == {
        "HOROVOD_RANK": "1", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2",
        "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "2", "HOROVOD_HOSTNAME": here}
    for argv, message in [(("-np", "3", "-H", f"{here}:2,other:2"), "shared equally"),
                          (("-H", f"{here}:2,other:4"), "different slot counts"),
                          (("-H", "elsewhere:2,other:2"), "not among the hosts"),
                          (("-H", f"{here}:x"), "host:slots")]:
        with pytest.raises(ConfigurationError, match=message):
            _config(*argv)


@pytest.mark.timeout(150)
def test_the_horovod_example_trains_under_phalanx_run_np_2() -> None:
    code = [line for line in EXAMPLE.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]
    body = code[code.index('"""', 1) + 1:] if code[0].startswith('"""') and '"""' in code[1:] else code
    assert [line for line in body if "phalanx" in line] == ["import phalanx.horovod.torch as hvd"]
    run = warm.run([sys.executable, "-m", "phalanx", "run", "-np", "2", str(EXAMPLE), "--epochs", "3",
                    "--lr", "0.25", "--log-interval", "1000"], cwd=REPO, env=clean_env(), capture_output=True,
                   text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    accuracies = [float(a) for a in re.findall(r"\[0\] Test set: .*Accuracy: ([\d.]+)%", run.stdout)]
    assert len(accuracies) == 3 and accuracies[-1] > 40.0, run.stdout[-2000:]

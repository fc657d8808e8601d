"""Each launch environment is recognised from its variables alone."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import phalanx
from phalanx.comm.environment import detect, first_slurm_host
from phalanx.errors import ConfigurationError


def test_plain_process_is_a_world_of_one() -> None:
    info = detect({})
    assert (info.source, info.rank, info.world_size, info.local_rank) == ("single", 0, 1, 0)


def test_phalanx_launcher() -> None:
    info = detect({"PHALANX_RANK": "2", "PHALANX_WORLD_SIZE": "4", "PHALANX_LOCAL_RANK": "0",
                   "PHALANX_LOCAL_WORLD_SIZE": "2", "PHALANX_NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1",
                   "MASTER_PORT": "1234", "PHALANX_STORE_HOSTED": "1", "RANK": "9", "WORLD_SIZE": "10"})
    assert (info.source, info.rank, info.world_size, info.local_rank, info.local_world_size) == ("phalanx", 2, 4, 0, 2)
    assert (info.node_rank, info.master_addr, info.master_port, info.store_hosted) == (1, "10.0.0.1", 1234, True)


def test_torchrun() -> None:
    info = detect({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "host0", "MASTER_PORT": "29400", "GROUP_RANK": "1"})
    assert (info.source, info.rank, info.world_size, info.local_rank, info.local_world_size) == ("torchrun", 3, 4, 1, 2)
    assert (info.node_rank, info.master_addr, info.master_port, info.store_hosted) == (1, "host0", 29400, False)
    under_agent = detect({"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert under_agent.store_hosted  # torchrun's agent hosts the store: rank 0 connects as a client


def test_slurm_takes_the_first_host_as_master_and_a_port_from_the_job_id() -> None:
    info = detect({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
                   "SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[07-09,12]",
                   "SLURM_JOB_ID": "123456"})
    assert (info.source, info.rank, info.world_size, info.local_rank, info.local_world_size) == ("slurm", 5, 8, 1, 4)
    assert (info.node_rank, info.master_addr, info.master_port) == (1, "gpu07", 20000 + 123456 % 20000)


@pytest.mark.parametrize("nodelist, first", [("node1", "node1"), ("a[3-4],b1", "a3"), ("x-[010,2]", "x-010"),
                                              ("c1,c2", "c1"), ("", "")])
def test_first_slurm_host(nodelist: str, first: str) -> None:
    assert first_slurm_host(nodelist) == first


def test_openmpi_needs_master_addr() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(ConfigurationError, match="MASTER_ADDR is not set"):
        detect(env)
    info = detect({**env, "MASTER_ADDR": "head", "MASTER_PORT": "4000"})
    assert (info.source, info.rank, info.world_size, info.local_rank, info.master_addr) == ("openmpi", 1, 2, 1, "head")


def test_pmi_mpich() -> None:
    env = {"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"}
    with pytest.raises(ConfigurationError, match="MASTER_ADDR"):
        detect(env)
    info = detect({**env, "MASTER_ADDR": "head"})
    assert (info.source, info.rank, info.world_size, info.node_rank) == ("pmi", 2, 3, 2)


def test_inconsistent_variables_get_clear_errors() -> None:
    with pytest.raises(ConfigurationError, match="rank 4 is not within a world of 4"):
        detect({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(ConfigurationError, match="not an integer"):
        detect({"RANK": "zero", "WORLD_SIZE": "4"})


def test_phalanx_launch_variables_are_read_once_into_the_launch_info_under_any_environment() -> None:
    info = detect({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "PHALANX_TIMEOUT": "7.5",
                   "PHALANX_JOB_ID": "1234", "PHALANX_ELASTIC": "1", "PHALANX_MEMBER_ID": "3"})
    assert (info.source, info.timeout_s, info.job_id, info.elastic_member) == ("torchrun", 7.5, "1234", 3)
    plain = detect({})
    assert (plain.source, plain.timeout_s, plain.job_id, plain.elastic_member) == ("single", None, "", None)
    assert detect({"PHALANX_MEMBER_ID": "3"}).elastic_member is None  # a member id counts in an elastic launch only


@pytest.mark.parametrize("variables, named", [({"PHALANX_TIMEOUT": "soon"}, "'soon' is not a number of seconds"),
                                              ({"PHALANX_TIMEOUT": "-1"}, "must be positive seconds"),
                                              ({"PHALANX_ELASTIC": "1", "PHALANX_MEMBER_ID": "x"}, "not a member id"),
                                              ({"PHALANX_DEVICE": "tpu"}, "'tpu' is not a device")])
def test_a_bad_phalanx_launch_variable_is_named(variables: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigurationError, match=named):
        detect(variables)


def test_nothing_but_the_environment_module_reads_a_launch_variable() -> None:
    package = Path(phalanx.__file__).parent
    names = ("TIMEOUT_ENV", "JOB_ENV", "ELASTIC_ENV", "MEMBER_ENV", "PHALANX_TIMEOUT", "PHALANX_JOB_ID",
             "PHALANX_ELASTIC", "PHALANX_MEMBER_ID", "PHALANX_RANK", "MASTER_ADDR", "WORLD_SIZE", '"RANK"',
             "DEVICE_ENV", "PHALANX_DEVICE")
    reading = re.compile(r"environ(\.get\(|\[)[^\n]*(" + "|".join(names) + ")")
    readers = {path.relative_to(package).as_posix() for path in package.rglob("*.py")
               if "cli" not in path.parts and reading.search(path.read_text())}
    # detect() reads the mapping it is given (os.environ by default); faults.py, the bottom layer's
    # fault injection, keys its plan by the initial rank before any init
    assert readers == {"faults.py"}, readers

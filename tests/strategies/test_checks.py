"""Each strategy refuses, before anything trains, the px.fit options it cannot honour, naming the pair."""

from __future__ import annotations

import pytest

import phalanx as px
from phalanx.parallel.clipping import Clipping
from phalanx.strategies import parameter_server
from phalanx.strategies.base import FitOptions, Replicated

NORM, VALUE = Clipping(max_norm=1.0), Clipping(max_value=1.0)

REFUSED = [
    (px.CentralStorage(), FitOptions(elastic=True), r"px.CentralStorage with an elastic job"),
    (px.CentralStorage(), FitOptions(reproducible=True), r"px.CentralStorage with reproducible=True"),
    (px.CentralStorage(), FitOptions(several_optimizers=True), r"px.CentralStorage with a list of optimizers"),
    (px.CentralStorage(rank=1), FitOptions(checkpoint_dir="runs"), r"CentralStorage\(rank=1\) with checkpoint_dir"),
    (px.ParameterServer(), FitOptions(precision="16-mixed"), r"with precision='16-mixed'"),
    (px.ParameterServer(), FitOptions(reproducible=True), r"with reproducible=True"),
    (px.ParameterServer("async"), FitOptions(checkpoint_every=10), r"mode='async'\) with checkpoint_every"),
    (px.ParameterServer("async"), FitOptions(torch_scheduler=True), r"mode='async'\) with a torch lr scheduler"),
    (px.CentralStorage(), FitOptions(manual_step=True), r"CentralStorage with a step_fn that steps its own"),
    (px.ParameterServer(), FitOptions(manual_step=True), r"with a step_fn that steps its own optimizers"),
    (px.Sharded(level=2, copies=False), FitOptions(elastic=True),
     r"px.Sharded\(level=2\) with an elastic job without checkpoint_dir.*copies=False"),
]
ACCEPTED = [
    (Replicated(), FitOptions(precision="16-mixed", clipping=NORM, reproducible=True, several_optimizers=True,
                              torch_scheduler=True, elastic=True, checkpoint_every=5)),
    (px.CentralStorage(), FitOptions(precision="16-mixed", clipping=NORM, torch_scheduler=True, checkpoint_every=5)),
    (px.ParameterServer(), FitOptions(precision="bf16-mixed", torch_scheduler=True, checkpoint_every=5, elastic=True,
                                      clipping=NORM)),
    (px.ParameterServer("async"), FitOptions(clipping=NORM)),
    (px.Sharded(level=3), FitOptions(precision="bf16-mixed", clipping=NORM, reproducible=True, torch_scheduler=True,
                                     elastic=True, checkpoint_dir="runs", checkpoint_every=5)),
    (px.Sharded(level=2), FitOptions(elastic=True)),  # the shards' copies in host memory: no disk needed
]


@pytest.mark.parametrize("strategy, options, message", REFUSED, ids=[m for _, _, m in REFUSED])
def test_a_strategy_refuses_what_it_cannot_honour(strategy, options: FitOptions, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(px.ConfigurationError, match=message):
        strategy.check(options)


@pytest.mark.parametrize("strategy, options", ACCEPTED, ids=[type(s).__name__ for s, _ in ACCEPTED])
def test_and_accepts_what_it_can(strategy, options: FitOptions) -> None:  # type: ignore[no-untyped-def]
    strategy.check(options)


def test_clipping_by_norm_over_several_servers_is_refused_where_they_cannot_meet(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parameter_server.runtime, "num_servers", lambda: 2)
    px.ParameterServer("sync").check(FitOptions(clipping=NORM))
    px.ParameterServer("async").check(FitOptions(clipping=VALUE))
    px.ParameterServer("sync").check(FitOptions(clipping=VALUE, elastic=True))
    with pytest.raises(px.ConfigurationError, match=r"mode='async'\) with clip_grad_norm and 2 servers"):
        px.ParameterServer("async").check(FitOptions(clipping=NORM))
    with pytest.raises(px.ConfigurationError, match=r"with clip_grad_norm, 2 servers and an elastic job"):
        px.ParameterServer("sync").check(FitOptions(clipping=NORM, elastic=True))


def test_a_job_launched_with_servers_trains_with_parameter_servers_only(monkeypatch: pytest.MonkeyPatch) -> None:
    launched = {"PHALANX_RANK": "0", "PHALANX_WORLD_SIZE": "1", "PHALANX_LOCAL_RANK": "0",
                "PHALANX_LOCAL_WORLD_SIZE": "1", "PHALANX_SERVERS": "2"}  # a worker of `phalanx run --servers 2`
    for name, value in launched.items():
        monkeypatch.setenv(name, value)
    for strategy in (Replicated(), px.CentralStorage()):
        with pytest.raises(px.ConfigurationError, match="launched with parameter servers"):
            strategy.check(FitOptions())

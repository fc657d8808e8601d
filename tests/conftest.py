"""Shared fixtures: every test starts and ends outside any phalanx job."""

import pytest
import torch

import phalanx as px


@pytest.fixture(autouse=True)
def _no_leftover_job():
    torch.set_num_threads(1)
    yield
    px.shutdown()

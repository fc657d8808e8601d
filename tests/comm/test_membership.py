"""Statements: what an elastic job's processes tell each other through the store, sealed; whatever
an outsider writes or bumps there says nothing."""

from __future__ import annotations

import datetime

import torch.distributed as dist

from phalanx.comm.auth import JobSecret
from phalanx.comm.membership import Keys, Statements

SECRET = JobSecret.generate()


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=5))


def test_a_flag_an_outsider_bumps_or_forges_is_not_stated_and_the_real_one_still_is() -> None:
    store = _store()
    statements = Statements(store, SECRET)
    key = Keys.broken(3)
    store.add(key, 1)  # an outsider's bump
    assert not statements.holds(key)
    store.set(key, "1")
    assert not statements.holds(key)
    Statements(store, SECRET).state(key)  # a member states it: overwrites whatever was there
    assert statements.read(key) == "1"


def test_the_boundary_is_the_first_sealed_proposal_and_a_forged_one_decides_nothing() -> None:
    store = _store()
    first, second = Statements(store, SECRET), Statements(store, SECRET)
    assert first.agree(Keys.boundary(0), "12") == "12"
    assert second.agree(Keys.boundary(0), "13") == "12"  # the first proposal holds for every member
    store.set(Keys.boundary(1), "0")  # an outsider: every member would end generation 1 at once
    assert first.agree(Keys.boundary(1), "40") is None

"""The cross-rank check's verdicts and words (comm/agreement.py), which phalanx's collectives and
Horovod's negotiation share: what differs is named, then every rank's call."""

from __future__ import annotations

import pytest
import torch

from phalanx.comm import agreement
from phalanx.errors import CollectiveMismatchError, ConfigurationError


def _message(records: dict, operation: str, **options) -> str:
    with pytest.raises((CollectiveMismatchError, ConfigurationError)) as raised:
        agreement.compare(records, operation, 1, len(records), **options)
    return str(raised.value)


def test_records_read_as_fields_name_what_differs() -> None:
    sum_on = lambda root: agreement.reduction_detail("sum", root)  # noqa: E731
    reduce = {0: agreement.record("reduce", torch.float32, [4], sum_on(0)),
              1: agreement.record("reduce", torch.float64, [4], sum_on(1))}
    assert _message(reduce, "reduce") == (
        "reduce on rank 1: Mismatched dtype and root: rank 0: reduce(torch.float32, shape=[4], root=0); "
        "rank 1: reduce(torch.float64, shape=[4], root=1). Every rank must call it with the same dtype and root "
        "(collectives are matched by the order of the calls).")
    other = {0: agreement.record("allreduce", torch.float32, [4]), 1: agreement.record("broadcast", torch.float32, [4])}
    assert "Mismatched operation: rank 0: allreduce(torch.float32, shape=[4]); rank 1: broadcast(" in \
        _message(other, "allreduce")
    rows = {0: agreement.record("alltoall", torch.float32, [2, 3]), 1: agreement.record("alltoall", torch.float32, [5, 3])}
    agreement.compare(rows, "alltoall", 1, 2, ignore_first_dim=True)  # rows may differ
    joined = {0: agreement.record("join", torch.float32, [0]), 1: agreement.record("allgather", torch.float32, [2])}
    assert "rank(s) [0] have joined" in _message(joined, "allgather")
    agreement.compare(joined | {1: agreement.record("allreduce", torch.float32, [2])}, "allreduce", 1, 2)


def test_fields_of_any_caller_get_the_same_words() -> None:
    """Calls as fields (Horovod's records: several tensors, devices, its own names) through verdict."""
    def call(dtypes, shapes, devices, **agreed):
        return {"operation": "grouped_allreduce", "dtypes": dtypes, "shapes": shapes, "devices": devices, **agreed}

    one = call(["torch.float32"], [[2]], ["cpu"], prescale=1.0)
    cases = {
        "Mismatched number of tensors: rank 0: grouped_allreduce(torch.float32, shape=[2]); rank 1: "
        "grouped_allreduce(dtypes=[torch.float32, torch.float32], shapes=[[2], [2]])":
            call(["torch.float32"] * 2, [[2], [2]], ["cpu"] * 2, prescale=1.0),
        "Mismatched device: rank 0: grouped_allreduce(torch.float32, shape=[2], device=cpu); rank 1: "
        "grouped_allreduce(torch.float32, shape=[2], device=cuda)": call(["torch.float32"], [[2]], ["cuda"], prescale=1.0),
        "Mismatched prescale: ": call(["torch.float32"], [[2]], ["cpu"], prescale=2.0),
    }
    for words, other in cases.items():
        error = agreement.verdict({0: one, 1: other}, "grouped_allreduce", 0, 2, label="grouped_allreduce 'g'",
                                  matched="names are matched across ranks")
        assert isinstance(error, CollectiveMismatchError) and str(error).startswith(
            f"grouped_allreduce 'g' on rank 0: {words}"), (words, str(error))
        assert str(error).endswith("(names are matched across ranks).")
    assert agreement.verdict({0: one, 1: dict(one)}, "grouped_allreduce", 0, 2) is None
    joined = agreement.verdict({0: {"operation": "join"}, 1: one}, "grouped_allreduce", 1, 2,
                               joinable=("allreduce", "grouped_allreduce"))
    assert joined is None

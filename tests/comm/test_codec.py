"""The one object codec: what each way carries, what it refuses, and that nothing safe runs code."""

from __future__ import annotations

import pathlib
import pickle
import warnings

import pytest
import torch

from phalanx.comm import codec
from phalanx.errors import ConfigurationError


class RunsCodeWhenLoaded:
    def __reduce__(self):
        return (print, ("this ran while loading",))


def test_the_safe_way_carries_tensors_numbers_strings_and_containers_bit_for_bit() -> None:
    value = {"weights": torch.arange(6, dtype=torch.bfloat16).view(2, 3), "step": 7, "name": "rank 0",
             "dtype": torch.float16, "nested": [(1.5, None, b"raw")]}
    back = codec.decode(codec.encode(value, safe=True), safe=True)
    assert back.keys() == value.keys() and back["step"] == 7 and back["dtype"] is torch.float16
    assert torch.equal(back["weights"], value["weights"]) and back["weights"].dtype == torch.bfloat16
    assert back["nested"] == [(1.5, None, b"raw")]


def test_the_safe_way_refuses_before_sending_what_a_receiver_would_not_load() -> None:
    for unsafe in (pathlib.PurePosixPath("x"), RunsCodeWhenLoaded()):
        data, problem = codec.encoded(unsafe, safe=True)
        assert data.numel() == 0 and problem, unsafe
        with pytest.raises(ConfigurationError, match="cannot be sent to another rank safely"):
            codec.encode(unsafe, safe=True)


def test_the_safe_way_never_unpickles_what_it_receives(capsys: pytest.CaptureFixture[str]) -> None:
    forged = torch.frombuffer(bytearray(pickle.dumps(RunsCodeWhenLoaded())), dtype=torch.uint8)
    with pytest.raises(pickle.UnpicklingError), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch notes the forged bytes' pickle protocol before refusing them
        codec.decode(forged, safe=True)
    assert "this ran" not in capsys.readouterr().out


def test_the_trusted_way_carries_any_picklable_object_and_names_what_it_cannot() -> None:
    assert codec.decode(codec.encode(pathlib.PurePosixPath("x"), safe=False), safe=False) == pathlib.PurePosixPath("x")
    data, problem = codec.encoded(lambda: 0, safe=False)
    assert data.numel() == 0 and "lambda" in problem
    with pytest.raises(ConfigurationError, match="by pickle"):
        codec.encode(lambda: 0, safe=False)

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


def test_plain_data_travels_as_json_and_comes_back_equal_and_of_the_same_types() -> None:
    plain = {"ops": [[0, "allreduce.noname.3", {"kind": "allreduce", "ranks": [0, 1], "dtypes": ["torch.float32"],
                                               "shapes": [[2, 3]], "prescale": 1.0, "ragged": True, "root": None}]],
             "texts": ["", "é", "\ud800", "\x00"], "numbers": [0, -1, 2 ** 80, 1.0, -0.0, 1e-310, float("inf")],
             "flags": [True, False, 1, 0]}
    data = codec.encode(plain, safe=True)
    assert bytes(data[:1].numpy()) == codec.PLAIN and data.numel() < 500
    back = codec.decode(data, safe=True)
    assert back == plain and repr(back) == repr(plain)  # repr: bools stay bools, floats floats
    assert [type(x) for x in back["flags"]] == [bool, bool, int, int]


def test_what_json_would_change_takes_the_archive_and_keeps_its_types() -> None:
    import collections

    for value in ((1, [2]), {1: "a"}, [{"k": (None,)}], collections.OrderedDict(a=1), {"t": torch.ones(2)}):
        data = codec.encode(value, safe=True)
        assert bytes(data[:2].numpy()) == b"PK", value  # a torch.save archive
        back = codec.decode(data, safe=True)
        assert type(back) is type(value) and repr(back) == repr(value), value


def test_a_forged_plain_message_never_runs_code(capsys: pytest.CaptureFixture[str]) -> None:
    forged = [codec.PLAIN + pickle.dumps(RunsCodeWhenLoaded()),
              codec.PLAIN + b'{"__reduce__": ["print", ["this ran"]], "__class__": "os.system"}']
    with pytest.raises(ValueError):  # not JSON: refused, not unpickled
        codec.decode(torch.frombuffer(bytearray(forged[0]), dtype=torch.uint8), safe=True)
    assert codec.decode(torch.frombuffer(bytearray(forged[1]), dtype=torch.uint8), safe=True) == {
        "__reduce__": ["print", ["this ran"]], "__class__": "os.system"}  # only data
    assert "this ran" not in capsys.readouterr().out

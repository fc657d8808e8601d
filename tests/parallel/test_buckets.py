"""plan_buckets: which parameters share an allreduce (pure arithmetic, no workers)."""

from __future__ import annotations

import math

import torch

from phalanx.parallel.buckets import Bucket, plan_buckets

def _params(*sizes_mb: float, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Tensors of the given sizes in MiB."""
    per_mb = 2**20 // torch.empty(0, dtype=dtype).element_size()
    return [torch.zeros(int(size * per_mb), dtype=dtype) for size in sizes_mb]


def test_zero_is_one_tensor_per_bucket_and_inf_one_bucket() -> None:
    params = _params(0.001, 4, 0.001, 8)
    assert plan_buckets(params, 0) == [[0], [1], [2], [3]]
    assert plan_buckets(params, math.inf) == [[0, 1, 2, 3]]


def test_a_bucket_closes_once_it_reaches_the_threshold_so_a_bias_joins_its_weight() -> None:
    # bias, weight, bias, weight in the order gradients become ready; no separate first bucket
    params = _params(0.001, 4, 0.001, 8)
    assert plan_buckets(params, 2, first_bucket_mb=math.inf) == [[0, 1], [2, 3]]
    assert plan_buckets(params, 16, first_bucket_mb=math.inf) == [[0, 1, 2, 3]]


def test_the_first_bucket_closes_at_one_megabyte_so_communication_starts_early() -> None:
    params = _params(0.25, 0.5, 0.5, 2, 2, 2)
    assert plan_buckets(params, 25) == [[0, 1, 2], [3, 4, 5]]
    assert plan_buckets(params, 25, first_bucket_mb=math.inf) == [[0, 1, 2, 3, 4, 5]]
    assert plan_buckets(params, 0.5, first_bucket_mb=1) == [[0, 1], [2], [3], [4], [5]]


def test_buckets_never_mix_dtypes_and_each_dtype_has_its_own_first_bucket() -> None:
    params = [*_params(0.75, 0.75), *_params(0.75, 0.75, dtype=torch.float64), *_params(0.75)]
    assert plan_buckets(params, 25) == [[0, 1], [2, 3], [4]]


def test_the_trailer_carries_one_flag_per_parameter_and_the_sample_count() -> None:
    params = _params(0.001, 0.002)
    bucket = Bucket.allocate(0, [0, 1], params)
    bucket.used = [True, False]
    bucket.write_trailer(7)
    assert bucket.trailer.tolist() == [1.0, 0.0, 7.0]
    assert bucket.read_trailer() == ([1.0, 0.0], 7.0)
    assert bucket.gradient_numel == sum(p.numel() for p in params)

"""Level 3's gathering, in one process: which blocks are gathered when, and how often a step gathers.

A world of one gathers by copying each block's chunk; what the hooks decide (what to gather, keep and
free) is the same at any world size, and equal gradients show nothing was read freed.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from phalanx.strategies import gathering
from phalanx.strategies.gathering import Gathering, cut

LAYERS = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(LAYERS)))


def _gathering(model: nn.Module, threshold_mb: float = 0.0004) -> Gathering:
    """Blocks of at most 419 bytes: each of _model()'s layers (288 bytes) alone."""
    group_of = {id(p): 0 for p in model.parameters()}
    return Gathering(model, cut(model, threshold_mb=threshold_mb, group_of=group_of))


def _counting_gathers(monkeypatch) -> list[str]:
    started: list[str] = []
    launch = gathering.Block.launch

    def counted(block: gathering.Block, dtype: torch.dtype | None = None) -> None:
        if not block.gathered and not block._in_flight:
            started.append(block.name)
        launch(block, dtype)

    monkeypatch.setattr(gathering.Block, "launch", counted)
    return started


def _trains_as_plain(model: nn.Module, reference: nn.Module, hooks: Gathering, x: torch.Tensor,
                     started: list[str] | None = None) -> None:
    """Two passes of ``model`` (gathered by ``hooks``) and of the plain ``reference``: the same
    gradients each time, and nothing left gathered once a backward ended. ``started``: the gathers
    launched, cleared before each pass (the last pass's are left)."""
    for _ in range(2):
        if started is not None:
            started.clear()
        model.zero_grad()
        reference.zero_grad()
        model(x).square().sum().backward()
        reference(x).square().sum().backward()
        assert not any(block.gathered for block in hooks.blocks)
        for (name, param), plain in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad, plain.grad, msg=name)


def test_a_step_gathers_each_block_for_the_forward_and_all_but_the_last_two_again_for_the_backward(
        monkeypatch) -> None:
    model, reference = _model(), _model()
    hooks = _gathering(model)
    assert [block.name for block in hooks.blocks] == [str(i) for i in range(LAYERS)]
    started = _counting_gathers(monkeypatch)
    x = torch.randn(5, 8)
    for step in range(3):
        started.clear()
        model.zero_grad()
        output = model(x)
        if step > 0:  # the first forward's order known: the last two stay gathered for the backward
            assert [block.gathered for block in hooks.blocks] == [False] * (LAYERS - 2) + [True, True]
        output.square().sum().backward()
        assert not any(block.gathered for block in hooks.blocks)  # freed as the backward ends
        expected_backward = LAYERS if step == 0 else LAYERS - 2
        assert len(started) == LAYERS + expected_backward, started
        reference.zero_grad()
        reference(x).square().sum().backward()
        for (name, param), plain in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad, plain.grad, msg=name)
        hooks.after_step()


def test_a_forward_without_a_backward_keeps_nothing_gathered(monkeypatch) -> None:
    model = _model()
    hooks = _gathering(model)
    x = torch.randn(5, 8)
    model(x).sum().backward()  # the order is known
    hooks.after_step()
    with torch.no_grad():
        model(x)
    assert not any(block.gathered for block in hooks.blocks)


def test_consecutive_small_siblings_share_a_block_and_train_as_the_plain_model(monkeypatch) -> None:
    """A convolution and its batch norm, a run of small layers: one gather for the run, up to the
    threshold; a module over it is cut among its children, its own parameters a block of their own."""
    torch.manual_seed(0)
    big = nn.Linear(8, 32)  # 1152 bytes: over the threshold alone
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), big, nn.Tanh(),
                          nn.Linear(32, 4), nn.BatchNorm1d(4))
    reference = copy.deepcopy(model)
    hooks = _gathering(model, threshold_mb=0.0006)  # 629 bytes: 288 + 64 + 288 would be 640
    assert [block.name for block in hooks.blocks] == ["0 .. 1", "3", "4", "6 .. 7"]
    assert [len(block.modules) for block in hooks.blocks] == [2, 1, 1, 2]
    started = _counting_gathers(monkeypatch)
    still_gathered: list[list[str]] = []  # as block "4"'s weight gets its gradient
    model[4].weight.register_post_accumulate_grad_hook(
        lambda _: still_gathered.append([block.name for block in hooks.blocks if block.gathered]))
    _trains_as_plain(model, reference, hooks, torch.randn(6, 8), started)
    assert started == ["0 .. 1", "3", "4", "6 .. 7", "3", "0 .. 1"]  # the last two kept for the backward
    assert len(still_gathered) == 2 and not any("6 .. 7" in names for names in still_gathered)  # freed once
    # both its modules' gradients were in, not at the backward's end


def test_a_small_block_joins_its_neighbour_and_trains_as_the_plain_model(monkeypatch) -> None:
    """A classifier head after a container of layers (no sibling to share a block with) joins the
    block before it, and a small first block the one after it: a gather and a reduce-scatter fewer."""
    torch.manual_seed(0)
    head_last = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)), nn.Linear(8, 1, bias=False))
    reference = copy.deepcopy(head_last)
    hooks = _gathering(head_last, threshold_mb=0.0005)  # 524 bytes: a layer 288, the head 32
    assert [block.name for block in hooks.blocks] == ["0.0", "0.2 .. 1"]
    started = _counting_gathers(monkeypatch)
    _trains_as_plain(head_last, reference, hooks, torch.randn(6, 8), started)
    assert started == ["0.0", "0.2 .. 1"]  # two blocks, both kept for the backward

    first_small = nn.Sequential(nn.Linear(1, 8, bias=False), nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)))
    assert [block.name for block in _gathering(first_small, threshold_mb=0.0005).blocks] == ["0 .. 1.0", "1.2"]
    # joined, it would hold 572 bytes, over the limit and its sixteenth (557): it stays alone
    too_large = nn.Sequential(nn.Linear(1, 8, bias=False), nn.Sequential(nn.Linear(8, 15), nn.Tanh(), nn.Linear(15, 8)))
    assert [block.name for block in _gathering(too_large, threshold_mb=0.0005).blocks] == ["0", "1.0", "1.2"]


def test_an_attention_larger_than_the_threshold_is_one_block_as_its_forward_reads_its_childs_weight() -> None:
    """nn.MultiheadAttention passes out_proj's weight to F.multi_head_attention_forward without calling
    out_proj: cut below it, out_proj's block was never gathered and the forward failed (storage of size 0)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True),
                          nn.Flatten(), nn.Linear(64, 2))
    reference = copy.deepcopy(model)
    hooks = _gathering(model, threshold_mb=0.001)  # 1048 bytes: the attention holds 4352, the layer 8896
    assert [block.name for block in hooks.blocks] == ["0", "2"]
    x = torch.randn(3, 4, 16)
    _trains_as_plain(model, reference, hooks, x)
    model.eval()
    with torch.no_grad():  # inference: the layer's fast path, where torch takes it, reads every child's weights
        torch.testing.assert_close(model(x), reference.eval()(x))

    class SelfAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = nn.MultiheadAttention(16, 2, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attention(x, x, x, need_weights=False)[0]

    model = nn.Sequential(SelfAttention(), nn.Flatten(), nn.Linear(64, 2))
    reference = copy.deepcopy(model)
    hooks = _gathering(model, threshold_mb=0.001)
    assert [block.name for block in hooks.blocks] == ["0.attention", "2"]
    _trains_as_plain(model, reference, hooks, x)

"""Save and restore the whole training state: model, optimizer, data position, RNG, counters.

``save`` is collective: every rank contributes its random-number state, rank 0 writes (workers of
asynchronous parameter servers, which never wait for one another, do not: rank 0 writes alone). ``restore``
reads on rank 0 and broadcasts, so hosts need no shared file system. A run resumed at another
world size continues the data exactly (the loader's position is global) and re-seeds each rank's
generator from (seed, step, rank), since per-rank streams cannot be redistributed.

An elastic job that fell below its minimum of workers leaves its last commit in
``ELASTIC_LAST`` (written by :class:`px.elastic.State`); ``restore`` takes it when it is newer.

A resume takes the highest step, so a run's first save moves out of the way every checkpoint (and
elastic commit) in the folder past the step it resumed from, all of them for a run started
afresh: they are another run's, and a resume would take them for this one's. They go, with a
warning, into a subfolder ``earlier-run-<time>-<random>``; nothing is deleted but by pruning.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch

from phalanx import faults, tensor_pieces
from phalanx.atomic import save_atomically
from phalanx.comm import collectives, runtime
from phalanx.global_batch import mix_seed
from phalanx.errors import CheckpointError
from phalanx.train import checkpoint_io
from phalanx.train.finite import first_nonfinite
from phalanx.train.state import LoopPosition, TrainState

FORMAT_VERSION = 1
ELASTIC_LAST = "elastic-last.pt"


def save(state: TrainState, directory: str | Path, keep: int = 3) -> None:
    """Write a checkpoint of ``state`` into ``directory`` (collective; rank 0 writes), then keep the
    ``keep`` newest readable ones (see :func:`checkpoint_io.prune`).

    An optimizer that holds only its rank's shard of the training state (``px.Sharded``'s: it has
    ``checkpoint_pieces``) has every rank write its own pieces of the weights and optimizer state
    beside the file (torch.distributed.checkpoint, :mod:`phalanx.tensor_pieces`); nothing is
    gathered. The pieces are complete before rank 0 writes the file, which names them, so a crash
    at any moment leaves the previous checkpoint whole.
    """
    # Workers in lockstep save every rank's generator; asynchronous ones are reseeded on resume.
    rng_states = collectives.allgather_object(torch.get_rng_state()) if state.lockstep else None
    position = LoopPosition(state).state_dict()
    in_pieces = getattr(state.optimizer, "checkpoint_pieces", None)
    weights = state.model.state_dict() if in_pieces is None else None
    nonfinite = first_nonfinite(weights) if weights is not None else state.optimizer.first_nonfinite()
    if nonfinite is not None:  # every rank holds the same weights (or the same answer) and so decides alike
        if runtime.is_master():
            warnings.warn(f"phalanx: not writing the checkpoint of global step {state.global_step}: '{nonfinite}' "
                          "holds NaN or Inf (the run trains on with on_nonfinite='ignore'); the folder keeps the last "
                          "finite checkpoints.", stacklevel=3)
        return
    past, state.checkpointed_step = state.checkpointed_step, state.global_step  # every rank: any may become rank 0
    path = checkpoint_io.checkpoint_path(directory, state.global_step)
    pieces = _write_pieces(in_pieces(), path) if in_pieces is not None else None
    if not runtime.is_master():
        return
    payload = {
        "format": FORMAT_VERSION,
        "model": weights,
        "optimizer": state.optimizer.state_dict() if pieces is None else state.optimizer.hyperparameters(),
        "loader": state.loader.state_dict(),
        "exact": state.exact.state_dict() if state.exact is not None else None,
        "precision": state.precision.state_dict(),
        "lr_schedule": state.rates.state_dict(),
        "rng": rng_states,
        "world_size": runtime.size(),
        **position,
        **(_pieces_entries(state, pieces) if pieces is not None else {}),
    }
    faults.point("checkpoint.write")
    _set_aside_later(Path(directory), -1 if past is None else past)
    if pieces is not None:
        checkpoint_io.put_pieces(pieces, path)
    save_atomically(payload, path, kind=checkpoint_io.KIND)
    checkpoint_io.prune(directory, keep)


def _write_pieces(pieces: dict[str, Any], path: Path) -> Path:
    """Every rank writes its pieces into one new folder beside ``path`` (rank 0 names it); its path."""
    folder = collectives.broadcast_object(str(checkpoint_io.new_pieces_folder(path)) if runtime.is_master() else None,
                                          root=0, safe=True)
    tensor_pieces.save(pieces, Path(folder))
    collectives.barrier()  # every rank's pieces are on disk before rank 0 names them
    return Path(folder)


def _pieces_entries(state: TrainState, folder: Path) -> dict[str, Any]:
    """What rank 0's file says of pieces written beside it: their folder's name, the parameters' shapes,
    the buffers (every rank holds them whole) and the parameters in the optimizer's order."""
    module = state.model.module if hasattr(state.model, "module") else state.model
    names = {id(param): name for name, param in module.named_parameters()}
    return {"pieces": checkpoint_io.pieces_path(checkpoint_io.checkpoint_path(folder.parent, state.global_step)).name,
            "shapes": {name: list(param.shape) for name, param in module.named_parameters()},
            "buffers": {name: buffer.detach().clone() for name, buffer in module.named_buffers()},
            "stepped": [names[id(p)] for group in state.optimizer.param_groups for p in group["params"]]}


def _set_aside_later(directory: Path, past: int) -> None:
    """Move the checkpoints and the elastic commit past step ``past`` into a new subfolder, saying so."""
    later = [path for path in checkpoint_io.list_checkpoints(directory) if checkpoint_io.step_of(path) > past]
    elastic = _elastic_last(directory / ELASTIC_LAST, mmap=True)
    if elastic is not None and elastic[1]["global_step"] > past:
        later.append(elastic[0])
    if not later:
        return
    aside = Path(tempfile.mkdtemp(prefix=f"earlier-run-{time.strftime('%Y%m%d-%H%M%S')}-", dir=directory))
    for path in later:
        os.replace(path, aside / path.name)
        if checkpoint_io.pieces_path(path).exists():
            os.replace(checkpoint_io.pieces_path(path), aside / checkpoint_io.pieces_path(path).name)
    since = "started afresh" if past < 0 else f"resumed from step {past}"
    warnings.warn(f"phalanx: {directory} held checkpoints past this run's (it {since}), which a resume would "
                  f"take for this run's: moved {', '.join(path.name for path in later)} to {aside}.", stacklevel=3)


def restore(state: TrainState, directories: Sequence[str | Path], weights_only: bool = True) -> Path | None:
    """Load the newest readable checkpoint of ``directories`` into ``state`` (the highest step wins);
    return its path (``None`` if there is none)."""
    found = _newest([Path(d) for d in directories], weights_only) if runtime.is_master() else None
    found = collectives.broadcast_object(found, root=0)
    if found is None:
        return None
    path, payload = found
    state.checkpointed_step = payload["global_step"]
    if payload.get("pieces"):
        _restore_pieces(state, path.parent / payload["pieces"], payload)
    else:
        _refuse_nonfinite(path, payload["model"])
        state.model.load_state_dict(payload["model"])
        state.optimizer.load_state_dict(payload["optimizer"])
    state.loader.load_state_dict(payload["loader"])
    LoopPosition(state).load_state_dict(payload)
    if state.exact is not None and payload["exact"] is not None:
        state.exact.load_state_dict(payload["exact"])
    if payload.get("precision") is not None:  # checkpoints before mixed precision hold none
        state.precision.load_state_dict(payload["precision"])
    if payload.get("lr_schedule") is not None:
        state.rates.load_state_dict(payload["lr_schedule"])
    _restore_rng(payload, state)
    return path


def _restore_pieces(state: TrainState, folder: Path, payload: dict[str, Any]) -> None:
    """Weights and optimizer state from pieces: each rank reads its own where the optimizer is sharded
    (at any worker count and level), else every rank reads them whole."""
    module = state.model.module if hasattr(state.model, "module") else state.model
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            buffer.copy_(payload["buffers"][name])
    load_pieces = getattr(state.optimizer, "load_checkpoint_pieces", None)
    if load_pieces is not None:
        load_pieces(folder, payload["optimizer"])
        return
    model_state, optimizer_state = whole_from_pieces(folder, payload)
    state.model.load_state_dict(model_state)
    state.optimizer.load_state_dict(optimizer_state)


def whole_from_pieces(folder: Path, payload: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's state dict and the optimizer's, whole, from a checkpoint written in pieces."""
    tensors = tensor_pieces.read_whole(folder)
    model_state = {name: tensors[f"model/{name}"].view(shape) for name, shape in payload["shapes"].items()}
    model_state.update(payload["buffers"])
    optimizer_state = dict(payload["optimizer"])
    optimizer_state["state"] = {}
    for index, name in enumerate(payload["stepped"]):
        entries = {key.split("/", 2)[2]: value for key, value in tensors.items() if key.startswith(f"optim/{name}/")}
        if entries:
            optimizer_state["state"][index] = {key: value.view(payload["shapes"][name]) if value.dim() == 1 and
                                               value.numel() == math.prod(payload["shapes"][name]) else value
                                               for key, value in entries.items()}
    return model_state, optimizer_state


def checkpoint_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The model's state dict from checkpoint ``path``, whole, in this process alone: for inference,
    or a model trained otherwise (``model.load_state_dict(px.checkpoint_weights(path))``). Reads
    checkpoints of sharded training (their pieces) as well as whole ones."""
    path = Path(path)
    payload = checkpoint_io.load(path)
    if payload.get("pieces"):
        return whole_from_pieces(path.parent / payload["pieces"], payload)[0]
    return payload["model"]


def _refuse_nonfinite(path: Path, weights: dict[str, Any]) -> None:
    """A checkpoint with NaN or Inf weights (written by a run that trained through them) is not resumed."""
    nonfinite = first_nonfinite(weights)
    if nonfinite is not None:
        raise CheckpointError(
            f"{path} holds non-finite weights ('{nonfinite}' has NaN or Inf): the run that wrote it trained through a "
            f"non-finite loss, and resuming would train on them. Move {path.name} (and any newer checkpoint in "
            f"{path.parent}) elsewhere to resume from the newest finite one before it, or give another "
            "checkpoint_dir to start afresh.")


def _newest(directories: Sequence[Path], weights_only: bool) -> tuple[Path, dict[str, Any]] | None:
    """The newest readable checkpoint or elastic commit in ``directories``, with its path."""
    candidates = [found for directory in directories for found in
                  (checkpoint_io.find_latest(directory, weights_only), _elastic_last(directory / ELASTIC_LAST))]
    found = [candidate for candidate in candidates if candidate is not None]
    return max(found, key=lambda candidate: candidate[1]["global_step"], default=None)


def _elastic_last(path: Path, mmap: bool = False) -> tuple[Path, dict[str, Any]] | None:
    """An elastic job's last commit, in the shape of a checkpoint (its RNG states are not kept);
    ``mmap=True`` maps its tensors instead of reading them."""
    if not path.exists():
        return None
    try:
        objects = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)["state"]["objects"]
        return path, {"model": objects["model"], "optimizer": objects["optimizer"], "loader": objects["loader"],
                      "exact": objects.get("exact"), "precision": objects.get("precision"),
                      "lr_schedule": objects.get("lr_schedule"), "rng": None, "world_size": None, **objects["loop"]}
    except Exception as error:  # a damaged file: the regular checkpoints remain
        warnings.warn(f"phalanx: skipping {path}: {CheckpointError(str(error))}", stacklevel=3)
        return None


def _restore_rng(payload: dict[str, Any], state: TrainState) -> None:
    if payload["rng"] is not None and payload["world_size"] == runtime.size():
        torch.set_rng_state(payload["rng"][runtime.rank()])
    else:
        torch.manual_seed(mix_seed(state.seed, state.global_step, runtime.rank()))

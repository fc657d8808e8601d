"""``px.fit`` under Ray: Ray sees its metrics and checkpoints, and resumes it.

Each epoch every rank calls ``ray.train.report`` with the epoch's global metrics (the same values
on every rank, as Ray requires); rank 0 attaches the checkpoint phalanx just wrote, which Ray copies
into its storage (``RunConfig(storage_path=...)``). When Ray restarts the worker group after a
failure, ``ray.train.get_checkpoint()`` hands that checkpoint back and ``px.fit`` resumes from it
like from its own ``checkpoint_dir``. Without a ``checkpoint_dir``, checkpoints are written to a
scratch folder first, so a Ray run is always resumable. In a Ray Tune function trial (one process,
no Ray Train) the same goes through ``ray.tune.report`` and ``ray.tune.get_checkpoint``.

Ray is imported only by a process Ray already runs (``ray.train`` is then loaded): a plain
``px.fit`` pays nothing. See docs/ray.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

from phalanx.comm import runtime
from phalanx.train import checkpoint_io
from phalanx.train.state import TrainState

CHECKPOINT_PREFIX = "phalanx-step-"  # Ray's name for the folder of the checkpoint of a global step

logger = logging.getLogger(__name__)


def reporting_api() -> ModuleType | None:
    """What ``px.fit`` reports through: ``ray.train`` in a Ray Train worker, ``ray.tune`` in a Ray
    Tune function trial (same ``report``/``get_checkpoint``); ``None`` outside Ray."""
    if "ray.train" not in sys.modules:
        return None
    import ray.train

    try:
        ray.train.get_context()
        return ray.train
    except DeprecationWarning:  # Ray's answer in a Tune function: use ray.tune's equivalents
        import ray.tune

        return ray.tune
    except RuntimeError:  # Ray's driver, or another Ray process
        return None


class RaySession:
    """What ``px.fit`` does for Ray in one worker: where checkpoints go, reporting, resuming."""

    def __init__(self, api: ModuleType, checkpoint_dir: str | Path | None):
        self.api = api  # ray.train or ray.tune (reporting_api)
        self._scratch = None if checkpoint_dir is not None else tempfile.mkdtemp(prefix="phalanx-ray-")
        self.checkpoint_dir = Path(checkpoint_dir if checkpoint_dir is not None else self._scratch)

    @classmethod
    def under_ray(cls, checkpoint_dir: str | Path | None) -> RaySession | None:
        """The session of a ``px.fit`` that runs under Ray; ``None`` elsewhere."""
        api = reporting_api()
        return None if api is None else cls(api, checkpoint_dir)

    @contextlib.contextmanager
    def handed_back(self) -> Iterator[Path | None]:
        """The folder of the checkpoint Ray handed back after a restart (``None`` on a first start)."""
        handed = self.api.get_checkpoint()
        if handed is None:
            yield None
            return
        with handed.as_directory() as folder:
            yield Path(folder)

    def callback(self) -> "RayReport":
        """The callback that reports each epoch (it must run after the checkpoint's)."""
        return RayReport(self)

    def close(self) -> None:
        """Remove the scratch folder, if any (Ray keeps its own copies of what was reported)."""
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)


class RayReport:
    """Report each epoch's global metrics to Ray from every rank, with rank 0's newest checkpoint."""

    def __init__(self, session: RaySession):
        self.session = session

    def on_epoch_end(self, epoch: int, logs: dict[str, float], state: TrainState) -> None:
        import ray.train

        api = self.session.api
        metrics: dict[str, Any] = {"epoch": epoch + 1, "global_step": state.global_step, **logs}
        written = checkpoint_io.checkpoint_path(self.session.checkpoint_dir, state.global_step)
        if not runtime.is_master() or not written.exists():
            api.report(metrics)
            return
        named = {"checkpoint_dir_name": f"{CHECKPOINT_PREFIX}{state.global_step:09d}"} if api is ray.train else {}
        with tempfile.TemporaryDirectory(prefix="phalanx-ray-report-") as folder:
            _link_or_copy(written, Path(folder) / written.name)
            api.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder), **named)
        logger.info("reported epoch %d and %s to Ray", epoch + 1, written.name)


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system
        shutil.copy2(source, target)

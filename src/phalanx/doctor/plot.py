"""The predicted scaling curve as a PNG (matplotlib, without a display)."""

from __future__ import annotations

import importlib.util
from collections import defaultdict
from pathlib import Path

from phalanx.atomic import write_atomically
from phalanx.doctor.predict import Prediction


def _series(predictions: list[Prediction]) -> dict[str, list[Prediction]]:
    """One curve per link: this host, the measured link, each given bandwidth."""
    curves: dict[str, list[Prediction]] = defaultdict(list)
    for p in predictions:
        if p.layout.hosts == 1:
            curves["this host"].append(p)
        else:
            link = "measured link" if p.layout.bandwidth_gbit is None else f"{p.layout.bandwidth_gbit:g} Gbit/s"
            curves[f"{p.layout.workers_per_host} per host, {link}"].append(p)
    return curves


def available() -> bool:
    """Whether matplotlib can be imported (it comes with ``pip install 'phalanx[doctor]'``)."""
    return importlib.util.find_spec("matplotlib") is not None


def write(predictions: list[Prediction], path: str | Path, title: str) -> None:
    """Throughput and efficiency against workers, one line per link, into ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, (speed, efficiency) = pyplot.subplots(1, 2, figsize=(11, 4.5))
    for label, curve in _series(predictions).items():
        workers = [p.layout.world_size for p in curve]
        speed.plot(workers, [p.throughput for p in curve], marker="o", label=label)
        efficiency.plot(workers, [100 * p.efficiency for p in curve], marker="o", label=label)
    for axis, name in ((speed, "samples/s"), (efficiency, "scaling efficiency (%)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("workers")
        axis.set_ylabel(name)
        axis.grid(True, alpha=0.3)
    speed.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    write_atomically(path, lambda handle: figure.savefig(handle, format="png", dpi=100))
    pyplot.close(figure)

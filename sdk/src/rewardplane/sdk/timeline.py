"""A push's per-replica timeline as a PNG (``rewardplane push --timeline out.png``): one row per
replica, one bar per phase (``rewardplane.protocol.push_phases``), in ms after the announce reached
that replica, read from each replica's ``last_update`` (``/get_num_background_tasks``).

Drawing needs matplotlib (``pip install 'rewardplane[plot]'``); reading the timelines does not."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rewardplane.protocol import Endpoints
from rewardplane.protocol.errors import RewardplaneError
from rewardplane.protocol.push_phases import PHASES, phase_spans

# one colour per phase, in PHASES order (matplotlib's default cycle, so the legend reads as usual)
_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")


class TimelineUnavailable(RewardplaneError):
    """The timeline cannot be drawn: a replica moved past the push, or matplotlib is missing."""


@dataclass(frozen=True)
class ReplicaTimeline:
    replica: str  # the Pod's name
    version: int
    spans: dict[str, tuple[float, float]]  # phase → (start, end), ms after the announce


def replica_timelines(
    replicas: list[Mapping[str, Any]], version: int, get: Callable[[str], Mapping[str, Any]]
) -> list[ReplicaTimeline]:
    """The timeline of push ``version`` on each of ``replicas`` (a WeightSync's
    ``status.replicas``: ``pod`` and ``url``). ``get(url)``: that replica's
    ``/get_num_background_tasks`` answer. A replica whose last update is another version is
    named in the error: it was pushed again since, or restarted."""
    out = []
    for r in sorted(replicas, key=lambda r: str(r["pod"])):
        last = get(f"{str(r['url']).rstrip('/')}{Endpoints.NUM_BACKGROUND_TASKS}").get("last_update") or {}
        if last.get("version") != version:
            raise TimelineUnavailable(
                f"replica {r['pod']} last loaded version {last.get('version')}, not {version}: "
                "it was pushed again or restarted since"
            )
        out.append(ReplicaTimeline(str(r["pod"]), version, phase_spans(last.get("after_announce_ms") or {})))
    return out


def write_png(path: Path, timelines: list[ReplicaTimeline], title: str) -> None:
    """Draw ``timelines`` (one row each, top to bottom) into ``path``. The PNG's ``Description``
    names the replicas in row order, so a reader (or a test) need not read the picture."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display, whatever the environment says
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise TimelineUnavailable(
            f"drawing needs matplotlib: pip install 'rewardplane[plot]' ({exc})"
        ) from exc

    fig, ax = plt.subplots(figsize=(9, 1.6 + 0.6 * len(timelines)), dpi=100, layout="constrained")
    try:
        for row, t in enumerate(timelines):
            for phase, colour in zip(PHASES, _COLOURS, strict=True):
                if phase in t.spans:
                    start, end = t.spans[phase]
                    # at least a pixel wide: a phase of 0.01 ms still shows where it happened
                    ax.broken_barh(
                        [(start, max(end - start, 0.002 * _span(timelines)))], (row - 0.35, 0.7), color=colour
                    )
        ax.set_yticks(range(len(timelines)), [t.replica for t in timelines])
        ax.invert_yaxis()  # first replica on top
        ax.set_xlabel("ms after the announce reached the replica")
        ax.set_title(title)
        fig.legend(
            handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLOURS],
            labels=list(PHASES),
            loc="outside lower center",
            ncols=len(PHASES),
            fontsize="small",
        )
        ax.grid(axis="x", alpha=0.3)
        replicas = ", ".join(t.replica for t in timelines)
        fig.savefig(path, format="png", metadata={"Title": title, "Description": f"replicas: {replicas}"})
    finally:
        plt.close(fig)


def _span(timelines: list[ReplicaTimeline]) -> float:
    return max((end for t in timelines for _, end in t.spans.values()), default=1.0) or 1.0

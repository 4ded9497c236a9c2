"""PNG plots beside the JSON: the agent suite's wall time per turn with the cache on and off, and
the concurrency suite's aggregate tok/s against the number of clients (medians, min-max bars)."""
from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a server or in CI

import matplotlib.pyplot as plt  # noqa: E402

from glm53.apibench.schema import AgentSuite, ConcurrencySuite, Summary  # noqa: E402


def _bars(summaries: list[Summary]) -> tuple[list[float], list[list[float]]]:
    medians = [s.median for s in summaries]
    return medians, [[m - s.min for m, s in zip(medians, summaries)], [s.max - m for m, s in zip(medians, summaries)]]


def plot_agent(suite: AgentSuite, path: Path, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    turns = [t.turn for t in suite.turns]
    for label, summaries in ((f"cache off ({suite.cache_off.mode})", [t.wall_off_s for t in suite.turns]),
                             ("cache on", [t.wall_on_s for t in suite.turns])):
        medians, err = _bars(summaries)
        ax.errorbar(turns, medians, yerr=err, marker="o", capsize=3, label=label)
    ax.set(xlabel="turn", ylabel="wall time per request (s)", xticks=turns)
    _title(ax, title)
    ax.set_ylim(bottom=0)
    ax.legend()
    return _save(fig, path)


def plot_concurrency(suite: ConcurrencySuite, path: Path, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    clients = [level.clients for level in suite.levels]
    medians, err = _bars([level.aggregate_tok_s for level in suite.levels])
    ax.errorbar(clients, medians, yerr=err, marker="o", capsize=3, label="aggregate")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="clients at once", ylabel="tokens per second, all streams", xticks=clients)
    _title(ax, title)
    ax.set_xticklabels([str(n) for n in clients])
    ax.set_ylim(bottom=0)
    return _save(fig, path)


def _title(ax: plt.Axes, title: str) -> None:
    ax.set_title(textwrap.fill(title, 90), fontsize=9)  # a long --label wraps instead of leaving the figure


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

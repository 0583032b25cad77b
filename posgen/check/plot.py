"""``posgen plot``: the position-only score heatmap per head and the decay curve (PNG).

matplotlib is optional (``pip install 'posgen[plot]'``); ``require_matplotlib`` raises
``MissingMatplotlib`` with an installation hint when it is absent.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from posgen.check.decay import decay_curve, distance_windows, window_means
from posgen.check.probe import Probe
from posgen.check.search import Budget
from posgen.spec.loader import LoadedSpec

HINT = "posgen plot needs matplotlib: pip install 'posgen[plot]' (or 'matplotlib>=3.7')"


class MissingMatplotlib(RuntimeError):
    """matplotlib is not installed."""


class CannotPlot(RuntimeError):
    """The spec's positions cannot be reached through the module contract."""


class PlotFailed(RuntimeError):
    """The module raised while its scores were computed (reported, never a traceback)."""


def require_matplotlib() -> Any:
    """pyplot on the non-interactive Agg backend, or MissingMatplotlib."""
    try:
        import matplotlib
    except ImportError:
        raise MissingMatplotlib(HINT) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _score_title(probe: Probe) -> str:
    """What the heatmap shows, by route."""
    if probe.route == "input":
        return "p_i · p_j / √model_dim (input-level table)"
    if probe.route == "rotation":
        return "q·k with q = k = 1 rotated by position (RoPE picture)"
    return "position-only score (constant content with q · k = 0)"


def plot_spec(
    loaded: LoadedSpec, out_dir: Path, span: int = 64, decay_span: int = 512, seed: int = 0
) -> list[Path]:
    """Write NAME_scores.png and NAME_decay.png into out_dir; return their paths."""
    plt = require_matplotlib()
    out_dir.mkdir(parents=True, exist_ok=True)
    name = loaded.spec.name
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: avoid oversubscription
    try:
        return _plot(plt, loaded, out_dir, name, span, decay_span, seed)
    except CannotPlot:
        raise
    except Exception as error:  # noqa: BLE001 - any failure of the module: a message
        raise PlotFailed(f"cannot plot {name}: {type(error).__name__}: {error}") from None
    finally:
        torch.set_num_threads(threads)


def _plot(
    plt: Any, loaded: LoadedSpec, out_dir: Path, name: str, span: int, decay_span: int, seed: int
) -> list[Path]:
    """Compute the scores and curves, then draw and save both figures."""
    with torch.no_grad():
        probe = Probe(loaded, Budget(seed=seed, span=decay_span))
        if probe.route == "input" and probe.input_mode is None:
            raise CannotPlot(f"cannot plot {name}: {probe.input_note}")
        span = min(span, probe.span)
        scores = probe.score_matrix(span)  # [heads or 1, span, span]
        shared = bool((scores - scores[:1]).abs().max() <= 1e-12 * (1 + scores.abs().max()))
        panels = scores[:1] if shared else scores
        curves = []
        heads = 1 if shared or probe.route == "input" else probe.heads
        for head in range(heads):
            label, curve = decay_curve(probe, head=head)
            curves.append(curve)

    # heatmap per head
    count = panels.shape[0]
    cols = min(4, count)
    rows = math.ceil(count / cols)
    width = 3.6 * cols + 0.8 if count > 1 else 5.2  # one panel: a figure its own size
    fig, axes = plt.subplots(
        rows, cols, figsize=(width, 3.4 * rows + 1.1), squeeze=False, constrained_layout=True
    )
    for index, ax in enumerate(axes.flat):
        if index >= count:
            ax.set_visible(False)
            continue
        image = ax.imshow(
            panels[index].numpy(),
            origin="upper",
            cmap="viridis",
            interpolation="nearest",
            aspect="equal",
        )
        if probe.route == "input":
            panel = "input table (before the heads)"
        else:
            panel = "every head" if shared else f"head {index}"
        ax.set_title(panel, fontsize=10)
        ax.set_xlabel("key position j")
        ax.set_ylabel("query position i")
        fig.colorbar(image, ax=ax, shrink=0.8)
    fig.suptitle(f"{name}: {_score_title(probe)}\npositions 0–{span - 1}", fontsize=11)
    scores_path = out_dir / f"{name}_scores.png"
    fig.savefig(scores_path, dpi=110)
    plt.close(fig)

    # decay curve against distance
    fig, ax = plt.subplots(figsize=(9.5 if len(curves) > 1 else 7.5, 4.5), constrained_layout=True)
    distance = torch.arange(curves[0].shape[0]).numpy()
    windows = distance_windows(curves[0].shape[0])
    centres = [(a + b - 1) / 2 for a, b in windows]
    # a distinct colour per head: tab10 up to 10 heads, then an evenly sampled turbo
    colours = (
        plt.get_cmap("tab10").colors[: len(curves)]
        if len(curves) <= 10
        else [plt.get_cmap("turbo")(x) for x in torch.linspace(0.02, 0.98, len(curves)).tolist()]
    )
    for head, curve in enumerate(curves):
        line_label = (
            f"head {head}"
            if len(curves) > 1
            else ("input table" if probe.route == "input" else "every head")
        )
        colour = colours[head]
        ax.plot(distance, curve.numpy(), linewidth=1.0, alpha=0.8, label=line_label, color=colour)
        ax.plot(
            centres,
            window_means(curve, windows),
            "o",
            color=colour,
            markersize=4,
            markeredgecolor="0.2",
            markeredgewidth=0.4,
        )  # the head's own colour
    ax.plot([], [], "o", color="0.3", markersize=4, label="window means (checked)")
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlabel("distance i − j (keys before the query; symlog scale)")
    ax.set_ylabel(label)
    ax.set_title(f"{name}: {label} against distance")
    ax.grid(True, alpha=0.3)
    # outside the axes, on the right: never over the curves
    ax.legend(
        fontsize=8,
        ncol=2 if len(curves) > 16 else 1,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        borderaxespad=0.0,
    )
    decay_path = out_dir / f"{name}_decay.png"
    fig.savefig(decay_path, dpi=110)
    plt.close(fig)
    return [scores_path, decay_path]

"""``posgen plot``: the position-only score heatmap per head and the decay curve (PNG).

matplotlib is optional (``pip install 'posgen[plot]'``); ``require_matplotlib`` raises
``MissingMatplotlib`` with an installation hint when it is absent.

``render_plots`` returns the PNGs as bytes; the command writes them. Each PNG carries
posgen's mark, a ``Software`` text chunk reading ``posgen plot`` (``PNG_MARK``), so that
``posgen plot`` replaces only PNGs it wrote (``is_posgen_png``).
"""

from __future__ import annotations

import io
import math
import struct
from pathlib import Path
from typing import Any

import torch

from posgen.check.decay import decay_curve, distance_windows, window_means
from posgen.check.probe import Probe
from posgen.check.search import Budget
from posgen.spec.loader import LoadedSpec

HINT = "posgen plot needs matplotlib: pip install 'posgen[plot]' (or 'matplotlib>=3.7')"
PNG_MARK = {"Software": "posgen plot"}  # a tEXt chunk in every PNG posgen plot writes
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_MAX_TEXT_CHUNK = 1 << 16  # a longer text chunk before the image data is not posgen's


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


def plot_files(name: str) -> tuple[str, str]:
    """The file names ``posgen plot`` writes for the spec ``name``: scores, then decay."""
    return f"{name}_scores.png", f"{name}_decay.png"


def is_posgen_png(path: Path) -> bool:
    """Whether the file at ``path`` is a PNG that carries posgen's mark (``PNG_MARK``).

    The text chunks before the image data are read; any file that is not such a PNG, or
    cannot be read, is not posgen's.
    """
    keyword, value = next(iter(PNG_MARK.items()))
    wanted = keyword.encode("latin-1") + b"\0" + value.encode("latin-1")
    try:
        with path.open("rb") as stream:
            if stream.read(len(_PNG_SIGNATURE)) != _PNG_SIGNATURE:
                return False
            return wanted in _text_chunks(stream)
    except OSError:
        return False


def _text_chunks(stream: io.BufferedIOBase) -> list[bytes]:
    """The data of the tEXt chunks of a PNG ``stream`` (past its signature) that come
    before its image data."""
    texts: list[bytes] = []
    while True:
        header = stream.read(8)
        if len(header) < 8:
            return texts
        length, kind = struct.unpack(">I4s", header)
        if kind in (b"IDAT", b"IEND") or length > _MAX_TEXT_CHUNK:
            return texts
        data = stream.read(length + 4)[:length]  # the chunk's data, then its CRC
        if kind == b"tEXt":
            texts.append(data)


def render_plots(
    loaded: LoadedSpec, span: int = 64, decay_span: int = 512, seed: int = 0
) -> dict[str, bytes]:
    """The PNGs of ``plot_files(name)``, file name -> bytes, each with posgen's mark."""
    plt = require_matplotlib()
    name = loaded.spec.name
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: avoid oversubscription
    try:
        return _plot(plt, loaded, name, span, decay_span, seed)
    except CannotPlot:
        raise
    except Exception as error:  # noqa: BLE001 - any failure of the module: a message
        raise PlotFailed(f"cannot plot {name}: {type(error).__name__}: {error}") from None
    finally:
        torch.set_num_threads(threads)


def _png(plt: Any, fig: Any) -> bytes:
    """``fig`` as PNG bytes with posgen's mark; the figure is closed."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, metadata=PNG_MARK)
    plt.close(fig)
    return buffer.getvalue()


def _plot(
    plt: Any, loaded: LoadedSpec, name: str, span: int, decay_span: int, seed: int
) -> dict[str, bytes]:
    """Compute the scores and curves, then draw both figures as PNGs."""
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
    scores_png = _png(plt, fig)

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
    scores_file, decay_file = plot_files(name)
    return {scores_file: scores_png, decay_file: _png(plt, fig)}

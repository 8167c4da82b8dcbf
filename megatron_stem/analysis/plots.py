"""PNG plots of an analysis report (`report.py`). matplotlib is needed only here."""

from __future__ import annotations

from pathlib import Path

from megatron_stem.runtime.errors import UserError


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise UserError("plots need matplotlib (pip install -r requirements.txt)") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    return plt


def _save(fig, ax, path: Path, title: str, xlabel: str, ylabel: str, legend_size: int):
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def plot_spread(report: dict, path: Path) -> Path:
    """|cos| histograms of every layer: STEM rows solid, up-projection outputs dashed
    (the dense baseline's in grey), with the random-Gaussian P95 as a dotted line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    models = [("", report["spread"])]
    if "dense" in report:
        models.append(("dense ", report["dense"]["spread"]))
    gaussian = None
    for prefix, layers in models:
        for layer, s in layers.items():
            bins = len(s["histogram"])
            x = [(i + 0.5) / bins for i in range(bins)]
            stem = s["kind"] == "stem_rows"
            what = "rows" if stem else "W_up x"
            ax.plot(x, s["histogram"], "-" if stem else "--",
                    color=None if not prefix else "grey", alpha=0.9,
                    label=f"{prefix}layer {layer} {what} (P95 {s['p95']:.3f})")
            gaussian = s["gaussian_p95"]
    if gaussian is not None:
        ax.axvline(gaussian, linestyle=":", color="black",
                   label=f"random Gaussian P95 ({gaussian:.3f})")
    return _save(fig, ax, path, "Angular spread", "|cos| between vectors of distinct tokens",
                 "fraction of pairs", legend_size=7)


def plot_capacity(report: dict, path: Path) -> Path:
    """Distinct STEM parameters activated against context length, with the parameters of
    the up-projections STEM replaced (touched by every token of a dense model)."""
    plt = _pyplot()
    c = report["capacity"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(c["lengths"], c["stem_params"], "o-", label="distinct STEM parameters")
    if c["dense_up_params"]:
        ax.axhline(c["dense_up_params"], linestyle="--", color="grey",
                   label="replaced up-projections (dense: every token)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    return _save(fig, ax, path, "Distinct parameters activated by a context",
                 "context length (tokens)", "parameters", legend_size=8)

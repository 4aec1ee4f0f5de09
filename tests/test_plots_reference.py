"""The speedup model's plot compares like with like: only cells measured against base."""

import pandas as pd

from report import plots


def test_predicted_vs_measured_plots_only_cells_paired_with_base(tmp_path, monkeypatch):
    df = pd.DataFrame([
        {"method": "ngram", "status": "ok", "reference": "base", "predicted_speedup": 1.5, "speedup": 1.4},
        {"method": "ngram", "status": "ok", "reference": "mlx_lm", "predicted_speedup": 1.5, "speedup": 9.0},
        {"method": "dflash_a", "status": "ok", "reference": "dflash_zlab", "predicted_speedup": 2.0, "speedup": 0.1},
    ])
    plotted = []
    real = plots.plt.Axes.scatter
    monkeypatch.setattr(plots.plt.Axes, "scatter",
                        lambda ax, x, y, **kw: plotted.extend(zip(list(x), list(y))) or real(ax, x, y, **kw))
    plots.predicted_vs_measured(df, tmp_path / "p.png")
    assert plotted == [(1.5, 1.4)]

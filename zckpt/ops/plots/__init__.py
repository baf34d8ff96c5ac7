"""Pictures of checkpoints: ``diff`` (layer x role heatmaps of the change, top-N bars), ``inspect`` (bytes by
rank x kind, parameters per layer) and a run's series (layer x step heatmap of the update size).

Light on import: nothing is drawn or imported until a figure is (``files.check`` first says what to install
when matplotlib is missing). Modules: ``names`` (layer/role tables), ``grids`` / ``series_grid`` (the figure
data: pure, typed, what the tests check); the diff figure as plain data, ``scene`` / ``diff_scene`` /
``colours`` / ``fonts`` (labels placed by their painted widths), written by ``raster`` (PNG through Pillow)
and ``svg``, without matplotlib; ``draw`` / ``draw_more`` (the inspect and series figures: matplotlib, Agg,
no display); ``files`` (writing ``.png`` / ``.svg`` / self-contained ``.html``).
"""

"""Pictures of checkpoints: ``diff`` (layer x role heatmaps of the change, top-N bars), ``inspect`` (bytes by
rank x kind, parameters per layer) and a run's series (layer x step heatmap of the update size).

Light on import: matplotlib is loaded only when a figure is drawn (``require`` checks for it first and says
what to install). Modules: ``names`` (layer/role tables), ``grids`` / ``series_grid`` (the figure data: pure,
typed, what the tests check), ``draw`` / ``draw_more`` (matplotlib, Agg, no display), ``files`` (writing
``.png`` / ``.svg`` / self-contained ``.html``).
"""

"""course_lib: tested components for the course on fast image-text retrieval.

One module per idea (docs/layout.md): `settings` (smoke switch, device, seeding), `data`
(synthetic benchmark, Karpathy-split loader, tokenizer, datasets), `metrics`, `losses`,
`timing`, `train`, the figures (`viz`, `pareto_plot`, `diagrams`) and the headless commands
(`benchmark`, `real_benchmark`, `refresh_shipped`). Notebooks import from here.
"""

__version__ = "0.1.0"

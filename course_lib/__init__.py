"""course_lib: tested components for the course on fast image-text retrieval (docs/layout.md)."""

__version__ = "0.1.0"

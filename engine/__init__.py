"""qfserve's generation engine: Q-Filters eviction caches for mlx-lm models."""

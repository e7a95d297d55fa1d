"""fairbatch: multi-tenant LLM inference with continuous batching and fair scheduling."""

__version__ = "0.1.0"

"""Shared model parts every family composes: linear layers with pluggable methods, norms,
activations and MLPs, rotary embeddings of every kind transformers uses, and attention."""

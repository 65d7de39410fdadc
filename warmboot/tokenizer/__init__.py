"""Tokenizer loading, incremental detokenization and training of the demo tokenizer."""

from warmboot.tokenizer.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]

"""Tokenizer loading, incremental detokenization and training of the demo tokenizer."""

from warmboot.tokenizer.tokenizer import (
    ByteLevelDetokenizer,
    Detokenizer,
    IncrementalDetokenizer,
    Tokenizer,
)

__all__ = ["ByteLevelDetokenizer", "Detokenizer", "IncrementalDetokenizer", "Tokenizer"]

"""What a multimodal release's language model reads of its other towers when served text only
(``architectures.TEXT_TOWERS``; the towers' own config, ``architectures.TOWER_PARTS``):

- ``HardTokenEmbeddings`` (Gemma 3n): the ids of the vision and audio vocabularies (the
  text vocabulary's last rows) embedded by their tower's embedder, not the text table: the
  tower's row, RMS-normed, projected to the text width, RMS-normed again without a scale;
- ``placeholders_to_pad`` (Gemma 4): the image, video and audio placeholder ids read as the
  pad token (their rows are the towers' outputs, and a text prompt has none)."""

from __future__ import annotations

import torch
from torch import nn

from warmboot.architectures import TOWER_KEY, TOWER_PARTS, UnsupportedModelError
from warmboot.config import ModelConfig
from warmboot.models.layers.altup import Gemma3nRMSNorm
from warmboot.models.layers.linear import Linear

GEMMA3N_VOCABS = {
    # NOTE: transformers' Gemma3nVisionConfig / Gemma3nAudioConfig defaults
    "vision_config": {"vocab_offset": 262_144, "vocab_size": 128, "hidden_size": 2048},
    "audio_config": {"vocab_offset": 262_272, "vocab_size": 128, "hidden_size": 1536},
}
GEMMA4_PLACEHOLDERS = {
    "image_token_id": 258_880,
    "video_token_id": 258_884,
    "audio_token_id": 258_881,
}
"""transformers' Gemma4Config defaults."""


class HardTokenEmbedder(nn.Module):
    """One tower's vocabulary (``size`` ids from ``offset``) into the text width."""

    def __init__(self, offset: int, size: int, width: int, hidden: int, eps: float):
        super().__init__()
        self.offset, self.size = offset, size
        self.embedding = nn.Embedding(size, width)
        self.hard_embedding_norm = Gemma3nRMSNorm(width, eps)
        self.embedding_projection = Linear(width, hidden)
        self.post_norm = Gemma3nRMSNorm(hidden, eps, with_scale=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = (input_ids - self.offset).clamp(0, self.size - 1)
        x = self.hard_embedding_norm(self.embedding(rows))
        return self.post_norm(self.embedding_projection(x))


class HardTokenEmbeddings(nn.Module):
    """Gemma 3n's: ids from the vision offset up to the audio one read the vision embedder,
    ids from the audio offset on the audio one (as transformers' multimodal model)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        parts = cfg.get(TOWER_PARTS) or {}
        towers = {}
        for key, defaults in GEMMA3N_VOCABS.items():
            given = defaults | (parts.get(key) or {})
            offset, size = given["vocab_offset"], given["vocab_size"]
            towers[key] = (offset, size, given["hidden_size"], given.get("rms_norm_eps", 1e-6))
        vision, audio = towers["vision_config"], towers["audio_config"]
        if (
            vision[0] + vision[1] < min(audio[0], cfg.vocab_size)
            or audio[0] + audio[1] < cfg.vocab_size
        ):
            raise UnsupportedModelError(  # NOTE: transformers' lookup fails on the ids left out
                f"Gemma 3n vision_config / audio_config vocabularies ({vision[:2]}, {audio[:2]}) "
                f"do not cover the ids past vocab_offset up to vocab_size {cfg.vocab_size}"
            )
        hidden = cfg.hidden_size
        self.embed_vision = HardTokenEmbedder(*vision[:3], hidden, vision[3])
        self.embed_audio = HardTokenEmbedder(*audio[:3], hidden, audio[3])

    def forward(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x`` (the text embeddings of ``input_ids``) with the towers' ids' rows replaced."""
        start, end = self.embed_vision.offset, self.embed_audio.offset
        vision = ((input_ids >= start) & (input_ids < end))[:, None]
        x = torch.where(vision, self.embed_vision(input_ids).to(x.dtype), x)
        audio = (input_ids >= end)[:, None]
        return torch.where(audio, self.embed_audio(input_ids).to(x.dtype), x)


def hard_token_embeddings(cfg: ModelConfig) -> HardTokenEmbeddings | None:
    """Gemma 3n's ``HardTokenEmbeddings`` where ``cfg`` is a multimodal release's, else None."""
    return HardTokenEmbeddings(cfg) if cfg.get(TOWER_KEY) else None


def placeholders(cfg: ModelConfig) -> tuple[list[int], int] | None:
    """Gemma 4's placeholder ids within the vocabulary and the pad id they read, or None (a
    text-only checkpoint, or none within the vocabulary)."""
    if not cfg.get(TOWER_KEY):
        return None
    parts = GEMMA4_PLACEHOLDERS | (cfg.get(TOWER_PARTS) or {})
    ids = sorted({parts[k] for k in GEMMA4_PLACEHOLDERS if 0 <= parts[k] < cfg.vocab_size})
    if not ids:
        return None
    pad = cfg.get("pad_token_id", 0)
    if not isinstance(pad, int) or not 0 <= pad < cfg.vocab_size:
        raise UnsupportedModelError(
            f"Gemma 4 release with pad_token_id {pad!r} (placeholders read it)"
        )
    return ids, pad


def placeholders_to_pad(
    input_ids: torch.Tensor, found: tuple[list[int], int] | None
) -> torch.Tensor:
    """``input_ids`` with the placeholder ids (``placeholders``) as the pad id."""
    if found is None:
        return input_ids
    ids, pad = found
    hit = input_ids == ids[0]
    for other in ids[1:]:
        hit = hit | (input_ids == other)
    return torch.where(hit, torch.full_like(input_ids, pad), input_ids)

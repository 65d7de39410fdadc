"""``LoRARequest``: which adapter a request runs with, as vLLM's
(``vllm.lora.request.LoRARequest``). Plain data, torch-free."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name: ``lora_path`` is a peft adapter directory
    (``adapter_config.json`` + ``adapter_model.safetensors``); ``lora_int_id`` is vLLM's id
    (>= 1), kept for its callers. The first request naming an adapter loads it; later ones
    with the same name share it."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("LoRARequest: lora_name must not be empty")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(
                f"LoRARequest: lora_int_id must be an int >= 1, got {self.lora_int_id!r}"
            )

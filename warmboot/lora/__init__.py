"""LoRA adapters: peft's on-disk format read into per-module factors (``adapter``)."""

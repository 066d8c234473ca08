"""LoRA adapters applied per row: loading, residency, adapters given as tensors."""

"""Tiny random-weight models in their real folder layouts (``vllm-omni make-tiny-model``), the published
configurations of full-size ones, and the files other loaders read (single files, GGUF, LoRA adapters)."""

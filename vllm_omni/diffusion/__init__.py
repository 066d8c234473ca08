"""One diffusers stage replica: its engine loop (orchestrator/), the pipeline it runs (pipeline/), per-family facts and
steppers (families/), LoRA (lora/), several ranks (parallel/) and the features a call adds (features/)."""

import torch

if not torch.cuda.is_available():
    import diffusers.utils.import_utils

    # diffusers imports flashinfer (the FP4 kernels of its BFL quantizer) whenever the package is installed, as it is
    # beside vLLM's CUDA wheel: 2 s of CPU in every server, Ray actor and worker process on a host with no GPU, where
    # none of its kernels can run. Told it is absent before its first model import, diffusers skips it.
    diffusers.utils.import_utils._flashinfer_available = False

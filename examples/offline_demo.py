"""Generate four images in one batch with the embedded tiny demo model (CPU is fine).

    python examples/offline_demo.py [--out demo-output] [--family flux|sd]

The model is a tiny random-weight pipeline written offline by
`vllm_omni.testing.tiny_models`, so the images are coloured noise: what the demo
shows is the serving path (config resolution, batching, per-request seeds).
"""

import argparse
import os

from vllm_omni import Omni, OmniDiffusionSamplingParams
from vllm_omni.testing.tiny_models import make_tiny_model

PROMPTS = ["a photo of a cat", "a red car", "an astronaut riding a horse on the moon", "a blue house"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="demo-output", help="where to write the PNG files")
    parser.add_argument("--family", default="flux", choices=["flux", "sd"])
    parser.add_argument("--model-dir", default=".tiny-models", help="where the tiny model is built (once)")
    args = parser.parse_args()

    model = os.path.join(args.model_dir, args.family)
    if not os.path.isfile(os.path.join(model, "model_index.json")):
        make_tiny_model(model, args.family)
    os.makedirs(args.out, exist_ok=True)

    params = OmniDiffusionSamplingParams(height=64, width=64, num_inference_steps=4, seed=0)
    with Omni(model=model, max_num_seqs=4, request_batch_max_wait_ms=50) as omni:
        stage = omni.stage_configs[0]
        print(f"max_num_seqs={stage.max_num_seqs} (from {stage.provenance['max_num_seqs']})")
        for i, output in enumerate(omni.generate(PROMPTS, params)):
            path = os.path.join(args.out, f"image-{i}.png")
            output.images[0].save(path)
            print(
                f"{path}: {output.prompt!r} batch_size={output.metrics['batch_size']} "
                f"exec_ms={output.metrics['exec_ms']:.0f} seed={output.metrics['seed']}"
            )


if __name__ == "__main__":
    main()

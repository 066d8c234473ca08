"""Serve the embedded tiny demo model with `vllm serve ... --omni` and save one image generated through the API.

    python examples/serve_demo.py [--out demo-output] [--family flux|sd] [--keep-serving]

The model is a tiny random-weight pipeline written offline by
`vllm_omni.testing.models.tiny_models`, so the image is coloured noise: the demo shows
the serving path (CLI, OpenAI Images API, batching metrics), not a trained model.
"""

import argparse
import base64
import contextlib
import os
import re

import httpx
import openai

from vllm_omni.testing.models.tiny import make_tiny_model
from vllm_omni.testing.processes.server import RemoteOmniServer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="demo-output", help="where to write the PNG file")
    parser.add_argument("--family", default="flux", choices=["flux", "sd"])
    parser.add_argument("--model-dir", default=".tiny-models", help="where the tiny model is built (once)")
    parser.add_argument("--keep-serving", action="store_true", help="leave the server running until Ctrl+C")
    args = parser.parse_args()

    model = os.path.join(args.model_dir, args.family)
    if not os.path.isfile(os.path.join(model, "model_index.json")):
        make_tiny_model(model, args.family)
    os.makedirs(args.out, exist_ok=True)

    server_args = ["--max-num-seqs", "4", "--request-batch-max-wait-ms", "50", "--served-model-name", "tiny-demo"]
    print(f"Starting: vllm serve {model} --omni {' '.join(server_args)}")
    with RemoteOmniServer(model, server_args, log_path=os.path.join(args.out, "server.log")) as server:
        client = openai.OpenAI(base_url=server.url_for("v1"), api_key="unused")
        response = client.images.generate(
            model="tiny-demo",
            prompt="an astronaut riding a horse on the moon",
            size="64x64",
            response_format="b64_json",
            extra_body={"num_inference_steps": 4, "seed": 0},
        )
        path = os.path.join(args.out, "image.png")
        with open(path, "wb") as f:
            f.write(base64.b64decode(response.data[0].b64_json))
        print(f"Generated through {server.url_for('v1', 'images', 'generations')} -> {path}")
        metrics = httpx.get(server.url_for("metrics")).text
        for line in metrics.splitlines():
            if re.match(r"vllm_omni:(stage_max_num_seqs|batch_num_requests_count)", line):
                print("  " + line)
        if args.keep_serving:
            print(f"Serving at {server.base_url} (server log: {server.log_path}); Ctrl+C to stop")
            with contextlib.suppress(KeyboardInterrupt):
                server.process.wait()
    print(f"Server stopped (exit code {server.returncode})")


if __name__ == "__main__":
    main()

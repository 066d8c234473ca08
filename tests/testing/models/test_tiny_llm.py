"""The tiny LLM of an llm stage: ``vllm-omni make-tiny-model DIR --family llm`` writes a transformers folder that
loads offline, with a byte-level BPE tokenizer that round-trips any text and the documented chat template."""

import contextlib
import io
import os

import pytest

from vllm_omni.entrypoints.cli.main import main
from vllm_omni.testing.models.tiny_llm import CHAT_TEMPLATE

# The folder is written once, by the CLI's main in this process (the console script around it, a fresh interpreter,
# is tests/entrypoints/cli/test_make_tiny_model.py's).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm_folder(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("cli") / "tiny-llm")
    with contextlib.redirect_stdout(io.StringIO()) as out:
        main(["make-tiny-model", folder, "--family", "llm"])
    assert out.getvalue().strip().splitlines()[-1] == folder  # it prints the folder it wrote
    return folder


@pytest.fixture(scope="module")
def tokenizer(llm_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llm_folder, local_files_only=True)


@pytest.fixture(scope="module")
def model(llm_folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llm_folder, local_files_only=True).eval()


def test_the_folder_is_a_transformers_llama_with_its_tokenizer(llm_folder):
    files = set(os.listdir(llm_folder))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    assert "model_index.json" not in files  # not a diffusers pipeline


def test_the_tokenizer_has_llamas_special_tokens(tokenizer):
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token) == ("<s>", "</s>", "<unk>")


@pytest.mark.parametrize(
    "text",
    [
        "a photo of a cat riding a horse",
        "café ☕",
        "日本語 🐱 ümlaut, naïve façade",
        "  leading and trailing spaces\tand a tab\nand a newline  ",
        "{braces} <angle> 'quotes' \"double\" \\ back\\slash",
        "\x00\x01\x7f control bytes",
        "",
    ],
)
def test_the_tokenizer_round_trips_text_byte_for_byte(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.unk_token_id not in ids  # byte-level: every byte has a token
    decoded = tokenizer.decode(ids)
    assert decoded.encode("utf-8") == text.encode("utf-8")


def test_the_tokenizer_merges_its_training_words(tokenizer):
    """A BPE trained on words: a common word is fewer tokens than its bytes."""
    text = "a photo of a cat"
    assert len(tokenizer(text, add_special_tokens=False).input_ids) < len(text.encode("utf-8"))


def test_the_chat_template_frames_each_message_and_the_assistants_turn(tokenizer):
    messages = [{"role": "system", "content": "Be vivid."}, {"role": "user", "content": "a café ☕"}]
    assert tokenizer.chat_template == CHAT_TEMPLATE
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<s><|system|>Be vivid.\n<|user|>a café ☕\n<|assistant|>"
    without = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert without == "<s><|system|>Be vivid.\n<|user|>a café ☕\n"


def test_the_chat_templates_token_ids_start_with_one_bos(tokenizer):
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "a cat"}], add_generation_prompt=True, tokenize=True
    )
    ids = list(getattr(ids, "input_ids", ids))
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(ids) == "<s><|user|>a cat\n<|assistant|>"


def test_the_model_is_a_small_float32_llama_over_the_tokenizers_vocabulary(model, tokenizer):
    import torch

    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.dtype == torch.float32
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.hidden_size // model.config.num_attention_heads == 32  # vLLM's CPU kernels' smallest head
    assert (model.config.bos_token_id, model.config.eos_token_id) == (tokenizer.bos_token_id, tokenizer.eos_token_id)


def test_greedy_generation_runs_and_repeats(model, tokenizer):
    import torch

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "a cat"}], add_generation_prompt=True, tokenize=False
    )
    inputs = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")
    generate = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    with torch.no_grad():
        first = model.generate(**inputs, **generate)
        second = model.generate(**inputs, **generate)
    prompt_len = inputs.input_ids.shape[1]
    assert first.shape == (1, prompt_len + 4)
    assert torch.equal(first[0, :prompt_len], inputs.input_ids[0])
    assert torch.equal(first, second)  # greedy: the same continuation every time
    assert isinstance(tokenizer.decode(first[0, prompt_len:], skip_special_tokens=True), str)


def test_make_tiny_model_refuses_lora_adapters_for_the_llm_naming_the_flag(tmp_path, capsys):
    folder = tmp_path / "llm"
    with pytest.raises(SystemExit) as info:
        main(["make-tiny-model", str(folder), "--family", "llm", "--lora", "1"])
    assert info.value.code == 2
    assert (
        "vllm-omni make-tiny-model: error: argument --lora: the adapters are for diffusers pipelines; family 'llm' "
        "takes none"
    ) in capsys.readouterr().err
    assert not folder.exists()  # refused before writing anything

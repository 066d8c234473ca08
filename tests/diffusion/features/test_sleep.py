"""`PipelineSleep`: level 2 drops every stored tensor to ``meta`` (same shape and dtype) and wake-up reloads from the
model's files only what is still ``meta``; levels and tags as vLLM's. On small modules here, then on the tiny
pipelines of every family (bitwise, tied weights, LoRA layers)."""

import copy
import weakref

import pytest
import torch
from safetensors.torch import save_file

from vllm_omni.diffusion.features.sleep import PipelineSleep, check_level, check_tags

CPU = torch.device("cpu")


class _Pipeline:
    def __init__(self, **components):
        self.components = components


class _Block(torch.nn.Module):
    """Tied weights (saved once, as transformers does), a persistent and a non-persistent buffer."""

    original = None

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)
        self.b.weight = self.a.weight
        self.register_buffer("stats", torch.randn(4))
        self.register_buffer("rope", torch.randn(4), persistent=False)

    @classmethod
    def from_pretrained(cls, folder, **kwargs):  # what a component class's loader gives: the model as saved
        return copy.deepcopy(cls.original)


def _model(tmp_path, leave_out=()) -> tuple[_Block, str]:
    """A block and a model folder holding it as ``block/model.safetensors`` (without the keys ``leave_out``)."""
    torch.manual_seed(0)
    block = _Block()
    _Block.original = copy.deepcopy(block)
    state = {k: v for k, v in block.state_dict().items() if k != "b.weight" and k not in leave_out}
    (tmp_path / "block").mkdir()
    save_file(state, str(tmp_path / "block" / "model.safetensors"))
    return block, str(tmp_path)


def _snapshot(module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def _equal(module, snapshot) -> bool:
    state = module.state_dict()
    return state.keys() == snapshot.keys() and all(torch.equal(state[k], snapshot[k]) for k in snapshot)


def test_levels_and_tags_are_vllms_and_others_are_refused_naming_the_allowed_values():
    assert [check_level(level) for level in (0, 1, 2)] == [0, 1, 2]
    for bad in (3, -1, "1", 1.0, True, None):
        with pytest.raises(ValueError, match=r"level must be one of 0, 1, 2; got"):
            check_level(bad)
    with pytest.raises(ValueError, match="cpu_offload='sequential'"):
        check_level(2, "sequential")
    assert check_level(2, "model") == 2
    with pytest.raises(ValueError, match=r"the GGUF denoiser \(quantization 'gguf'\) has none.*: use level 1"):
        check_level(2, "none", "gguf")
    assert check_level(1, "none", "gguf") == 1
    assert check_tags(None) is None and check_tags(["weights", "kv_cache"]) == ["weights", "kv_cache"]
    assert check_tags("weights") == ["weights"]
    with pytest.raises(ValueError, match="tags must be among weights, kv_cache, scheduling; got 'gpu'"):
        check_tags(["weights", "gpu"])


def test_level_2_drops_every_stored_tensor_to_meta_and_wake_up_restores_it_in_place(tmp_path):
    block, model = _model(tmp_path)
    before, params = _snapshot(block), {name: id(p) for name, p in block.named_parameters()}
    rope = block.rope.clone()
    sleep = PipelineSleep(_Pipeline(block=block, tokenizer=object()), model, CPU)
    sleep.sleep(2)
    assert all(t.is_meta for t in block.state_dict().values())
    assert block.a.weight.shape == (4, 4) and block.a.weight.dtype == torch.float32
    assert not block.rope.is_meta and torch.equal(block.rope, rope)  # in no file: kept
    assert block.b.weight is block.a.weight  # still tied
    assert sleep.asleep == {"weights", "kv_cache"} and sleep.level == 2
    assert sleep.wake_up(None)
    assert _equal(block, before) and sleep.level is None and not sleep.asleep
    assert {name: id(p) for name, p in block.named_parameters()} == params  # the same objects, refilled
    assert block.b.weight is block.a.weight


def test_wake_up_reads_only_what_is_still_meta(tmp_path):
    """A tensor set while asleep (as update_weights materialises one) is not read from the files again."""
    block, model = _model(tmp_path)
    before = _snapshot(block)
    sleep = PipelineSleep(_Pipeline(block=block), model, CPU)
    sleep.sleep(2)
    torch.utils.swap_tensors(block.a.weight, torch.nn.Parameter(torch.ones(4, 4)))
    sleep.wake_up(None)
    assert torch.equal(block.a.weight, torch.ones(4, 4)) and torch.equal(block.b.weight, torch.ones(4, 4))
    assert torch.equal(block.a.bias, before["a.bias"]) and torch.equal(block.stats, before["stats"])


def test_what_the_files_lack_comes_from_the_components_from_pretrained(tmp_path):
    block, model = _model(tmp_path, leave_out=("stats",))
    before = _snapshot(block)
    sleep = PipelineSleep(_Pipeline(block=block), model, CPU)
    sleep.sleep(2)
    sleep.wake_up(None)
    assert _equal(block, before)


def test_a_tensor_in_neither_the_files_nor_the_model_fails_wake_up_naming_it(tmp_path):
    block, model = _model(tmp_path, leave_out=("stats",))
    _Block.original = torch.nn.Module()  # a model without it
    sleep = PipelineSleep(_Pipeline(block=block), model, CPU)
    sleep.sleep(2)
    with pytest.raises(RuntimeError, match=r"block\.stats is in neither .*'s files nor its model"):
        sleep.wake_up(None)


def test_a_tensor_torch_cannot_swap_is_replaced_in_every_module_that_holds_it(tmp_path):
    block, model = _model(tmp_path)
    before = _snapshot(block)
    held = weakref.ref(block.a.weight)  # swap_tensors refuses a tensor with a weak reference
    sleep = PipelineSleep(_Pipeline(block=block), model, CPU)
    sleep.sleep(2)
    assert block.a.weight.is_meta and block.b.weight is block.a.weight
    assert held() is None  # no module holds the old one: freed
    sleep.wake_up(None)
    assert _equal(block, before) and block.b.weight is block.a.weight


def test_a_gguf_parameter_moved_in_place_stays_one_with_its_quantization_type():
    """Level 1 moves a GGUF denoiser's weights (diffusers' ``GGUFParameter``: bytes and a ``quant_type``) as they
    are (their __torch_function__ keeps the subclass through the move); a plain ``Parameter`` would hand the layer raw
    bytes. The move itself, here CPU to CPU."""
    import gguf
    from diffusers.quantizers.gguf.utils import GGUFLinear, GGUFParameter

    from vllm_omni.diffusion.features.sleep import _tensors

    torch.manual_seed(0)
    weight = torch.randn(4, 64)
    packed = torch.from_numpy(gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q8_0))
    layer = GGUFLinear(64, 4, bias=False, compute_dtype=torch.float32)
    layer.weight = GGUFParameter(packed, quant_type=gguf.GGMLQuantizationType.Q8_0)
    x = torch.randn(2, 64)
    before = layer(x)
    entry = _tensors(layer)["weight"]
    entry.replace(entry.tensor.to("cpu", copy=True))
    assert isinstance(layer.weight, GGUFParameter) and layer.weight.quant_type == gguf.GGMLQuantizationType.Q8_0
    assert torch.equal(layer(x), before)


def test_lora_adapter_tensors_stay_and_a_wrapped_layer_reloads_from_its_own_key(tmp_path):
    """PEFT wraps an adapted layer as ``base_layer`` and keeps its adapters in ``adapter_layer_names``."""

    class Adapted(torch.nn.Module):
        adapter_layer_names = ("lora_A",)

        def __init__(self, base):
            super().__init__()
            self.base_layer, self.lora_A = base, torch.nn.ModuleDict({"style": torch.nn.Linear(4, 2)})

    block, model = _model(tmp_path)
    before = _snapshot(block)
    block.a = Adapted(block.a)
    block.b.weight = block.a.base_layer.weight
    adapter = block.a.lora_A["style"].weight.clone()
    sleep = PipelineSleep(_Pipeline(block=block), model, CPU)
    sleep.sleep(2)
    assert block.a.base_layer.weight.is_meta and not block.a.lora_A["style"].weight.is_meta
    sleep.wake_up(None)
    assert torch.equal(block.a.base_layer.weight, before["a.weight"]) and torch.equal(block.b.bias, before["b.bias"])
    assert torch.equal(block.a.lora_A["style"].weight, adapter)


def test_a_layer_wrapped_while_asleep_still_reloads(tmp_path):
    """A LoRA load wraps a layer as ``base_layer`` (PEFT): its dropped weight is found by its name in the files."""

    class Wrapped(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base_layer = base

    block, model = _model(tmp_path)
    before = _snapshot(block)
    sleep = PipelineSleep(_Pipeline(block=block), model, CPU)
    sleep.sleep(2)
    assert sleep.dropped
    block.b = Wrapped(block.b)
    sleep.wake_up(None)
    assert not sleep.dropped
    assert torch.equal(block.b.base_layer.bias, before["b.bias"]) and torch.equal(block.a.weight, before["a.weight"])


def test_deeper_sleep_goes_deeper_a_shallower_one_changes_nothing_and_tags_wake_in_parts(tmp_path):
    block, model = _model(tmp_path)
    before = _snapshot(block)
    sleep = PipelineSleep(_Pipeline(block=block), model, CPU)
    sleep.sleep(0)
    assert sleep.level == 0 and not sleep.asleep and not block.a.weight.is_meta
    assert sleep.wake_up(["weights"])  # no memory sleeps at level 0: awake
    sleep.sleep(1)  # a CPU stage: the weights are in CPU memory already
    assert sleep.level == 1 and not block.a.weight.is_meta
    sleep.sleep(2)
    assert block.a.weight.is_meta
    sleep.sleep(1)
    assert sleep.level == 2 and block.a.weight.is_meta
    assert not sleep.wake_up(["weights"])  # kv_cache still sleeps, as on vLLM
    assert _equal(block, before)
    assert not sleep.wake_up(["scheduling"])
    assert sleep.wake_up(["kv_cache"]) and sleep.level is None
    assert sleep.wake_up(None) and _equal(block, before)  # awake already: harmless


@pytest.mark.slow
@pytest.mark.parametrize("family", ["tiny_flux", "tiny_sd", "tiny_sdxl", "tiny_sd3", "tiny_wan", "tiny_qwen_edit"])
def test_every_tensor_of_a_real_pipeline_comes_back_bitwise(request, family):
    from vllm_omni.diffusion.pipeline.runner import load_pipeline

    model = request.getfixturevalue(family)
    pipeline = load_pipeline(model, torch.float32, CPU)
    sleep = PipelineSleep(pipeline, model, CPU)
    before = {name: _snapshot(module) for name, module in sleep.components().items()}
    sleep.sleep(2)
    for module in sleep.components().values():
        stored = module.state_dict()
        assert all(t.is_meta for t in stored.values())
    sleep.wake_up(None)
    for name, module in sleep.components().items():
        assert _equal(module, before[name]), name


@pytest.mark.slow
def test_a_pipeline_with_a_lora_adapter_keeps_it_and_reloads_its_base_weights(tiny_sd, tmp_path):
    from vllm_omni.diffusion.lora.adapters import LoraAdapters
    from vllm_omni.diffusion.pipeline.runner import load_pipeline
    from vllm_omni.testing.models.lora import write_random_lora

    pipeline = load_pipeline(tiny_sd, torch.float32, CPU)
    LoraAdapters(pipeline, max_loras=1, max_lora_rank=16).load(
        "style", write_random_lora(tiny_sd, str(tmp_path / "lora"), text_encoder=True)
    )
    sleep = PipelineSleep(pipeline, tiny_sd, CPU)
    before = {name: _snapshot(module) for name, module in sleep.components().items()}
    sleep.sleep(2)
    unet = pipeline.unet.state_dict()
    assert any(".base_layer." in name and t.is_meta for name, t in unet.items())
    assert all(not t.is_meta for name, t in unet.items() if "lora_" in name)
    sleep.wake_up(None)
    for name, module in sleep.components().items():
        assert _equal(module, before[name]), name

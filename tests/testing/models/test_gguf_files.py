"""``write_gguf``: a tiny denoiser as a GGUF file in the original key layout (as city96's), quantized by the ``gguf``
package; diffusers' GGUF loader reads back exactly what the package itself dequantizes."""

import os

import pytest
import torch

from vllm_omni.testing.models.gguf_files import GGUF_ARCHITECTURES, dequantized, gguf_types, tensor_type, write_gguf
from vllm_omni.testing.models.single_file import flux_converter_for_any_width

CLASSES = {"flux": "FluxTransformer2DModel", "sd3": "SD3Transformer2DModel", "wan": "WanTransformer3DModel"}
CASES = [(family, qtype) for family in CLASSES for qtype in ("Q8_0", "Q4_0")]
PLAIN = ("F32", "F16")


@pytest.fixture(scope="module")
def files(request, tmp_path_factory) -> dict[tuple[str, str], tuple[str, str]]:
    """(family, type) -> (its tiny folder, its GGUF)."""
    out = tmp_path_factory.mktemp("gguf")
    folders = {family: request.getfixturevalue(f"tiny_{family}") for family in CLASSES}
    return {
        (family, qtype): (
            folders[family],
            write_gguf(folders[family], family, str(out / f"{family}-{qtype}.gguf"), qtype),
        )
        for family, qtype in CASES
    }


def _load(folder: str, family: str, path: str | None = None):
    import diffusers

    cls = getattr(diffusers, CLASSES[family])
    if path is None:
        return cls.from_pretrained(folder, subfolder="transformer", local_files_only=True)
    config = diffusers.GGUFQuantizationConfig(compute_dtype=torch.float32)
    with flux_converter_for_any_width():  # the tiny Flux is narrower than FLUX.1 (see testing.single_file)
        return cls.from_single_file(
            path,
            config=folder,
            subfolder="transformer",
            torch_dtype=torch.float32,
            quantization_config=config,
            local_files_only=True,
        )


@pytest.mark.parametrize(("family", "qtype"), CASES)
def test_diffusers_dequantizes_what_the_gguf_package_dequantizes(files, family, qtype):
    """diffusers dequantizes in float16 (each block's float16 scale times its integers, rounded once), the gguf package
    in float32 (exact): the two agree once the package's values are rounded to float16, on every weight."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES
    from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor

    folder, path = files[(family, qtype)]
    types = gguf_types(path)
    packaged = {k: v if types[k] in PLAIN else v.half().float() for k, v in dequantized(path).items()}
    with flux_converter_for_any_width():
        convert = SINGLE_FILE_LOADABLE_CLASSES[CLASSES[family]]["checkpoint_mapping_fn"]
        want = convert(checkpoint=packaged, config=_load(folder, family).config)
    loaded = _load(folder, family, path).state_dict()
    assert loaded.keys() == want.keys()
    assert not [k for k, v in loaded.items() if v.is_meta], "weights missing from the file"
    quantized = [k for k, v in loaded.items() if isinstance(v, GGUFParameter)]
    assert quantized, "nothing loaded quantized"
    got = {k: dequantize_gguf_tensor(v).float() if k in quantized else v for k, v in loaded.items()}
    differ = [k for k in want if not torch.equal(got[k], want[k].reshape(got[k].shape))]
    assert not differ, f"{len(differ)} weights differ from the gguf package's, e.g. {differ[:3]}"


@pytest.mark.parametrize(("family", "qtype"), CASES)
def test_every_weight_matrix_is_quantized_where_its_rows_fit_the_blocks(files, family, qtype):
    from gguf import GGUFReader

    folder, path = files[(family, qtype)]
    reader = GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == GGUF_ARCHITECTURES[family]
    for tensor in reader.tensors:
        shape = tuple(reversed(tensor.shape.tolist()))
        planned = tensor_type(tensor.name, torch.empty(shape, device="meta"), qtype).name
        fits = shape[-1] % 32 == 0  # Q8_0 and Q4_0 quantize blocks of 32 values along a row
        want = planned if planned == "F32" or fits else "F16"
        assert tensor.tensor_type.name == want, tensor.name
    assert qtype in gguf_types(path).values()


@pytest.mark.parametrize(("family", "qtype"), CASES)
def test_the_quantized_denoiser_holds_fewer_bytes(files, family, qtype):
    from diffusers.quantizers.gguf.utils import GGUFParameter
    from gguf import GGUFReader

    folder, path = files[(family, qtype)]
    full = sum(p.numel() * p.element_size() for p in _load(folder, family).parameters())
    loaded = _load(folder, family, path)
    held = sum(p.numel() * p.element_size() for p in loaded.parameters())
    packed = sum(p.numel() for p in loaded.parameters() if isinstance(p, GGUFParameter))  # uint8 blocks
    in_file = sum(int(t.n_bytes) for t in GGUFReader(path).tensors if t.tensor_type.name not in PLAIN)
    kept_fp32 = family == "wan"  # diffusers dequantizes Wan's time embedder (_keep_in_fp32_modules)
    assert packed == in_file if not kept_fp32 else packed < in_file
    assert held < full


def test_q8_0_stays_within_its_quantization_error(files):
    folder, path = files[("flux", "Q8_0")]
    types = gguf_types(path)
    from vllm_omni.testing.models.single_file import SINGLE_FILE_FAMILIES

    original = SINGLE_FILE_FAMILIES["flux"](folder)
    for name, values in dequantized(path).items():
        if types[name] == "Q8_0":
            blocks = original[name].reshape(-1, 32)
            assert (values.reshape(-1, 32) - blocks).abs().max() <= blocks.abs().max() / 127 + 1e-6, name


def test_a_family_without_a_denoiser_layout_and_an_unknown_type_are_refused(tiny_sd, tiny_flux, tmp_path):
    with pytest.raises(ValueError, match="no GGUF layout for family 'sd'"):
        write_gguf(tiny_sd, "sd", str(tmp_path / "sd.gguf"))
    with pytest.raises(ValueError, match="GGUF type 'Q2_K': choose one of Q8_0, Q4_0"):
        write_gguf(tiny_flux, "flux", str(tmp_path / "flux.gguf"), "Q2_K")
    assert not os.listdir(tmp_path)

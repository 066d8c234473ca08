"""``vllm serve MODEL --quantization MODE``: vLLM's own flag (and ``-q``) takes our values, ``--quantize-components``
is the Omni group's; a bad value fails naming the flag before loading; a server started with it says in its log what
it quantized, and exports the knob in ``vllm_omni:stage_knob_info``."""

import re
from pathlib import Path

import httpx
import pytest

from vllm_omni.entrypoints.cli.serve import build_serve_config, make_serve_parser, parse_serve_args
from vllm_omni.testing.processes.server import RemoteOmniServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def parser():
    return make_serve_parser("vllm serve")


def _stage(parser, argv):
    args, explicit = parse_serve_args(parser, argv)
    return build_serve_config(parser, args, explicit)[1][0]


def test_vllms_quantization_flag_takes_our_values_with_cli_provenance(parser, tiny_flux):
    stage = _stage(parser, [tiny_flux, "--quantization", "int8", "--quantize-components", "transformer,text_encoder_2"])
    assert (stage.quantization, stage.quantize_components) == ("int8", ("transformer", "text_encoder_2"))
    assert stage.provenance["quantization"] == stage.provenance["quantize_components"] == "cli"
    assert "quantization='int8' (cli)" in stage.describe()
    assert _stage(parser, [tiny_flux, "-q", "fp8_storage"]).quantization == "fp8_storage"
    assert _stage(parser, [tiny_flux]).provenance["quantization"] == "default"
    assert "--quantization" in parser.format_help().split("Diffusion serving (vllm-omni).")[1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--quantization", "awq"], r"--quantization 'awq': Input should be 'none', 'int8', 'fp8', 'fp8_storage'"),
        (["--quantization", "gguf"], r"--quantization 'gguf' \(cli\) is what a .gguf model file sets"),
        (["--quantize-components", "transformer"], r"chooses what quantization quantizes, but quantization is 'none'"),
    ],
)
def test_a_bad_value_fails_naming_the_flag(parser, tiny_flux, capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        _stage(parser, [tiny_flux, *argv])
    assert info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_server_reports_what_it_quantized(tiny_flux):
    with RemoteOmniServer(tiny_flux, ["--quantization", "int8"]) as server:
        text = httpx.get(server.url_for("metrics")).text
        log = Path(server.log_path).read_text()
    assert 'vllm_omni:stage_knob_info{knob="quantization",source="cli",stage="0",value="int8"} 1.0' in text
    assert "quantization='int8' (cli)" in log
    assert "quantized: transformer torchao int8 weight-only" in log

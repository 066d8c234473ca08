"""examples/rl/flow_grpo_tiny.py: two Flow-GRPO iterations on the tiny SD3, in this process (its ``main``)."""

import importlib.util
import json
import pathlib

import pytest

pytestmark = pytest.mark.slow

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "rl" / "flow_grpo_tiny.py"


@pytest.fixture
def example():
    """The example's module; torch's thread count put back afterwards (its engine thread sets its own)."""
    import torch

    spec = importlib.util.spec_from_file_location("flow_grpo_tiny", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    yield module
    torch.set_num_threads(threads)


@pytest.mark.parametrize("mode", ["request", "step"])
def test_two_iterations_match_the_engine_and_sync_weights(example, tiny_sd3, tmp_path, mode):
    argv = ["--iterations", "2", "--group-size", "2", "--steps", "4", "--model", tiny_sd3]
    assert example.main([*argv, "--out-dir", str(tmp_path), "--execution-mode", mode]) == 0

    result = json.loads((tmp_path / "flow_grpo.json").read_text())
    first, second = result["iterations"]
    assert result["execution_mode"] == mode and result["max_mismatch"] <= 1e-5
    for it in (first, second):
        # 2 prompts x 2 seeds x a window of 2 steps; the trainer's log-probs equal the engine's
        assert it["transitions"] == 8 and it["mismatch"] <= 1e-5
        assert all(0 <= value <= 1 for value in (it["reward_mean"], it["reward_std"]))
        assert it["weight_sync_s"] >= 0 and it["weight_mb"] > 0
    assert second["weights_version"] > first["weights_version"]  # the second iteration ran the updated weights
    assert (tmp_path / "flow_grpo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

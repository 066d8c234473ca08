"""How the modular stepper makes many requests' denoiser calls one forward: which calls can share one, and how
their arguments are put together."""

import inspect

import torch

from vllm_omni.diffusion.families.steppers.denoiser_calls import DenoiserCalls, batched, concat_rows, joined


def _call(rows: int, text: int, **extra):
    return {"hidden_states": torch.ones(rows, 4, 8), "encoder_hidden_states": torch.ones(rows, text, 8), **extra}


def test_calls_with_the_same_trailing_shapes_and_equal_shared_arguments_share_a_forward():
    ids = torch.arange(6).view(3, 2)
    calls = [
        _call(1, 5, img_ids=ids, img_shapes=[(1, 2, 2)]),
        _call(2, 5, img_ids=ids, img_shapes=[(1, 2, 2)] * 2),
        _call(1, 7, img_ids=ids, img_shapes=[(1, 2, 2)]),  # another text length
        _call(1, 5, img_ids=ids + 1, img_shapes=[(1, 2, 2)]),  # other position ids
        _call(1, 5, img_ids=ids, img_shapes=[(1, 2, 2)], return_dict=True),  # other arguments
    ]
    assert batched(calls, "hidden_states") == [[0, 1], [2], [3], [4]]
    counts = [1, 2]
    assert concat_rows([calls[0]["hidden_states"], calls[1]["hidden_states"]], counts).shape == (3, 4, 8)
    assert concat_rows([calls[0]["img_shapes"], calls[1]["img_shapes"]], counts) == [(1, 2, 2)] * 3
    assert concat_rows([ids, ids], counts) is ids


def test_a_list_input_of_rows_of_any_length_shares_a_forward():
    """Z-Image's denoiser takes lists: one tensor per row, any text length."""
    calls = [{"x": [torch.ones(4, 1, 2, 2)], "cap_feats": [torch.ones(n, 8)]} for n in (3, 9)]
    assert batched(calls, "x") == [[0, 1]]
    assert [len(f) for f in concat_rows([c["cap_feats"] for c in calls], [1, 1])] == [3, 9]


def test_the_stand_in_records_then_answers_in_order():
    stand_in = DenoiserCalls(torch.nn.Linear(2, 2), "hidden_states")
    (zeros,) = stand_in(hidden_states=torch.ones(2, 3), timestep=torch.zeros(2))
    assert torch.equal(zeros, torch.zeros(2, 3)) and len(stand_in.calls) == 1
    assert stand_in.in_features == 2  # the denoiser's own attributes
    stand_in.answers = [torch.full((2, 3), 5.0)]
    (answer,) = stand_in(hidden_states=torch.ones(2, 3), timestep=torch.zeros(2))
    assert answer.eq(5).all() and stand_in.answers == []


def test_the_stand_in_answers_each_call_at_once_where_told():
    stand_in = DenoiserCalls(torch.nn.Linear(2, 2), "hidden_states")
    stand_in.answer = lambda call: call["hidden_states"] * 2
    (answer,) = stand_in(hidden_states=torch.ones(2, 3))
    assert answer.eq(2).all() and len(stand_in.calls) == 1


def test_the_stand_ins_forward_has_the_denoisers_signature_and_is_recorded():
    """Blocks read the denoiser's parameters from its forward's signature (Qwen-Image's loop, at every step)."""
    linear = torch.nn.Linear(2, 2)
    stand_in = DenoiserCalls(linear, "input")
    assert inspect.signature(stand_in.forward) == inspect.signature(linear.forward)
    (zeros,) = stand_in.forward(torch.ones(1, 2))
    assert zeros.shape == (1, 2) and list(stand_in.calls[0]) == ["input"]


def test_masked_text_of_other_lengths_is_padded_and_masked_out():
    """Qwen-Image's text embeddings come with a mask: rows of other lengths share a forward, zero-padded to the
    longest with the padding masked out, as the stock pipeline pads a batch of prompts."""
    calls = [
        {
            "hidden_states": torch.ones(1, 4, 8),
            "encoder_hidden_states": torch.ones(1, n, 8),
            "encoder_hidden_states_mask": torch.ones(1, n, dtype=torch.long),
        }
        for n in (3, 5)
    ]
    assert batched(calls, "hidden_states") == [[0, 1]]
    kwargs = joined(calls, [1, 1])
    assert kwargs["encoder_hidden_states"].shape == (2, 5, 8)
    assert kwargs["encoder_hidden_states_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert kwargs["encoder_hidden_states"][0, 3:].abs().sum() == 0

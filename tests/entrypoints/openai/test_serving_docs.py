"""docs/serving.md's request-field tables are generated from the request models of protocol.py, and current."""

import pytest

from vllm_omni.entrypoints.openai import docs
from vllm_omni.entrypoints.openai.protocol import (
    AudioGenerationRequest,
    ImageEditRequest,
    ImageGenerationRequest,
    VideoGenerationRequest,
)


def test_the_request_field_tables_in_the_docs_are_current():
    assert docs.main(["--check"]) == 0, "run: python -m vllm_omni.entrypoints.openai.docs"


@pytest.mark.parametrize(
    ("model", "prompt"),
    [(ImageGenerationRequest, "prompt"), (VideoGenerationRequest, "prompt"), (AudioGenerationRequest, "input")],
)
def test_every_field_has_one_row_with_its_docstring(model, prompt):
    rows = docs.fields_table(model).splitlines()[2:]
    assert sorted(row.split("`")[1] for row in rows) == sorted(model.model_fields)
    assert rows[0].split("`")[1] == prompt  # its own fields first, the shared extensions (RolloutFields) last
    for name, info in model.model_fields.items():
        assert info.description, f"{model.__name__}.{name} needs a docstring: it is its row and its OpenAPI text"


def test_the_edit_table_has_the_fields_the_edit_declares_and_names_the_others():
    *own, others = docs.edit_fields_table().splitlines()[2:]
    assert [row.split("`")[1] for row in own] == ["size", "strength", "input_fidelity", "markup"]
    assert "0.6 for image-to-image" in own[1]
    assert others.endswith("| | | As for generations. |")
    assert others.count("`") // 2 == len(ImageEditRequest.model_fields) - 4


def test_a_stale_table_is_refused(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "serving.md"
    fresh = docs.DOC.read_text()
    row = "| `n` | integer, >= 1, <= 10 | `1` |"
    assert row in fresh
    stale.write_text(fresh.replace(row, "| `n` | integer | `1` |"))
    monkeypatch.setattr(docs, "DOC", stale)
    assert docs.main(["--check"]) == 1
    assert "stale" in capsys.readouterr().err
    assert docs.main([]) == 0 and docs.main(["--check"]) == 0
    assert stale.read_text() == fresh

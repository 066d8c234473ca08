"""docs/configuration.md's stage-key table is generated from the declarations in config/stage.py, and current."""

from vllm_omni.config import docs
from vllm_omni.config.stage import KNOBS, YAML_STAGE_KEYS


def test_the_stage_key_table_in_the_docs_is_current():
    assert docs.main(["--check"]) == 0, "run: python -m vllm_omni.config.docs"


def test_every_stage_key_has_one_row_with_its_flag():
    rows = [line for line in docs.stage_key_table().splitlines()[2:]]
    assert [row.split("`")[1] for row in rows] == list(YAML_STAGE_KEYS)
    for row in rows:
        name = row.split("`")[1]
        knob = KNOBS.get(name)
        flag = "--" + name.replace("_", "-")
        assert (flag in row) == (knob is not None and knob.flag != "none"), row


def test_a_stale_table_is_refused(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text(docs.DOC.read_text().replace("| `max_num_seqs` | int, >= 1 | `1`", "| `max_num_seqs` | int | `4`"))
    monkeypatch.setattr(docs, "DOC", stale)
    assert docs.main(["--check"]) == 1
    assert "stale" in capsys.readouterr().err
    assert docs.main([]) == 0 and docs.main(["--check"]) == 0

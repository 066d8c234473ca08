"""docs/models.md's family table is what the code serves each tiny family's pipeline with, and current."""

from vllm_omni.testing.checks import family_table


def test_the_family_table_in_the_docs_is_current():
    assert family_table.main(["--check"]) == 0, "run: python -m vllm_omni.testing.checks.family_table"


def test_a_stale_table_is_refused(tmp_path, monkeypatch, capsys):
    text = family_table.DOC.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `WanImageToVideoPipeline` |"))
    stale = tmp_path / "models.md"
    stale.write_text(text.replace(row, row.replace("no (", "Y (", 1)))  # step mode claimed where there is no stepper
    monkeypatch.setattr(family_table, "DOC", stale)
    monkeypatch.setattr(
        family_table, "family_table", lambda: text.split(family_table.BEGIN + "\n")[1].split(family_table.END)[0]
    )  # the table just checked above: no second run of the families
    assert family_table.main(["--check"]) == 1
    assert "stale" in capsys.readouterr().err
    assert family_table.main([]) == 0 and family_table.main(["--check"]) == 0
    assert row in stale.read_text()

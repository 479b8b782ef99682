"""The results pages are generated from the result files (``python -m bench report``)."""

import json
import shutil

import pytest

from bench import common, report


def test_committed_pages_are_what_the_result_files_give():
    page, readme = report.build()
    assert report.PAGE.read_text() == page, "docs/results.md is stale: python -m bench report"
    assert report.README.read_text() == readme, "README.md is stale: python -m bench report"


def test_every_result_names_its_command_commit_machine_and_date():
    results = report.load()
    assert {r.machine for r in results} >= {"nvidia-h200"}
    assert [p for r in results for p in report.problems(r)] == []


def test_readme_lines_are_read_from_the_files(tmp_path):
    """Change a figure in a copy of the results: the README line follows it."""
    folder = tmp_path / "results"
    shutil.copytree(common.RESULTS, folder)
    path = folder / report.INTEL / "train-unshaped.json"
    data = json.loads(path.read_text())
    report.pick(data["rows"], variant="bits=8")["fewer_bytes"] = 2.54
    path.write_text(json.dumps(data))
    page, readme = report.build(folder)
    assert "**2.5x fewer bytes** sent for FSDP2 at 8 bits" in readme
    assert "| fsdp2 | bits=8 |" in page and "| 2.54x |" in page
    assert "**2.5x fewer bytes**" not in report.README.read_text()

    path.unlink()
    with pytest.raises(LookupError, match="train-unshaped.json, which is gone"):
        report.build(folder)


def test_a_result_without_provenance_is_refused(tmp_path):
    src = common.RESULTS / "nvidia-h200" / "memory.json"
    data = json.loads(src.read_text())
    data["header"]["versions"]["qcomm_git"] = "abc123-dirty"
    del data["header"]["command"]
    (tmp_path / "nvidia-h200").mkdir()
    (tmp_path / "nvidia-h200" / "memory.json").write_text(json.dumps(data))
    (tmp_path / "cpu-elsewhere").mkdir()
    (tmp_path / "cpu-elsewhere" / "memory.json").write_text(json.dumps(
        {"header": json.loads(src.read_text())["header"], "columns": [], "rows": [{}]}))
    found = [p for r in report.load(tmp_path) for p in report.problems(r)]
    assert found == ["cpu-elsewhere/memory.json: the header's machine is nvidia-h200",
                     "nvidia-h200/memory.json: header has no command",
                     "nvidia-h200/memory.json: made by a dirty tree that no diff hash names "
                     "(abc123-dirty)"]
    with pytest.raises(ValueError, match="cannot be reported"):
        report.build(tmp_path, readme_text="")

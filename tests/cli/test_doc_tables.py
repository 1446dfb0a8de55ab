"""tools/doc_tables.py: every generated table of README.md and docs/*.md is what its JSON under
docs/data/ gives, a hand edit is caught by ``--check`` and undone by ``--write``, and a demo
run's summary.json becomes the README's table in one command."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("doc_tables", REPO / "tools" / "doc_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def copy(tmp_path) -> Path:
    """The pages and their data, in a temporary root the tool may rewrite."""
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    (tmp_path / "docs").mkdir()
    for page in (REPO / "docs").glob("*.md"):
        shutil.copy(page, tmp_path / "docs" / page.name)
    shutil.copytree(REPO / "docs" / "data", tmp_path / "docs" / "data")
    return tmp_path


def test_pages_are_what_their_json_gives(tool):
    assert tool.regenerate(REPO, write=False) == []


def test_every_json_is_used_and_records_its_provenance(tool):
    used = {m["name"] for page in tool.pages(REPO) for m in tool.MARKER.finditer(page.read_text())}
    data = {p.stem for p in (REPO / "docs" / "data").glob("*.json")}
    assert used == data and {"demo_depth", "depth_600", "depth_3000", "recipe_cost"} <= used
    for name in data:
        prov = json.loads((REPO / "docs" / "data" / f"{name}.json").read_text())["provenance"]
        assert {"command", "commit", "date", "machine"} <= set(prov), name
        assert prov["command"].startswith("ode-lm "), name


def test_an_edited_table_fails_check_and_write_restores_it(tool, copy, capsys):
    page = copy / "docs" / "depth.md"
    text = page.read_text()
    start = text.index("<!-- table:depth_600 -->")
    own = re.compile(r"\*\*[\d.,]+\*\*")  # the first run's own-N figure, whatever it is
    edited = text[:start] + own.sub("**1.0**", text[start:], count=1)
    assert edited != text
    page.write_text(edited)
    assert tool.main(["--check", "--root", str(copy)]) == 1
    err = capsys.readouterr().err
    assert "docs/depth.md: table depth_600 differs" in err and "README.md" not in err
    assert tool.main(["--write", "--root", str(copy)]) == 0
    assert page.read_text() == text
    assert tool.main(["--check", "--root", str(copy)]) == 0


def test_a_demo_runs_summary_becomes_the_readme_table(tool, copy, tmp_path, capsys):
    """``ode-lm train``'s summary.json, taken with ``--from-demo``, gives the README the very
    table the run printed, and its provenance line."""
    from ode_lm.commands import train
    from ode_lm.models.solve import Solve
    from ode_lm.training.trainer import TrainResult

    run = tmp_path / "run"
    run.mkdir()
    result = TrainResult(
        model_dir=str(run), step=600, first_loss=7.0, last_loss=4.0,
        eval={"eval/loss": 4.5, "eval/perplexity": 90.0, "eval/tokens": 20480.0,
              "eval/perplexity@steps=2": 99.0, "eval/depth_gap/steps=2": 0.1,
              "eval/perplexity@adaptive:rtol=0.001": 91.8, "eval/nfe@adaptive:rtol=0.001": 40.0,
              "eval/depth_gap/adaptive:rtol=0.001": 0.02},
        eval_settings={"": Solve("euler", 6), "@steps=2": Solve("euler", 2),
                       "@adaptive:rtol=0.001": Solve("adaptive", rtol=1e-3)})
    assert train.report(result) == 0
    printed = capsys.readouterr().out
    table = printed[printed.index("one set of weights"):].rstrip("\n")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["provenance"]["machine"]["cores"] >= 1 and summary["steps"] == 600

    assert tool.main(["--from-demo", str(run), "--root", str(copy)]) == 0
    readme = (copy / "README.md").read_text()
    assert f"```text\n{table}\n```" in readme
    assert "table demo_depth" in capsys.readouterr().out
    assert tool.main(["--check", "--root", str(copy)]) == 0
    with pytest.raises(ValueError, match="not an `ode-lm train` summary.json"):
        tool.from_demo(copy / "docs" / "data" / "depth_600.json", copy)


def test_provenance_names_the_command_commit_date_and_machine():
    from ode_lm.provenance import provenance

    prov = provenance(["bench", "--config", "tiny"])
    assert prov["command"] == "ode-lm bench --config tiny"
    assert prov["date"].endswith("Z") and prov["machine"]["cpu"]
    assert prov["machine"]["cores"] >= 1
    assert prov["commit"] is None or len(prov["commit"].split("+")[0]) == 40


@pytest.mark.parametrize("corpus", ["builtin", "fortunes"])
def test_the_claims_page_holds_every_claim_with_its_threshold(corpus):
    """docs/claims.md's tables come from `ode-lm reproduce`'s JSON, which holds every claim
    of the suite with the threshold the code fixes, one value per seed and a verdict."""
    from ode_lm.claims import suite
    from ode_lm.claims.verdict import VERDICTS, Threshold, judge

    data = json.loads((REPO / "docs" / "data" / f"claims_{corpus}.json").read_text())
    rows = {c["id"]: c for c in data["claims"]}
    page = (REPO / "docs" / "claims.md").read_text()
    assert f"<!-- table:claims_{corpus} -->" in page
    for claim in suite.CLAIMS:
        if claim.id not in rows:
            continue  # a corpus may run a subset: the page says which
        row = rows[claim.id]
        assert Threshold(**row["threshold"]) == claim.threshold, claim.id
        assert len(row["values"]) == len(row["seeds"]) == len(data["seeds"]) >= 3
        assert row["verdict"] in VERDICTS
        assert judge(row["values"], claim.threshold).verdict == row["verdict"], claim.id
    if corpus == "builtin":
        assert set(rows) == {c.id for c in suite.CLAIMS}  # the built-in corpus runs them all

"""scripts/multi30k_recipe_report.py: the recipe's results file is written from the run, not typed."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCORES = {"bleu": 36.5, "bleu_signature": "s", "chrf": 62.0, "chrf_signature": "c", "paper_bleu": 37.0}


def _fake_run(run, epochs, status="finished", options=None):
    run.mkdir()
    entries = [
        {
            "epoch": e,
            "optimizer_steps": 145 * e,
            "seconds": 70.0 + e,
            "loss": 5.0 / e,
            "token_accuracy": 0.1 * e,
            "val_loss": 5.5 / e,
            "val_token_accuracy": 0.1 * e,
            "val_bleu": 10.0 * e if e % 2 == 0 else None,
        }
        for e in range(1, epochs + 1)
    ]
    metrics = {"epochs": entries, "parameters": 2349056, "averaged": [epochs - 1, epochs], "status": status}
    (run / "metrics.json").write_text(json.dumps(metrics))
    model = dict(num_layers=3, num_decoder_layers=3, d_model=128, num_heads=4, d_ff=256, dropout_rate=0.3)
    settings = {"model": {**model, "vocab_size": 8000, "pad_id": 0}, "options": options or {}}
    (run / "run.json").write_text(json.dumps(settings))
    # evaluate_multi30k_run.sh's candidates, and a run's file from before beam sizes were candidates
    candidates = [
        ("eval-val-beam8-alpha1.0", 8, 1.0),
        ("eval-val-beam5-alpha0.6", 5, 0.6),
        ("eval-val-alpha1.0", 5, 1.0),
    ]
    for name, beam, alpha in candidates + [("eval-multi30k-val", 5, 1.0)]:
        evaluation = {**SCORES, "bleu": 35.0, "beam_size": beam, "length_penalty": alpha}
        (run / f"{name}.json").write_text(json.dumps(evaluation))
    (run / "eval-multi30k-test.json").write_text(
        json.dumps({**SCORES, "beam_size": 5, "length_penalty": 1.0})
    )


def _report(run, results, tmp_path, asked, commit):
    command = [
        sys.executable,
        str(ROOT / "scripts" / "multi30k_recipe_report.py"),
        str(run),
        "--epochs",
        str(asked),
        "--max-minutes",
        "300",
        "--seconds",
        "0",
        "3000",
        "3600",
        "--commit",
        commit,
        "--json",
        str(results),
        "--curve",
        str(tmp_path / "curve.png"),
    ]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def test_the_report_records_the_run_and_keeps_one_entry_per_machine_epochs_and_commit(tmp_path):
    results = tmp_path / "recipe.json"
    _fake_run(tmp_path / "full", 4)
    printed = _report(tmp_path / "full", results, tmp_path, asked=4, commit="aaa")
    entry = json.loads((tmp_path / "full" / "results.json").read_text())
    assert entry["epochs"] == entry["epochs_asked"] == 4 and entry["cut_by_max_minutes"] is False
    assert entry["seconds_per_epoch"] == {"median": 72.5, "min": 71.0, "max": 74.0}
    assert entry["minutes"]["total"] == 60.0 and entry["minutes"]["training"] == 50.0
    assert entry["test2016"]["bleu"] == 36.5 and entry["val"]["bleu"] == 35.0
    assert (entry["beam_size"], entry["length_penalty"]) == (5, 1.0)  # as evaluate recorded them
    assert list(entry["val_candidates"]) == ["beam 5, α 0.6", "beam 5, α 1.0", "beam 8, α 1.0"]
    assert [point["val_bleu"] for point in entry["curve"]] == [None, 20.0, None, 40.0]
    assert entry["machine"]["commit"] == "aaa" and entry["machine"]["cpu"]
    assert entry["model"]["num_layers"] == 3 and "pad_id" not in entry["model"]  # from run.json
    assert "test2016: BLEU 36.50" in printed and (tmp_path / "curve.png").stat().st_size > 0

    _fake_run(tmp_path / "cut", 3)  # the safety limit stopped it after 3 of 5 epochs
    _report(tmp_path / "cut", results, tmp_path, asked=5, commit="aaa")
    _report(tmp_path / "cut", results, tmp_path, asked=5, commit="aaa")  # the same run again: replaced
    runs = json.loads(results.read_text())["runs"]
    assert [(run["epochs_asked"], run["epochs"], run["cut_by_max_minutes"]) for run in runs] == [
        (4, 4, False),
        (5, 3, True),
    ]


def test_the_table_has_one_row_per_run_and_says_when_the_limit_cut_it(tmp_path, import_script):
    report = import_script("multi30k_recipe_report")
    results = tmp_path / "recipe.json"
    _fake_run(tmp_path / "cut", 3)
    _report(tmp_path / "cut", results, tmp_path, asked=5, commit="bbb")
    table = report.table(json.loads(results.read_text())["runs"]).splitlines()
    assert table[0].startswith("| epochs (updates) |") and len(table) == 3
    model = "3+3 layers, d_model 128, d_ff 256, dropout 0.3, BPE 8000"
    assert f"| 5, cut at 3 by --max-minutes (435) | {model} |" in table[2]
    assert "**36.50**" in table[2] and "| 35.00 (beam 5, α 1.0) |" in table[2]
    # A run trained with --cooldown says so in its row (run.json's options).
    _fake_run(tmp_path / "cooled", 4, options={"cooldown": 0.2, "epochs": 4})
    _report(tmp_path / "cooled", results, tmp_path, asked=4, commit="ccc")
    assert json.loads((tmp_path / "cooled" / "results.json").read_text())["cooldown"] == 0.2
    rows = report.table(json.loads(results.read_text())["runs"]).splitlines()
    assert f"| 4 (580) | {model}, learning-rate cooldown 0.2 |" in rows[2]
    assert rows[3].startswith("| 5, cut at 3") and "cooldown" not in rows[3]
    document = tmp_path / "README.md"
    document.write_text(f"before\n{report.BEGIN}\nold table\n{report.END}\nafter\n")
    report.replace_table(document, "\n".join(table))
    assert document.read_text() == f"before\n{report.BEGIN}\n" + "\n".join(table) + f"\n{report.END}\nafter\n"


def test_an_ensemble_run_is_reported_with_its_members(tmp_path, import_script):
    """`reproduce_multi30k.sh` with MEMBERS=2: the models train in RUN/member-*, the evaluation's
    files are in RUN; the row says it is an ensemble, every member's epochs count."""
    report = import_script("multi30k_recipe_report")
    run, results = tmp_path / "ensemble", tmp_path / "recipe.json"
    _fake_run(run, 2)
    for member in (0, 1):  # member 1 was cut after 3 of 4 epochs, and trained at label smoothing 0.2
        _fake_run(run / f"member-{member}", 4 - member, options={"label_smoothing": 0.1 * (member + 1)})
    for name in ("metrics.json", "run.json"):
        (run / name).unlink()  # an ensemble's run directory has no model of its own
    alone = {**SCORES, "bleu": 34.0, "beam_size": 8, "length_penalty": 1.0, "model": "m0/averaged.keras"}
    (run / "member-0" / "eval-multi30k-val.json").write_text(json.dumps(alone))
    ensemble = {**alone, "model": ["m0/averaged.keras", "m1/averaged.keras"]}  # not a member's own
    (run / "member-1" / "eval-multi30k-val.json").write_text(json.dumps(ensemble))
    _report(run, results, tmp_path, asked=4, commit="ccc")
    entry = json.loads((run / "results.json").read_text())
    assert entry["members"] == 2 and entry["epochs"] == 3 and entry["cut_by_max_minutes"] is True
    assert entry["seconds_per_epoch"] == {"median": 72.0, "min": 71.0, "max": 74.0}  # 7 epochs
    assert len(entry["curve"]) == 4 and [len(curve) for curve in entry["member_curves"]] == [3]
    assert list(entry["member_val"]) == ["member-0"] and entry["member_val"]["member-0"]["bleu"] == 34.0
    assert entry["seconds"] == [0, 3000, 3600]
    row = report.table(json.loads(results.read_text())["runs"]).splitlines()[2]
    assert "| ensemble of 2: 3+3 layers, d_model 128" in row and "**36.50**" in row
    assert entry["label_smoothing"] == [0.1, 0.2] and ", BPE 8000, label smoothing 0.1 / 0.2 |" in row

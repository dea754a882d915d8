"""scripts/ablate_multi30k.py: the docs' ablation tables are generated from the measured rows."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ablate(import_script):
    return import_script("ablate_multi30k")


def _row(name, bleu, losses, beside):
    return {
        "variant": name,
        "optimizer_steps": 145 * len(losses),
        "seconds_per_epoch": 120.4,
        "val_loss_by_epoch": [[145 * (e + 1), loss] for e, loss in enumerate(losses)],
        "val_bleu": bleu,
        "val_chrf": 60.0,
        "val_paper_bleu": None,
        "ran_beside": beside,
    }


def test_ablation_table_puts_the_recipe_first_with_each_change_against_it(ablate):
    losses = [5.0 - 0.1 * e for e in range(30)]
    results = {
        "epochs": 30,
        "rows": [
            _row("3+3, dropout 0.2", 36.75, [loss - 0.05 for loss in losses], "mini 3+3 (the recipe)"),
            _row("mini 3+3 (the recipe)", 35.5, losses, "3+3, dropout 0.2"),
        ],
    }
    lines = ablate.ablation_table(results).splitlines()
    assert "val loss at 10 / 20 / 30 epochs" in lines[0] and len(lines) == 4
    cells = [line.split(" | ") for line in lines[2:]]
    assert cells[0][0] == "| **mini 3+3 (the recipe)**" and cells[0][5] == ""  # the reference: no delta
    assert cells[1][0] == "| 3+3, dropout 0.2" and cells[1][5] == "+1.25"
    assert cells[1][3] == "4.050 / 3.050 / 2.050"  # epochs 10, 20 and 30 (1-based)
    assert cells[1][2] == "120 (mini 3+3 (the recipe))" and cells[1][-1] == "– |"  # no paper metric recorded


def test_decoding_table_and_the_markers_it_is_written_between(ablate, tmp_path):
    import harness

    results = {
        "epochs": 30,
        "rows": [],
        "decoding": [
            {
                "run": "runs/multi30k",
                "epochs": 85,
                "averaged_last": 10,
                "beam_size": 5,
                "length_penalty": 0.6,
                "val_bleu": 38.45,
                "val_chrf": 64.0,
                "val_paper_bleu": 38.8,
                "evaluate_seconds": 61.2,
            }
        ],
    }
    table = ablate.decoding_table(results)
    assert table.splitlines()[2] == "| multi30k (85 epochs) | 10 | 5 | 0.6 | 38.45 | 64.00 | 38.80 | 61 |"
    document = tmp_path / "results.md"
    begin, end = ablate.DECODING_TABLE
    document.write_text(f"text\n{begin}\nold\n{end}\nmore\n")
    harness.replace_between(document, begin, end, table)
    assert document.read_text() == f"text\n{begin}\n{table}\n{end}\nmore\n"
    document.write_text("no markers\n")
    with pytest.raises(SystemExit, match="markers .* are missing"):
        harness.replace_between(document, begin, end, table)


def test_the_ablation_reference_trains_what_the_recipe_script_trains(ablate):
    """The reference row's settings are `reproduce_multi30k.sh`'s (written in two places, so pinned)."""
    script = (ROOT / "scripts" / "reproduce_multi30k.sh").read_text()
    train = script[script.index('"$BIN/keras-transformer" train') :].split("\n\n")[0].replace("\\\n", " ")
    words = train.split()
    reference = ablate.VARIANTS[ablate.REFERENCE]
    assert reference == ablate.RECIPE
    for flag, value in zip(reference[::2], reference[1::2]):
        pairs = [(words[i], words[i + 1]) for i in range(len(words) - 1) if words[i] == flag]
        assert (flag, value) in pairs, f"{flag} {value} is not in the recipe script's train command"

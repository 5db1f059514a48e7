"""Edit datasets (data.edits, flowrl/train/edit_data.py): JSONL and parquet rows become EditPrompts
with their sources and references; every bad row (a reference of another size than its source among them)
is one sentence naming it, and the CLI exits 2 on it;
a family that generates from text alone refuses an edit dataset."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from flowrl.cli import main
from flowrl.config import load_config
from flowrl.errors import ConfigError, UserError
from flowrl.models.edit_prompt import EditPrompt
from flowrl.train.edit_data import read_edits


def _png(path=None, colour=(255, 0, 0), size=8):
    image = Image.fromarray(np.full((size, size, 3), colour, np.uint8))
    if path is None:
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return buffer.getvalue()
    image.save(path)
    return path


def _jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_and_parquet_rows_become_edits_with_their_sources(tmp_path):
    (tmp_path / "images").mkdir()
    _png(tmp_path / "images" / "red.png")
    _png(tmp_path / "images" / "green.png", (0, 255, 0))
    edits = read_edits(str(_jsonl(tmp_path / "edits.jsonl", [
        {"instruction": "make the square green", "source": "images/red.png", "reference": "images/green.png"},
        {"instruction": "make the square green ", "source": str(tmp_path / "images" / "red.png")}])))  # absolute path too
    assert [type(e) for e in edits] == [EditPrompt, EditPrompt] and edits[0] != edits[1]
    assert edits[0].instruction == "make the square green" and edits[1].instruction == "make the square green"
    assert torch.allclose(edits[0].image()[:, 0, 0], torch.tensor([1.0, 0.0, 0.0]))
    assert torch.allclose(edits[0].reference_image()[:, 0, 0], torch.tensor([0.0, 1.0, 0.0]))
    assert edits[1].reference_image() is None
    table = pa.table({"instruction": ["add a circle", "remove the square"], "source": [_png(), _png(colour=(0, 0, 255))]})
    pq.write_table(table, tmp_path / "edits.parquet")
    from_parquet = read_edits(str(tmp_path / "edits.parquet"))
    assert [e.instruction for e in from_parquet] == ["add a circle", "remove the square"]
    assert torch.allclose(from_parquet[1].image()[:, 3, 3], torch.tensor([0.0, 0.0, 1.0]))


@pytest.mark.parametrize("rows, sentence", [
    ([{"source": "red.png"}], r"row 1 has no instruction \(a non-empty string\); its columns: source$"),
    ([{"instruction": "recolour", "source": "red.png"}, {"instruction": "", "source": "red.png"}], r"row 2 has no instruction"),
    ([{"instruction": "recolour"}], r"row 1 has no source image; its columns: instruction$"),
    ([{"instruction": "recolour", "source": "gone.png"}], r"row 1 names a source image 'gone.png' that does not exist$"),
    ([{"instruction": "recolour", "source": "notes.png"}], r"row 1's source image cannot be read as an image"),
    ([{"instruction": "recolour", "source": "red.png", "reference": "gone.png"}], r"row 1 names a reference image 'gone.png'"),
    ([{"instruction": "recolour", "source": 3}], r"row 1 has no source image \(a path, the image's bytes, or an image\); got int$"),
    ([{"instruction": "recolour", "source": "red.png", "reference": "big.png"}],
     r"row 1's reference image is 16x16 but its source is 8x8; give a reference of the source's size$"),
    (["{not json"], r"line 1 is not JSON"),
    (["[1, 2]"], r"line 1 is not an object"),
    ([], r"holds no edits"),
])
def test_each_bad_row_is_one_sentence_naming_it(tmp_path, rows, sentence):
    _png(tmp_path / "red.png")
    _png(tmp_path / "big.png", size=16)
    (tmp_path / "notes.png").write_text("not an image")
    path = tmp_path / "edits.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows))
    with pytest.raises(UserError, match=rf"^data.edits '{path}' " + sentence):
        read_edits(str(path))


def test_a_text_to_image_family_refuses_edits_and_the_cli_exits_2(tmp_path, capsys):
    with pytest.raises(UserError, match=r"^data.edits '.*' does not exist"):
        read_edits(str(tmp_path / "missing.jsonl"))
    with pytest.raises(UserError, match="must be a .jsonl or .parquet file"):
        read_edits(str(tmp_path / "edits.csv"))
    _png(tmp_path / "red.png")
    good = _jsonl(tmp_path / "edits.jsonl", [{"instruction": "recolour", "source": "red.png"}])
    with pytest.raises(ConfigError, match=r"^data.edits gives source images to edit, which model.kind sd3 cannot"):
        load_config("tiny_jpeg", [f"data.edits={good}"])
    assert main(["train", "tiny_jpeg", f"data.edits={good}", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "model.kind sd3 cannot" in err and "Traceback" not in err and not (tmp_path / "run").exists()

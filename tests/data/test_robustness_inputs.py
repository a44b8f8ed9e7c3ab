"""Damaged training inputs give one `ValueError` naming the damaged file, the entry and the fix, never a traceback:
features folders whose `index.json` does not match its shards, make-data folders whose parts or settings are
damaged; and a make-data folder resumes with its paths named another way (absolute or relative)."""

from __future__ import annotations

import gzip
import json
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from testing_utils import VOCAB, make_tiny_target, make_tokenizer, one_thread, write_prompts

from dflash_hf.data.features import OfflineFeatureDataset, read_index
from dflash_hf.data.make import load_training_data, make_data

pytestmark = pytest.mark.usefixtures("single_thread")

TAPS = [1, 3]


def _settings(src: Path) -> dict:
    """The make-data settings of every folder here."""
    return dict(source=str(src), max_new_tokens=3, held_out_fraction=0.0, batch_size=2, progress=False)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict:
    """A tiny target, its tokenizer and a made folder `data` (three parts) with the features captured into `features`
    (three shards of two rows)."""
    root = tmp_path_factory.mktemp("inputs")
    with one_thread():
        target = make_tiny_target("llama")
        tok = make_tokenizer()
        src = write_prompts(root / "p.jsonl")
        make_data(target, tok, root / "data", features_dir=root / "features", target_layer_ids=TAPS, **_settings(src))
    return {"target": target, "tok": tok, "src": src, "root": root}


def _copy(made: dict, tmp_path: Path, name: str) -> Path:
    """A copy of the made folder `name` (`data` or `features`) to damage."""
    return Path(shutil.copytree(made["root"] / name, tmp_path / name))


# ---------------------------------------------------------------------------------------------------------------
# features folders: index.json checked against itself and its shards


def _edit_index(folder: Path, edit: Callable[[dict], None]) -> None:
    index = json.loads((folder / "index.json").read_text())
    edit(index)
    (folder / "index.json").write_text(json.dumps(index))


def _edit_shard(folder: Path, number: int, edit: Callable[[dict], None]) -> None:
    file = folder / f"shard-{number:05d}.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file))


def _narrower(tensors: dict) -> None:
    for name, tensor in tensors.items():
        if "." not in name:
            tensors[name] = tensor[:, :-8].contiguous()


def _shards(edit: Callable[[list], None]) -> Callable[[dict], None]:
    return lambda index: edit(index["shards"])


# case: (damage to the features folder, what the error names after "index.json: ")
INDEX_DAMAGES = {
    "wrong_width": (lambda f: _edit_shard(f, 1, _narrower), r"shard entry 1 .*tensor '2'.*\(tokens, 128\)"),
    "final_hidden_wrong_width": (
        lambda f: _edit_shard(f, 2, lambda t: t.update({"4.final": torch.zeros(3, 4, dtype=torch.bfloat16)})),
        r"shard entry 2 .*tensor '4.final'.*\(tokens, 64\)",
    ),
    "row_missing": (lambda f: _edit_shard(f, 0, lambda t: t.pop("1")), r"shard entry 0 .*'1'.*no such tensor"),
    "shard_not_safetensors": (
        lambda f: (f / "shard-00001.safetensors").write_bytes(random.Random(0).randbytes(300)),
        "shard entry 1 .*cannot be read as a safetensors shard",
    ),
    "same_shard_twice": (
        lambda f: _edit_index(f, _shards(lambda s: s.insert(1, dict(s[0])))),
        "shard entry 1 .*names the file of shard entry 0 again",
    ),
    "same_file_named_two_ways": (
        lambda f: _edit_index(f, _shards(lambda s: s[1].update(file=f"./{s[0]['file']}"))),
        "shard entry 1 .*names the file of shard entry 0 again",
    ),
    "overlapping_rows": (
        lambda f: _edit_index(f, _shards(lambda s: s[1].update(start=1))),
        r"shard entry 1 .*rows 1\.\.3 overlap the rows before them",
    ),
    "rows_left_out": (lambda f: _edit_index(f, _shards(lambda s: s.pop(1))), r"shard entry 1 .*leave rows 2\.\.3 out"),
    "rows_past_num_rows": (
        lambda f: _edit_index(f, lambda index: index.update(num_rows=5)),
        "shard entry 2 .*ends at row 6, past the folder's `num_rows` 5",
    ),
    "shards_a_string": (
        lambda f: _edit_index(f, lambda index: index.update(shards="shard-00000.safetensors")),
        "`shards` is 'shard-00000.safetensors', not a list of shard entries",
    ),
    "end_a_string": (
        lambda f: _edit_index(f, _shards(lambda s: s[0].update(end="2"))),
        "shard entry 0 .*`end` '2' are not a range of rows",
    ),
    "start_a_string": (
        lambda f: _edit_index(f, _shards(lambda s: s[2].update(start="4"))),
        "shard entry 2 .*`start` '4' and",
    ),
    "lengths_missing": (
        lambda f: _edit_index(f, _shards(lambda s: s[0].pop("lengths"))),
        "shard entry 0 .*`lengths` is not the list of its 2 rows' lengths",
    ),
    "entry_without_file": (
        lambda f: _edit_index(f, _shards(lambda s: s[2].pop("file"))),
        r"shard entry 2 has no `file`",
    ),
    "width_missing": (
        lambda f: _edit_index(f, lambda index: index.pop("width")),
        "`width` is missing, not a positive number",
    ),
    "taps_a_string": (
        lambda f: _edit_index(f, lambda index: index.update(target_layer_ids="1,3")),
        "`target_layer_ids` is '1,3', not a list of layers",
    ),
}


@pytest.mark.parametrize("case", INDEX_DAMAGES)
def test_a_damaged_features_index_is_a_value_error_naming_the_entry(made, tmp_path, case):
    """Read for training or for a resume, the index gives a `ValueError` that names index.json, the entry and the fix
    (not a KeyError, TypeError or a shape error in the middle of training)."""
    features = _copy(made, tmp_path, "features")
    damage, names = INDEX_DAMAGES[case]
    damage(features)
    expected = rf"^{re.escape(str(features / 'index.json'))}: {names}.*recreate the features folder"
    with pytest.raises(ValueError, match=expected):
        read_index(features)
    with pytest.raises(ValueError, match=expected):
        OfflineFeatureDataset(load_training_data(made["root"] / "data"), features)


def test_a_file_outside_the_folder_is_named_with_its_index(made, tmp_path):
    features = _copy(made, tmp_path, "features")
    _edit_index(features, _shards(lambda s: s[1].update(file="../data/parts/part-000000.jsonl.gz")))
    with pytest.raises(
        ValueError, match=rf"^{re.escape(str(features / 'index.json'))} \(a shard\) names '../data/parts/part-00"
    ):
        read_index(features)


def test_make_data_resume_reads_the_features_index_checked(made, tmp_path):
    """A resume checks the index before anything in the folder is reused, deleted or added."""
    data, features = _copy(made, tmp_path, "data"), _copy(made, tmp_path, "features")
    _edit_shard(features, 1, _narrower)
    before = {path.name: path.read_bytes() for path in features.iterdir()}
    with pytest.raises(ValueError, match=r"index.json: shard entry 1 .*\(tokens, 128\)"):
        make_data(
            made["target"], made["tok"], data, features_dir=features, target_layer_ids=TAPS, **_settings(made["src"])
        )
    assert {path.name: path.read_bytes() for path in features.iterdir()} == before


# ---------------------------------------------------------------------------------------------------------------
# make-data parts: damaged or foreign parts are refused, naming the part and the fix


def _records(part: Path) -> list[dict]:
    return [json.loads(line) for line in gzip.decompress(part.read_bytes()).decode().splitlines()]


def _rewrite(edit: Callable[[list[dict]], None]) -> Callable[[Path], None]:
    """A damage that edits the records of a part."""

    def damage(part: Path) -> None:
        records = _records(part)
        edit(records)
        part.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode()))

    return damage


# case: (damage to part-000001.jsonl.gz, what the error says about it)
PART_DAMAGES = {
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), " cannot be read .*damaged"),
    "random_bytes": (lambda p: p.write_bytes(random.Random(1).randbytes(200)), " cannot be read .*damaged"),
    "not_json": (lambda p: p.write_bytes(gzip.compress(b'{"id": "p2", "input_ids": [1, 2\n')), ":1 is not valid JSON"),
    "no_input_ids": (_rewrite(lambda r: r[1].pop("input_ids")), ":2: record 'p[0-9]' has no `input_ids`"),
    "no_prompt_length": (_rewrite(lambda r: r[0].pop("prompt_length")), ":1: record 'p[0-9]' has no `prompt_length`"),
    "prompt_longer_than_row": (
        _rewrite(lambda r: r[0].update(prompt_length=99)),
        r":1: record 'p[0-9]' has no `prompt_length` in 0\.\.",
    ),
    "no_id": (_rewrite(lambda r: r[1].pop("id")), ":2: the record has no string `id`"),
    "not_an_object": (_rewrite(lambda r: r.__setitem__(0, [1, 2])), ":1: the record is a JSON list"),
    "float_ids": (_rewrite(lambda r: r[0].update(input_ids=[1.0, 5.0])), ":1: record 'p[0-9]' has no `input_ids` list"),
    "string_ids": (
        _rewrite(lambda r: r[0].update(input_ids=["1", "5"])),
        ":1: record 'p[0-9]' has no `input_ids` list",
    ),
    "negative_id": (
        _rewrite(lambda r: r[1]["input_ids"].__setitem__(1, -1)),
        ":2: record 'p[0-9]' holds token id -1, outside the target's vocabulary",
    ),
    "id_past_the_vocabulary": (
        _rewrite(lambda r: r[0]["input_ids"].append(VOCAB)),
        rf":1: record 'p[0-9]' holds token id {VOCAB}, outside the target's vocabulary \(its {VOCAB} token ids are 0\.\.",
    ),
}


@pytest.mark.parametrize("case", PART_DAMAGES)
def test_a_damaged_part_is_refused_naming_the_part_and_the_fix(made, tmp_path, case):
    """Resuming never writes a damaged or foreign part's rows into `dataset/`: the folder is left as it was."""
    data = _copy(made, tmp_path, "data")
    part = data / "parts" / "part-000001.jsonl.gz"
    damage, says = PART_DAMAGES[case]
    damage(part)
    before = (data / "manifest.json").read_bytes(), len(load_training_data(data))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(part))}{says}.*move it out of the parts folder and rerun"):
        make_data(made["target"], made["tok"], data, **_settings(made["src"]))
    assert ((data / "manifest.json").read_bytes(), len(load_training_data(data))) == before


def test_the_fix_for_a_damaged_part_works(made, tmp_path):
    """Moving the damaged part away and rerunning makes its rows again: the same rows as before the damage."""
    data = _copy(made, tmp_path, "data")
    part = data / "parts" / "part-000001.jsonl.gz"
    part.write_bytes(part.read_bytes()[:20])
    part.rename(tmp_path / part.name)
    resumed = make_data(made["target"], made["tok"], data, **_settings(made["src"]))
    assert resumed["counts"]["generated_this_run"] == 2
    rows = {r["id"]: r["input_ids"] for r in load_training_data(data)}
    assert rows == {r["id"]: r["input_ids"] for r in load_training_data(made["root"] / "data")}


@pytest.mark.parametrize("text, says", [(b"{", "is not valid JSON"), (b"[]", "holds a JSON list")])
def test_damaged_recorded_settings_are_a_value_error(made, tmp_path, text, says):
    data = _copy(made, tmp_path, "data")
    (data / "parts" / "settings.json").write_bytes(text)
    with pytest.raises(
        ValueError, match=rf"^{re.escape(str(data / 'parts' / 'settings.json'))} {says}.*move it away and rerun"
    ):
        make_data(made["target"], made["tok"], data, **_settings(made["src"]))


# ---------------------------------------------------------------------------------------------------------------
# resuming with the paths named another way


@pytest.mark.parametrize("first_absolute", [False, True])
def test_a_folder_resumes_with_its_paths_named_absolute_or_relative(made, tmp_path, monkeypatch, first_absolute):
    """`--prompts FILE`, a target folder and `--features-out` named by an absolute path on one run and a relative one
    on the other are the same settings; another prompt file is still refused."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(made["src"], tmp_path / "p.jsonl")
    (tmp_path / "target").mkdir()
    relative = {"source": "p.jsonl", "target_name": "target", "features_dir": "features"}
    absolute = {key: str(tmp_path / value) for key, value in relative.items()}
    runs = [absolute, relative] if first_absolute else [relative, absolute]
    kwargs = {**_settings(made["src"]), "target_layer_ids": TAPS, "max_samples": 4}
    first = make_data(made["target"], made["tok"], tmp_path / "data", **{**kwargs, **runs[0]})
    resumed = make_data(made["target"], made["tok"], tmp_path / "data", **{**kwargs, **runs[1], "max_samples": None})
    assert first["counts"]["generated_this_run"] == 4 and resumed["counts"]["generated_this_run"] == 2
    assert read_index(tmp_path / "features")["shards"][-1]["end"] == len(load_training_data(tmp_path / "data")) == 6
    shutil.copy(made["src"], tmp_path / "q.jsonl")
    with pytest.raises(ValueError, match="other settings .*source: "):
        make_data(made["target"], made["tok"], tmp_path / "data", **{**kwargs, **runs[1], "source": "q.jsonl"})

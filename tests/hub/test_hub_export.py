"""`dflash_hf.export` / `dflash-hf export`: Hub-ready folders, model cards, atomic writes."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch
from huggingface_hub import metadata_load
from testing_utils import make_drafter, make_target

import dflash_hf
from dflash_hf import DFlashDraftModel
from dflash_hf.cli import main as cli_main

FAMILY_TAGS = {"qwen3": "qwen", "qwen2": "qwen", "llama": "llama", "gemma3": "gemma"}
BASE_MODELS = {
    "qwen3": "Qwen/Qwen3-8B",
    "qwen2": "Qwen/Qwen2.5-Coder-0.5B-Instruct",
    "llama": "meta-llama/Llama-3.1-8B-Instruct",
    "gemma3": "google/gemma-3-270m",
}
MEASURED = {"block_size": 4, "hardware": "2-core CPU", "date": "2025-06-01"}
METRICS = [
    {"benchmark": "humaneval", "tau": 3.4567, "speedup": 1.8912, **MEASURED},
    {"benchmark": "sharegpt", "tau": 2.5, "speedup": 1.25, **MEASURED},
]


@pytest.fixture(scope="module")
def qwen_pair():
    target = make_target("qwen3")
    return target, make_drafter(target)


def test_export_writes_a_hub_folder_with_card(family, tmp_path):
    target = make_target(family)
    drafter = make_drafter(target)
    folder = dflash_hf.export(drafter, tmp_path / "drafter", target=target, base_model=BASE_MODELS[family])
    assert sorted(path.name for path in folder.iterdir()) == [
        "README.md",
        "config.json",
        "configuration_dflash.py",
        "model.safetensors",
        "modeling_dflash.py",
    ]
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "dflash"
    assert config["auto_map"] == {
        "AutoConfig": "configuration_dflash.DFlashConfig",
        "AutoModel": "modeling_dflash.DFlashDraftModel",
    }
    assert config["target_layer_ids"] == drafter.config.target_layer_ids

    card = (folder / "README.md").read_text()
    meta = metadata_load(folder / "README.md")
    assert meta["base_model"] == BASE_MODELS[family]
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert meta["tags"] == ["dflash", "speculative-decoding", FAMILY_TAGS[family]]
    assert "license" not in meta  # unknown for an in-memory target: not made up
    assert (
        f"## Notes for {dict(qwen3='Qwen', qwen2='Qwen', llama='LLaMA-family', gemma3='Gemma')[family]} targets" in card
    )
    assert 'speculation_type="dflash"' in card and "dflash_hf.generate(target, drafter" in card
    assert "No measurements are included" in card
    # a Gemma card says which serving engine cannot run the drafter as trained
    assert ("refuses Gemma targets" in card) == (family == "gemma3")
    assert not re.search(r"\d\.\d+x", card)  # no speedup figure anywhere without measurements
    assert "$" not in card.replace("$$", "")  # every placeholder filled

    reloaded = DFlashDraftModel.from_pretrained(folder)
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    assert "| Weights | safetensors, `float32` |" in card
    # the card states the precision the weights are stored in (a bf16 copy of an fp32-configured drafter)
    bf16 = dflash_hf.export(
        drafter.to(torch.bfloat16), tmp_path / "bf16", target=target, base_model=BASE_MODELS[family]
    )
    assert "| Weights | safetensors, `bfloat16` |" in (bf16 / "README.md").read_text()


def test_results_table_only_from_measured_metrics(qwen_pair, tmp_path):
    target, drafter = qwen_pair
    folder = dflash_hf.export(drafter, tmp_path / "d", target=target, base_model="Qwen/Qwen3-8B", metrics=METRICS)
    card = (folder / "README.md").read_text()
    assert "| Benchmark | Block size | tau | Speedup | Hardware | Date |" in card
    assert "| humaneval | 4 | 3.46 | 1.89x | 2-core CPU | 2025-06-01 |" in card
    assert "| sharegpt | 4 | 2.50 | 1.25x | 2-core CPU | 2025-06-01 |" in card
    assert "No measurements are included" not in card


@pytest.mark.parametrize(
    "metrics, message",
    [
        ({"tau": 3.0, "hardware": "cpu", "date": "2025-06-01"}, "lacks speedup"),
        ({"tau": "fast", "speedup": 2.0, "hardware": "cpu", "date": "2025-06-01"}, "`tau` must be a finite number"),
        ({"tau": 0.5, "speedup": 2.0, "hardware": "cpu", "date": "2025-06-01"}, "at least 1"),
    ],
)
def test_bad_metrics_are_refused_before_writing(qwen_pair, tmp_path, metrics, message):
    target, drafter = qwen_pair
    with pytest.raises(ValueError, match=message):
        dflash_hf.export(drafter, tmp_path / "d", target=target, base_model="Qwen/Qwen3-8B", metrics=metrics)
    assert list(tmp_path.iterdir()) == []


def test_training_facts_and_license(qwen_pair, tmp_path):
    target, drafter = qwen_pair
    target_dir = tmp_path / "target"
    target.config.save_pretrained(target_dir)
    (target_dir / "README.md").write_text("---\nlicense: apache-2.0\n---\n# target\n")
    training = {"samples": 1200, "steps": 300, "learning_rate": 6e-4}
    folder = dflash_hf.export(
        drafter, tmp_path / "d", target=str(target_dir), base_model="Qwen/Qwen3-8B", training=training
    )
    assert metadata_load(folder / "README.md")["license"] == "apache-2.0"
    card = (folder / "README.md").read_text()
    assert "- `samples`: 1200\n- `steps`: 300\n- `learning_rate`: 0.0006" in card
    folder = dflash_hf.export(drafter, tmp_path / "e", target=target, base_model="Qwen/Qwen3-8B", license="mit")
    assert metadata_load(folder / "README.md")["license"] == "mit"


def test_target_hub_id_is_required_for_the_card(qwen_pair, tmp_path):
    target, drafter = qwen_pair
    with pytest.raises(ValueError, match="base_model='org/name'"):
        dflash_hf.export(drafter, tmp_path / "d", target=target)
    with pytest.raises(ValueError, match="base_model='org/name'"):
        dflash_hf.export(drafter, tmp_path / "d", target=target, base_model="/not/a/hub id")
    with pytest.raises(ValueError, match="Unknown export format"):
        dflash_hf.export(drafter, tmp_path / "d", target=target, base_model="Qwen/Qwen3-8B", format="onnx")
    assert list(tmp_path.iterdir()) == []


def test_export_is_atomic(qwen_pair, tmp_path, monkeypatch):
    target, drafter = qwen_pair
    out = tmp_path / "d"

    def interrupted(config, target):
        raise KeyboardInterrupt  # after the weights and remote code were written into the staging folder

    monkeypatch.setattr(sys.modules["dflash_hf.hub.export"], "to_official_config", interrupted)
    with pytest.raises(KeyboardInterrupt):
        dflash_hf.export(drafter, out, target=target, base_model="Qwen/Qwen3-8B", format="official")
    assert list(tmp_path.iterdir()) == []  # no half folder, no staging leftovers

    dflash_hf.export(drafter, out, target=target, base_model="Qwen/Qwen3-8B")  # an earlier export, its card edited
    (out / "README.md").write_text("kept")
    with pytest.raises(ValueError, match="already exists"):
        dflash_hf.export(drafter, out, target=target, base_model="Qwen/Qwen3-8B")
    with pytest.raises(KeyboardInterrupt):
        dflash_hf.export(drafter, out, target=target, base_model="Qwen/Qwen3-8B", format="official", overwrite=True)
    assert [path.name for path in tmp_path.iterdir()] == ["d"] and (out / "README.md").read_text() == "kept"

    monkeypatch.undo()
    dflash_hf.export(drafter, out, target=target, base_model="Qwen/Qwen3-8B", overwrite=True)
    assert [path.name for path in tmp_path.iterdir()] == ["d"]
    assert (out / "README.md").read_text() != "kept" and (out / "model.safetensors").exists()


def test_cli_export(qwen_pair, tmp_path, capsys):
    target, drafter = qwen_pair
    drafter.save_pretrained(tmp_path / "checkpoint")
    target.config.save_pretrained(tmp_path / "target")
    (tmp_path / "metrics.json").write_text(json.dumps({"results": METRICS[:1]}))
    argv = [
        "export",
        str(tmp_path / "checkpoint"),
        str(tmp_path / "out"),
        "--target",
        str(tmp_path / "target"),
        "--base-model",
        "Qwen/Qwen3-8B",
        "--repo-id",
        "me/qwen3-dflash",
        "--metrics",
        str(tmp_path / "metrics.json"),
        "--format",
        "official",
    ]
    assert cli_main(argv) == 0
    assert "exported official drafter" in capsys.readouterr().out
    card = (tmp_path / "out" / "README.md").read_text()
    assert "| humaneval | 4 | 3.46 | 1.89x |" in card
    assert 'AutoModel.from_pretrained("me/qwen3-dflash", trust_remote_code=True' in card
    assert "--speculative-draft-model-path me/qwen3-dflash" in card

    assert cli_main(argv) == 2  # exists: one error line, no traceback
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: {tmp_path / 'out'} already exists; choose another folder or pass overwrite=True (`--overwrite`)."
    ]


def test_export_against_a_random_target_by_name(tmp_path):
    from dflash_hf.random_targets import build_random_target, random_drafter

    target = build_random_target("random:tiny-qwen3", torch.float32)[0]
    drafter = random_drafter(target, num_layers=1, block_size=4)
    with pytest.raises(ValueError, match=r"base_model='org/name'"):
        dflash_hf.export(drafter, tmp_path / "d", target="random:tiny-qwen3")
    out = dflash_hf.export(drafter, tmp_path / "d", target="random:tiny-qwen3", base_model="a/b")
    assert (out / "config.json").is_file()
    with pytest.raises(ValueError, match="Unknown random target 'random:nope'"):
        dflash_hf.export(drafter, tmp_path / "e", target="random:nope", base_model="a/b")
    # the speculators layout holds the target's LM head rows: the model itself, not a name built anew
    with pytest.raises(ValueError, match="depend on the device and dtype it was built in: pass the target model"):
        dflash_hf.export(drafter, tmp_path / "s", target="random:tiny-qwen3", base_model="a/b", format="speculators")
    assert (dflash_hf.export(drafter, tmp_path / "s", target=target, base_model="a/b", format="speculators")).is_dir()

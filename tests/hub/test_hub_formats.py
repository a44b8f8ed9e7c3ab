"""Checkpoint formats: remote code that stands alone, and the official (z-lab) layout read by SGLang and vLLM."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from testing_utils import make_drafter, make_target
from transformers import Qwen3Config

import dflash_hf
from dflash_hf import DFlashDraftModel

BASE_MODEL = "Qwen/Qwen3-8B"

# Runs in a separate interpreter (`python -I`, clean cwd) where `dflash_hf` cannot be imported: loads each folder with
# AutoModel + trust_remote_code, runs the saved inputs and `spec_generate` with the saved target and saves the outputs,
# or records why loading failed.
STANDALONE_SCRIPT = r"""
import importlib.abc, json, sys

class BlockDFlashHF(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "dflash_hf" or name.startswith("dflash_hf."):
            raise ImportError(f"{name} is hidden from this process")

sys.meta_path.insert(0, BlockDFlashHF())
try:
    import dflash_hf
except ImportError:
    pass
else:
    sys.exit("dflash_hf is importable: the test would not prove anything")

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForCausalLM

inputs_path, num_threads, target_folder, max_new_tokens, *folders = sys.argv[1:]
torch.set_num_threads(int(num_threads))
inputs = load_file(inputs_path)
prompt = inputs.pop("prompt")
target = AutoModelForCausalLM.from_pretrained(target_folder).eval()
report = {}
for folder in folders:
    try:
        model = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
    except Exception as err:
        report[folder] = f"load failed: {type(err).__name__}: {err}"
        continue
    report[folder] = type(model).__module__
    with torch.no_grad():
        out = model(**inputs).last_hidden_state
    generated = model.spec_generate(target, prompt, max_new_tokens=int(max_new_tokens))
    save_file({"last_hidden_state": out.contiguous(), "generated": generated}, folder + ".out.safetensors")
print(json.dumps(report))
"""


SPEC_TOKENS = 12


def drafter_inputs(config, seed: int = 0, n_ctx: int = 5) -> dict[str, torch.Tensor]:
    """Random forward inputs for a drafter: a block of embeddings, tapped context features, their positions."""
    generator = torch.Generator().manual_seed(seed)
    width = len(config.target_layer_ids) * config.hidden_size
    return {
        "noise_embeds": torch.randn(1, config.block_size, config.hidden_size, generator=generator),
        "context_hidden_states": torch.randn(1, n_ctx, width, generator=generator),
        "position_ids": torch.arange(n_ctx + config.block_size)[None],
    }


@torch.no_grad()
def forward(model, inputs) -> torch.Tensor:
    return model.eval()(**inputs).last_hidden_state


def remote_code_imports(path: Path) -> set[str]:
    """Top-level packages imported at module level (relative imports excluded)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.fixture(scope="module")
def qwen_pair():
    target = make_target("qwen3")
    return target, make_drafter(target)


def test_remote_code_imports_only_torch_and_transformers(qwen_pair, tmp_path):
    _, drafter = qwen_pair
    folder = dflash_hf.export(drafter, tmp_path / "drafter", target=qwen_pair[0], base_model=BASE_MODEL)
    for name in ("configuration_dflash.py", "modeling_dflash.py"):
        third_party = remote_code_imports(folder / name) - set(sys.stdlib_module_names)
        assert third_party <= {"torch", "transformers"}, (name, third_party)


def test_exported_drafter_loads_without_dflash_hf(qwen_pair, tmp_path):
    """Both export formats load with AutoModel + trust_remote_code in a process that cannot import dflash_hf, and give
    bit-identical outputs and `spec_generate` plain greedy decoding's tokens; a folder whose remote code imports
    dflash_hf fails there (so the isolation is real)."""
    target, drafter = qwen_pair
    folders = {
        fmt: dflash_hf.export(drafter, tmp_path / fmt, target=target, base_model=BASE_MODEL, format=fmt)
        for fmt in ("dflash-hf", "official")
    }
    tampered = tmp_path / "tampered"
    shutil.copytree(folders["dflash-hf"], tampered)
    modeling = tampered / "modeling_dflash.py"
    modeling.write_text("import dflash_hf\n" + modeling.read_text())

    inputs = drafter_inputs(drafter.config)
    prompt = torch.tensor([[5, 9, 14, 3, 27]])
    save_file({**inputs, "prompt": prompt}, tmp_path / "inputs.safetensors")
    target.save_pretrained(tmp_path / "target")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1")
    run_dir = tmp_path / "clean_cwd"
    run_dir.mkdir()
    # one thread on both sides: multi-threaded CPU kernels may split reductions differently in another process
    args = [str(tmp_path / "inputs.safetensors"), "1", str(tmp_path / "target"), str(SPEC_TOKENS)]
    args += [str(folders["dflash-hf"]), str(folders["official"]), str(tampered)]
    result = subprocess.run(
        [sys.executable, "-I", "-c", STANDALONE_SCRIPT, *args],
        cwd=run_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])

    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = forward(drafter, inputs)
        greedy = target.generate(prompt, max_new_tokens=SPEC_TOKENS, do_sample=False)
    finally:
        torch.set_num_threads(num_threads)
    for fmt, folder in folders.items():
        assert report[str(folder)].startswith("transformers_modules"), report[str(folder)]
        got = load_file(str(folder) + ".out.safetensors")
        assert torch.equal(got["last_hidden_state"], expected), fmt
        assert torch.equal(got["generated"], greedy), fmt
    assert report[str(tampered)].startswith("load failed"), report[str(tampered)]
    assert "dflash_hf" in report[str(tampered)]


def test_official_export_layout(qwen_pair, tmp_path):
    target, drafter = qwen_pair
    folder = dflash_hf.export(drafter, tmp_path / "official", target=target, base_model=BASE_MODEL, format="official")
    assert sorted(path.name for path in folder.iterdir()) == [
        "README.md",
        "config.json",
        "configuration_dflash.py",
        "dflash.py",
        "model.safetensors",
    ]
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert config["num_hidden_layers"] == drafter.config.num_hidden_layers
    assert config["num_target_layers"] == target.config.num_hidden_layers
    assert config["block_size"] == drafter.config.block_size
    assert config["dflash_config"]["mask_token_id"] == drafter.config.mask_token_id
    assert config["dflash_config"]["target_layer_ids"] == drafter.config.target_layer_ids
    # a plain Qwen3 config for SGLang / vLLM, RoPE base readable by old and new Transformers alike
    qwen3 = Qwen3Config.from_dict(config)
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert getattr(qwen3, key) == getattr(target.config, key), key
    assert qwen3.rope_parameters["rope_theta"] == config["rope_theta"] == target.config.rope_parameters["rope_theta"]
    assert set(load_file(folder / "model.safetensors")) == set(drafter.state_dict())
    # without remote code Transformers reads `model_type: qwen3` as a plain Qwen3Model, silently: the card says so
    assert "Load it with `trust_remote_code=True`" in (folder / "README.md").read_text()
    assert config["layer_types"] == ["full_attention"] * drafter.config.num_hidden_layers
    assert config["use_sliding_window"] is False and "is_causal" not in config


def test_round_trip_dflash_hf_official_dflash_hf_is_bit_identical(qwen_pair, tmp_path):
    target, drafter = qwen_pair
    official = dflash_hf.export(drafter, tmp_path / "official", target=target, base_model=BASE_MODEL, format="official")
    from_official = DFlashDraftModel.from_pretrained(official)
    ours = dflash_hf.export(from_official, tmp_path / "ours", target=target, base_model=BASE_MODEL)
    reloaded = DFlashDraftModel.from_pretrained(ours)
    keys = ("hidden_size", "num_hidden_layers", "block_size", "mask_token_id", "target_layer_ids", "rope_parameters")
    for key in keys:
        assert getattr(reloaded.config, key) == getattr(drafter.config, key), key
    inputs = drafter_inputs(drafter.config, seed=3)
    expected = forward(drafter, inputs)
    assert torch.equal(forward(from_official, inputs), expected)
    assert torch.equal(forward(reloaded, inputs), expected)


# Official layout, written from the published key and tensor names (docs/design.md §4), random small weights.
OFFICIAL_TENSORS = ["fc.weight", "hidden_norm.weight", "norm.weight"] + [
    f"layers.{i}.{name}.weight"
    for i in range(2)
    for name in (
        "input_layernorm",
        "post_attention_layernorm",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "self_attn.q_norm",
        "self_attn.k_norm",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
]


def official_fixture(folder: Path, *, block_size_in_dflash_config: bool = False, layer_ids=(1, 4)) -> dict:
    """Write a small checkpoint in the official layout; return its tensors."""
    hidden, heads, kv_heads, head_dim, inter = 32, 4, 2, 8, 48
    config = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": 2,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": 100,
        "num_target_layers": 6,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 2,
        "dtype": "float32",
        "dflash_config": {"mask_token_id": 99},
    }
    if layer_ids is not None:
        config["dflash_config"]["target_layer_ids"] = list(layer_ids)
    if block_size_in_dflash_config:
        config["dflash_config"]["block_size"] = 8
    else:
        config["block_size"] = 8
    shapes = {
        "fc": (hidden, len(layer_ids or ()) * hidden),
        "q_proj": (heads * head_dim, hidden),
        "k_proj": (kv_heads * head_dim, hidden),
        "v_proj": (kv_heads * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
        "q_norm": (head_dim,),
        "k_norm": (head_dim,),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }
    generator = torch.Generator().manual_seed(0)
    tensors = {
        name: torch.randn(shapes.get(name.split(".")[-2], (hidden,)), generator=generator) * 0.1
        for name in OFFICIAL_TENSORS
    }
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, folder / "model.safetensors")
    return tensors


@pytest.mark.parametrize("block_size_in_dflash_config", [False, True])
def test_loads_official_layout(tmp_path, block_size_in_dflash_config):
    tensors = official_fixture(tmp_path / "official", block_size_in_dflash_config=block_size_in_dflash_config)
    drafter = DFlashDraftModel.from_pretrained(tmp_path / "official")
    config = drafter.config
    assert config.model_type == "dflash"
    assert (config.block_size, config.mask_token_id, config.target_layer_ids) == (8, 99, [1, 4])
    assert config.num_target_layers == 6 and config.rope_parameters["rope_theta"] == 1000000
    state = drafter.state_dict()
    for name, tensor in tensors.items():
        assert torch.equal(state[name], tensor), name
    assert forward(drafter, drafter_inputs(config)).shape == (1, 8, 32)


def test_official_config_without_target_layer_ids_is_refused(tmp_path):
    official_fixture(tmp_path / "official", layer_ids=None)
    with pytest.raises(ValueError, match="target_layer_ids.*never guessed"):
        DFlashDraftModel.from_pretrained(tmp_path / "official")


def test_qwen3_8b_shaped_drafter_has_the_official_readers_shape():
    """The examples/recipes/qwen3-8b.yaml drafter (untrained: no Qwen3-8B weights offline), built on the meta device:
    its official config and tensor names/shapes are what SGLang / vLLM / z-lab's `DFlashDraftModel` read for the
    published Qwen3-8B-DFlash-b16 layout (5 layers, block 16, taps 1, 9, 17, 25, 33, mask id 151669)."""
    from dflash_hf.hub.official import to_official_config

    qwen3_8b = Qwen3Config(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
    )
    config = dflash_hf.DFlashConfig.from_target(
        qwen3_8b, num_hidden_layers=5, block_size=16, num_target_features=5, mask_token_id=151669
    )
    official = to_official_config(config)
    assert official["dflash_config"] == {
        "mask_token_id": 151669,
        "target_layer_ids": [1, 9, 17, 25, 33],
        "block_size": 16,
    }
    assert (official["num_hidden_layers"], official["num_target_layers"], official["block_size"]) == (5, 36, 16)
    assert official["architectures"] == ["DFlashDraftModel"] and official["model_type"] == "qwen3"
    reader = Qwen3Config.from_dict(official)
    assert reader.rope_parameters["rope_theta"] == 1000000.0 and reader.vocab_size == 151936
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in DFlashDraftModel(config).state_dict().items()}
    hidden, q, kv, ffn = 4096, 32 * 128, 8 * 128, 12288
    expected = {"fc.weight": (hidden, 5 * hidden), "hidden_norm.weight": (hidden,), "norm.weight": (hidden,)}
    for i in range(5):
        expected.update(
            {
                f"layers.{i}.input_layernorm.weight": (hidden,),
                f"layers.{i}.post_attention_layernorm.weight": (hidden,),
                f"layers.{i}.self_attn.q_proj.weight": (q, hidden),
                f"layers.{i}.self_attn.k_proj.weight": (kv, hidden),
                f"layers.{i}.self_attn.v_proj.weight": (kv, hidden),
                f"layers.{i}.self_attn.o_proj.weight": (hidden, q),
                f"layers.{i}.self_attn.q_norm.weight": (128,),
                f"layers.{i}.self_attn.k_norm.weight": (128,),
                f"layers.{i}.mlp.gate_proj.weight": (ffn, hidden),
                f"layers.{i}.mlp.up_proj.weight": (ffn, hidden),
                f"layers.{i}.mlp.down_proj.weight": (hidden, ffn),
            }
        )
    assert shapes == expected

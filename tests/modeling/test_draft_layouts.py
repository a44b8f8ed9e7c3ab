"""Today's official layouts read into `DFlashConfig`: per-layer attention types, window and causality, the block's
and the logits' scales, DFlash 2's sizes; unknown DFlash keys named; hostile values refused; what the layers see."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from dflash_hf.modeling.modeling_dflash import block_structure_mask, key_positions
from testing_utils import make_drafter, make_target

from dflash_hf import DFlashConfig, DFlashDraftModel

OFFICIAL = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "vocab_size": 64,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "dflash_config": {"block_size": 4, "mask_token_id": 63, "target_layer_ids": [1, 3]},
}


def official(**changes) -> dict:
    config = json.loads(json.dumps(OFFICIAL))
    dflash = changes.pop("dflash_config", {})
    if isinstance(dflash, dict):
        config["dflash_config"].update(dflash)
    else:  # a hostile value in its place
        config["dflash_config"] = dflash
    config.update(changes)
    return config


def test_plain_official_config_keeps_its_meaning():
    """No window, every layer full and non-causal, the reference's defaults for the scales."""
    config = DFlashConfig.from_dict(official())
    assert config.layer_types == ["full_attention"] * 3 and config.sliding_window is None
    assert not config.restricts_attention and config.context_window is None
    assert (config.input_embedding_scale, config.output_multiplier, config.final_logit_softcapping) == (1.0, 1.0, 0.0)


def test_own_configs_default_to_the_target_s_embedding_and_softcap():
    config = DFlashConfig.from_target(make_target("gemma3").config, num_hidden_layers=2, num_target_features=2)
    assert config.input_embedding_scale is None and config.final_logit_softcapping is None
    assert config.layer_types == ["full_attention"] * 2 and not config.restricts_attention


def test_knobs_are_read_from_dflash_config_first_then_the_top_level():
    config = DFlashConfig.from_dict(
        official(output_multiplier=3.0, input_embedding_scale=5.0, dflash_config={"input_embedding_scale": 8.0})
    )
    assert config.input_embedding_scale == 8.0 and config.output_multiplier == 3.0


def test_sliding_layers_follow_the_qwen3_config_rules():
    """The window only with `use_sliding_window`; without `layer_types`, sliding from `max_window_layers` on."""
    assert (
        DFlashConfig.from_dict(official(layer_types=["sliding_attention"] * 3, sliding_window=6)).sliding_window is None
    )
    config = DFlashConfig.from_dict(official(use_sliding_window=True, sliding_window=6, max_window_layers=1))
    assert config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    assert config.sliding_window == 6 and [config.layer_is_causal(i) for i in range(3)] == [False, True, True]
    sliding_only = DFlashConfig.from_dict(official(use_sliding_window=True, sliding_window=6, max_window_layers=0))
    assert sliding_only.context_window == 5


def test_unknown_dflash_keys_are_named():
    with pytest.warns(UserWarning, match="dflash_config.new_knob, mystery_scale"):
        DFlashConfig.from_dict(official(mystery_scale=2.0, dflash_config={"new_knob": 1}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the layout's own keys are read without a word
        DFlashConfig.from_dict(
            official(use_sliding_window=True, sliding_window=6, rope_theta=1e6, torch_dtype="bfloat16")
        )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"use_sliding_window": True, "sliding_window": 0}, "sliding_window must be a positive int"),
        ({"use_sliding_window": True, "sliding_window": -4}, "sliding_window must be a positive int"),
        ({"use_sliding_window": True, "sliding_window": 2.5}, "sliding_window must be a positive int"),
        ({"layer_types": ["sliding_attention"] * 2}, "one attention type per draft layer"),
        ({"layer_types": ["full_attention", "linear_attention", "full_attention"]}, "layer_types holds"),
        ({"layer_types": "sliding_attention"}, "one attention type per draft layer"),
        ({"is_causal": "yes"}, "is_causal must be true, false or null"),
        ({"dflash_config": {"input_embedding_scale": -1.0}}, "input_embedding_scale must be positive"),
        ({"dflash_config": {"output_multiplier": float("nan")}}, "output_multiplier must be a finite number"),
        ({"dflash_config": {"final_logit_softcapping": -3.0}}, "0 \\(no softcap\\) or positive"),
        ({"dflash_config": {"output_multiplier": "2"}}, "output_multiplier must be a finite number"),
        ({"dflash_config": [1, 2]}, "dflash_config` must be a mapping"),
        ({"architectures": ["DFlash2DraftModel"]}, "lacks|has no conv_kernel_size"),
        (
            {
                "architectures": ["DFlash2DraftModel"],
                "dflash_config": {
                    "conv_kernel_size": 2,
                    "conv_group_size": 24,
                    "selector_rank": 8,
                    "selector_top_k": 4,
                },
            },
            "does not divide hidden_size",
        ),
        (
            {
                "architectures": ["DFlash2DraftModel"],
                "dflash_config": {
                    "conv_kernel_size": 2,
                    "conv_group_size": 16,
                    "selector_rank": 8,
                    "selector_top_k": 99,
                },
            },
            "more candidates than the draft vocabulary",
        ),
        (
            {
                "architectures": ["DFlash2DraftModel"],
                "dflash_config": {
                    "conv_kernel_size": 2,
                    "conv_group_size": 16,
                    "selector_rank": 2**40,
                    "selector_top_k": 4,
                },
            },
            "selector_rank must be an int between 1",
        ),
    ],
)
def test_hostile_layouts_are_refused(changes, message, tmp_path):
    """As a dict and as a folder's config.json: a `ValueError` naming the key, never a crash inside a forward."""
    with pytest.raises(ValueError, match=message):
        DFlashConfig.from_dict(official(**changes))
    (tmp_path / "config.json").write_text(json.dumps(official(**changes)))
    with pytest.raises(ValueError, match=message):
        DFlashConfig.from_pretrained(tmp_path)


def test_what_each_block_slot_sees():
    """Slot `i` of a block at positions 10.. sees the last `W - 1 - i` context positions (window 4); causal: only
    the slots up to it; not causal: the whole block (within the window)."""
    context = torch.arange(10)[None]
    block = torch.arange(10, 14)[None]
    keys = torch.cat([context, block], dim=1)
    causal = block_structure_mask(block, keys, window=4, causal=True)[0, 0]
    assert [row[:10].nonzero().flatten().tolist() for row in causal] == [[7, 8, 9], [8, 9], [9], []]
    assert [row[10:].nonzero().flatten().tolist() for row in causal] == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3]]
    both_ways = block_structure_mask(block, keys, window=4, causal=False)[0, 0]
    assert both_ways[:, 10:].all() and torch.equal(both_ways[:, :10], causal[:, :10])
    assert block_structure_mask(block, keys, window=None, causal=False).all()


def test_cached_keys_are_the_positions_before_the_new_ones():
    """A dynamic cache holds the context right before the new tokens; a windowed one its last positions; a static
    one an unfilled end that no query reaches."""
    new = torch.tensor([[20, 21, 22, 23]])
    assert key_positions(new, 3, 7, None).tolist() == [[17, 18, 19, 20, 21, 22, 23]]
    assert key_positions(new, 50, 6, None).tolist() == [[18, 19, 20, 21, 22, 23]]  # a window kept the last 2
    static = key_positions(new, 3, 9, None)
    assert static[0, :7].tolist() == [17, 18, 19, 20, 21, 22, 23] and (static[0, 7:] > 10**9).all()
    with pytest.raises(ValueError, match="covers 5 keys"):
        key_positions(new, 3, 7, torch.zeros(1, 5, dtype=torch.long))


def test_the_native_path_says_which_scales_it_does_not_apply():
    target = make_target("qwen3")
    drafter = make_drafter(target, output_multiplier=0.5)
    prompt = torch.tensor([[5, 7, 3, 9]])
    with pytest.warns(UserWarning, match="does not apply this drafter's output_multiplier"):
        native = target.generate(
            prompt, assistant_model=drafter, speculation_type="dflash", max_new_tokens=6, do_sample=False
        )
    assert torch.equal(native, target.generate(prompt, max_new_tokens=6, do_sample=False))


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (lambda w: w.update({"candidate_selector.successor_codebook": torch.zeros(64, 5)}), "has shape \\(64, 5\\)"),
        (lambda w: w.pop("candidate_selector.predecessor_codebook"), "missing tensors"),
        (
            lambda w: w.update({"layers.0.attention_conv.base_kernel": torch.zeros(2, 3, 64)}),
            "has shape \\(2, 3, 64\\)",
        ),
        (lambda w: w.update({"candidate_selector.extra": torch.zeros(2)}), "unexpected tensors"),
    ],
    ids=["codebook-shape", "codebook-missing", "conv-taps", "extra-tensor"],
)
def test_dflash2_files_that_do_not_match_their_config_are_refused(tmp_path, tamper, message):
    """Published-style files (codebooks without `.weight`) with a tensor of the wrong shape, missing or extra: a
    `ValueError` naming it, never a drafter with re-initialised parts."""
    from safetensors.torch import load_file, save_file

    target = make_target("qwen3")
    drafter = make_drafter(target, conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
    drafter.save_pretrained(tmp_path)
    weights = {
        name.removesuffix(".weight") if "_codebook" in name else name: tensor
        for name, tensor in load_file(tmp_path / "model.safetensors").items()
    }
    tamper(weights)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message):
        DFlashDraftModel.from_pretrained(tmp_path)

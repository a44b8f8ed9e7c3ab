"""Check that vLLM's `speculators` library reads dflash-hf exports as the drafter we trained.

Run with the interpreter of a separate virtual environment that has `speculators` (it pins an older Transformers
than dflash-hf), on CPU, after exporting the drafter in all three layouts with dflash-hf (see `run.sh` next to this
file, which does both). This script imports only torch, transformers and speculators: the reference logits come from
the dflash-hf export's own remote code (`trust_remote_code=True`), which needs only torch and transformers.

For a real context (a prompt plus the target's greedy continuation) and several anchors it computes, in float32, the
block logits of the drafter (anchor + mask tokens, context features of the target's tapped layers before the anchor):

1. with dflash-hf's remote code (the dflash-hf layout): the reference;
2. with speculators' `DFlashDraftModel` loading our speculators-layout export: must match the reference over the draft
   vocabulary, in the same order;
3. with speculators' `DFlashDraftModel` after `speculators convert --algorithm dflash` of our official-layout export:
   its logits over the draft tokens must match too, and the script reports what the conversion loses (draft
   vocabulary size, `d2t`) and how often its full-vocabulary argmax drafts a different token.

Exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from speculators.convert.dflash import DFlashConverter
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a short explanation."


def context(target, tokenizer, new_tokens: int) -> torch.LongTensor:
    """The templated prompt followed by the target's greedy continuation: a context the drafter really sees."""
    messages = [{"role": "user", "content": PROMPT}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]
    with torch.no_grad():
        return target.generate(ids, max_new_tokens=new_tokens, do_sample=False)


def tapped_features(target, ids: torch.LongTensor, layer_ids: list[int]) -> torch.Tensor:
    """The outputs of the target's decoder layers `layer_ids` at every position, concatenated (`[1, T, n * H]`)."""
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
    return torch.cat([hidden[i + 1] for i in layer_ids], dim=-1)


def reference_logits(drafter, target, ids, features, anchor: int, draft_ids) -> torch.Tensor:
    """dflash-hf's block logits at `anchor` over `draft_ids` (the rows of the target's head it drafts over)."""
    block = drafter.config.block_size
    tokens = torch.full((1, block), drafter.config.mask_token_id)
    tokens[0, 0] = ids[0, anchor]
    with torch.no_grad():
        noise = target.get_input_embeddings()(tokens)
        hidden = drafter(
            noise_embeds=noise,
            context_hidden_states=features[:, :anchor],
            position_ids=torch.arange(anchor + block).unsqueeze(0),
        ).last_hidden_state
    return hidden[0] @ target.get_output_embeddings().weight[draft_ids].T


def speculators_logits(model, ids, features, anchor: int) -> torch.Tensor:
    """speculators' block logits at `anchor` (its training forward with one anchor: same mask, same positions)."""
    block = model.block_size
    length = anchor + block + 1  # speculators never anchors in the last `block_size` positions
    padded = torch.zeros(1, length, features.shape[-1])
    padded[:, :anchor] = features[:, :anchor]
    input_ids = torch.zeros(1, length, dtype=torch.long)
    input_ids[0, anchor] = ids[0, anchor]
    loss_mask = torch.zeros(1, length, dtype=torch.long)
    loss_mask[0, anchor] = 1
    with torch.no_grad():
        _, logits, *_ = model._backbone_forward(
            hidden_states=padded,
            input_ids=input_ids,
            loss_mask=loss_mask,
            verifier_last_hidden_states=torch.zeros(1, length, model.config.transformer_layer_config.hidden_size),
            document_ids=torch.zeros(1, length, dtype=torch.long),
            max_anchors=1,
        )
    return logits[0].float()


def load_speculators(folder: Path, target_dir: str) -> DFlashDraftModel:
    """speculators' model of `folder` in float32 with eager attention, its verifier weights read from `target_dir`."""
    config = DFlashSpeculatorConfig.from_pretrained(str(folder))
    config.transformer_layer_config._attn_implementation = "eager"
    config.speculators_config.verifier.name_or_path = target_dir
    model = DFlashDraftModel.from_pretrained(str(folder), config=config, dtype=torch.float32)
    return model.float().eval()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="local folder of the target model")
    parser.add_argument("--dflash-hf", required=True, type=Path, help="the drafter's dflash-hf export")
    parser.add_argument("--official", required=True, type=Path, help="the drafter's official-layout export")
    parser.add_argument("--speculators", required=True, type=Path, help="the drafter's speculators-layout export")
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy tokens appended to the prompt")
    parser.add_argument("--anchors", type=int, default=32, help="anchors checked (the last positions of the context)")
    parser.add_argument("--atol", type=float, default=2e-3, help="largest allowed absolute logit difference")
    args = parser.parse_args()

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    drafter = AutoModel.from_pretrained(args.dflash_hf, trust_remote_code=True, dtype=torch.float32).eval()
    layer_ids = list(drafter.config.target_layer_ids)
    draft_ids = drafter.draft_token_ids
    if draft_ids is None:
        draft_ids = torch.arange(target.get_output_embeddings().weight.shape[0])
    ids = context(target, tokenizer, args.new_tokens)
    features = tapped_features(target, ids, layer_ids)
    anchors = list(range(ids.shape[1] - args.anchors, ids.shape[1]))
    reference = {a: reference_logits(drafter, target, ids, features, a, draft_ids) for a in anchors}

    report: dict = {"context_tokens": int(ids.shape[1]), "anchors": anchors, "draft_vocab_size": len(draft_ids)}
    ok = True

    ours = load_speculators(args.speculators, args.target)
    served = {a: speculators_logits(ours, ids, features, a)[1:] for a in anchors}
    diff = max((served[a] - reference[a][1:]).abs().max().item() for a in anchors)
    same = all(torch.equal(served[a].argmax(-1), reference[a][1:].argmax(-1)) for a in anchors)
    report["speculators_export"] = {"max_abs_logit_diff": diff, "same_drafted_tokens": same}
    ok &= diff <= args.atol and same

    with tempfile.TemporaryDirectory() as tmp:
        converted_dir = Path(tmp) / "converted"
        DFlashConverter().convert(args.official, converted_dir, base_model=args.target, validate=False)
        converted_config = json.loads((converted_dir / "config.json").read_text())
        converted = load_speculators(converted_dir, args.target)
        rows = [speculators_logits(converted, ids, features, a) for a in anchors]
    diff = max((row[:, draft_ids] - reference[a])[1:].abs().max().item() for row, a in zip(rows, anchors))
    slots = sum(row[1:].shape[0] for row in rows)
    changed = sum(
        int((row[1:].argmax(-1) != draft_ids[reference[a][1:].argmax(-1)]).sum()) for row, a in zip(rows, anchors)
    )
    report["converted_official_export"] = {
        "draft_vocab_size": converted_config.get("draft_vocab_size"),
        "has_d2t": "d2t" in converted.state_dict() and converted.d2t is not None,
        "max_abs_logit_diff_over_draft_tokens": diff,
        "slots_drafting_another_token": f"{changed} of {slots}",
    }
    ok &= diff <= args.atol
    print(json.dumps(report, indent=1))
    print("OK: speculators reads the exports as the drafter dflash-hf runs" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

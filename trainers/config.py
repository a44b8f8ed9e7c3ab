"""`DFlashTrainingConfig`: training arguments of a DFlash drafter.

Like TRL's trainer configs (`SFTConfig`, `DPOConfig`, ...) it is a dataclass extending
`transformers.TrainingArguments`: every Trainer option (batch size, accumulation, checkpointing, `bf16`, `seed`,
`resume_from_checkpoint`, ...) works unchanged, the recipe-specific fields are added, and the defaults follow the
DFlash paper (AdamW, lr 6e-4, cosine schedule, warmup 4%, grad clip 1.0, 6 epochs, max length 3072, 5 draft layers,
5 target taps, 512 anchors per sequence, B = 16).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

from ..fileio import shard_size_bytes
from .metrics import LOSS_WEIGHTINGS, default_loss_decay_gamma

FEATURE_MODES = ("online", "offline")
ATTENTION_BACKENDS = ("auto", "flex_attention", "sdpa", "eager")
HARD_LABELS = ("data", "target")


@dataclass
class DFlashTrainingConfig(TrainingArguments):
    r"""
    Configuration of [`DFlashTrainer`]. Only the DFlash-specific parameters are listed, by group; see
    [`~transformers.TrainingArguments`] for the rest. A parameter with a fixed set of values lists them as `choices` in
    its field's metadata (the command line refuses others).

    Defaults that differ from [`~transformers.TrainingArguments`] (the DFlash paper's recipe): `learning_rate=6e-4`
    (there `5e-5`), `lr_scheduler_type="cosine"` (`"linear"`), `warmup_steps=0.04`, a ratio of the total steps (`0`),
    `num_train_epochs=6` (`3`), `logging_steps=10` (`500`) and `remove_unused_columns=False` (`True`: the collator reads
    the rows' `input_ids` and `loss_mask`); `max_grad_norm` stays `1.0`. With `load_best_model_at_end` or
    `early_stopping_patience` and no `metric_for_best_model`, the best model is the one with the highest
    `acceptance_length_blockwise` (there: the lowest loss).

    Parameters:
        > The drafter's shape

        block_size (`int`, defaults to `16`): Tokens per training block (anchor + `block_size - 1` predicted slots).
            A drafter trained with a larger block generalises down to smaller inference blocks, not up.
        num_draft_layers (`int`, defaults to `5`): Decoder layers of a new drafter.
        target_layer_ids (`list[int]`, *optional*): Target layers tapped for the context feature; by default
            `num_target_features` layers spread over the target (docs/design.md §1).
        num_target_features (`int`, defaults to `5`): Number of taps when `target_layer_ids` is not given.
        mask_token_id (`int`, *optional*): Embedding row used for masked slots; by default the first row past the
            tokenizer's ids, else the last row (`DFlashConfig.from_target`).
        draft_vocab_size (`int`, *optional*): A new drafter drafts over the `draft_vocab_size` most frequent response
            tokens of the training data (see `DFlashConfig.draft_vocab_size`); the loss is then computed over that
            vocabulary and labels outside it count as misses.
        init_from_target (`bool`, defaults to `False`): Start a new drafter's decoder layers from copies of the
            target's top `num_draft_layers` layers (and its final norm), with `fc` selecting the last tapped layer
            and `hidden_norm` set to the first copied layer's input norm, so the first draft layer starts from the
            features it expects. Needs a target whose layers have the drafter's shapes.

        > Loss

        num_anchors (`int`, defaults to `512`): Maximum number of random anchors (blocks) per sequence and step.
        loss_decay_gamma (`float`, *optional*): Slot `k` is weighted by `exp(-(k - 1) / gamma)`. Defaults by block
            size: 7 for B=16, 5 for B=10, 4 for B=8 (see `default_loss_decay_gamma` for other sizes).
        loss_weighting (`str`, defaults to `"exp_decay"`): `exp_decay` weights slots as above; `dpace` weights each
            slot by its effect on the block's expected accepted length under the drafter's current probabilities of
            the labels (D-PACE, see `dflash_hf.trainers.metrics.dpace_slot_weights`); `loss_decay_gamma` is then unused.
        distill_weight (`float`, defaults to `0.0`): Weight of the distillation loss, mixed with the hard-label loss
            as `(1 - w) * CE(label) + w * CE(teacher)`: for slot `k` the teacher is the target's own next-token
            distribution at position `anchor + k - 1` (its final hidden state through the frozen LM head, over the
            draft vocabulary). Needs features cached with final hidden states, or online features. With `w > 0`
            every position of teacher-forced text is useful supervision, not only target-generated responses.
        tv_weight (`float`, defaults to `0.0`): Weight `t` of the total variation distance between the drafter's and
            the target's next-token distributions (the loss of DSpark's trainer; `1 - TV` is speculative sampling's
            acceptance chance), mixed as `(1 - w - t) * CE(label) + w * CE(teacher) + t * TV`; DeepSpec trains with
            0.1 CE + 0.9 TV. Needs the same final hidden states as distillation.
        hard_labels (`str`, defaults to `"data"`): The hard label of each slot: `"data"` the dataset's next token, or
            `"target"` the target's own most likely next token there (the argmax of the distillation teacher, over the
            draft vocabulary), which is what greedy verification accepts. On target-regenerated data the two agree; on
            teacher-forced data (`make-data --responses source`) only `"target"` teaches the target's choices. Needs
            the same final hidden states as distillation.

        > Data and features

        features (`str`, defaults to `"online"`): `"online"` runs the frozen target each step; `"offline"` reads
            features stored by `dflash-hf cache-features` from `features_dir`.
        features_dir (`str`, *optional*): Folder written by `dflash-hf cache-features` (offline features).
        max_length (`int`, defaults to `3072`): Sequences are truncated to this many tokens.
        max_train_samples (`int`, *optional*): Train on the first N rows of the training data only (ablations on a
            subset of a cached dataset); counted from `skip_train_samples`. Offline features need to cover only
            these rows, so a run can start while `cache-features` is still working through the rest.
        skip_train_samples (`int`, defaults to `0`): Leave out the first N rows of the training data: continue a
            drafter on the rows a grown make-data folder added since its last stage (offline features stay aligned).
        loss_chunk_size (`int`, *optional*): Labelled slots scored at once: the LM head's logits of a chunk (and the
            teacher's distribution there) live together, and with several chunks each is recomputed in the backward
            pass, so the loss holds `chunk x vocabulary` values instead of every slot's (a Qwen3-8B-sized vocabulary
            and 512 anchors of 16 slots: about 4.7 GB of float32 logits per row, several times over in the loss).
            Default: chunks of at most 2**28 logits on GPU, every slot at once on CPU; `0`: every slot at once. A
            Markov head's correction, the drafter's own output over every slot, stays whole.
        attention_backend (`str`, defaults to `"auto"`): Drafter attention during training: `"flex_attention"`
            (sparse block mask; the default on GPU), `"sdpa"` with a dense boolean mask (the default on CPU, where
            flex attention has no backward) or `"eager"`.

        > Markov head

        markov_rank (`int`, *optional*): Give the drafter a Markov head of this rank (DSpark's; see
            `DFlashConfig.markov_rank`): a new drafter, or a loaded one without a head (its new head starts at zero, so
            training starts from the drafter's own drafts). A loaded drafter's existing head must match it.
        markov_gated (`bool`, defaults to `False`): The new Markov head is the gated variant (`DFlashConfig.markov_gated`).
        markov_loss_weight (`float`, defaults to `1.0`): With a Markov head each labelled slot's loss is
            `(1 - w) * CE(backbone logits) + w * CE(corrected logits)` (each CE mixed with distillation and taken on
            the hard labels as above), then weighted by the slot weights. The corrected logits are the backbone's plus
            the head's correction for the *true* previous token of the slot (teacher forcing: the token at
            `anchor + k - 1` for slot `k`, the anchor for slot 1). `w = 1` trains on what the engine drafts from;
            `w < 1` also keeps the backbone a good drafter on its own (for readers that ignore the head, such as
            Transformers' native path). The logged accuracies and acceptance lengths, and D-PACE's weights, come from
            the corrected logits.
        freeze_backbone (`bool`, defaults to `False`): Train the Markov head only; the drafter's backbone (`fc`,
            `hidden_norm`, layers, `norm`) stays as loaded. Needs a Markov head (`markov_rank`).
        markov_learning_rate (`float`, *optional*): Peak learning rate of the Markov head (`markov_head.*`), on the
            same schedule as `learning_rate`, which then drives the backbone only (with `freeze_backbone` this is the
            one rate that applies); defaults to `learning_rate`. A joint run onto a trained drafter gives the new head
            (starting at zero) a higher rate than the backbone keeps. The head is optimised by the Trainer's optimizer
            (AdamW by default), and by AdamW under `muon` (`markov_w1` is an embedding table).

        > DFlash 2

        dflash2 (`bool`, defaults to `False`): Train a DFlash 2 drafter (`DFlashConfig.conv_kernel_size`): a new
            drafter, or a loaded DFlash drafter, is given a dynamic convolution around every sub-layer and a candidate
            selector (`DFlashDraftModel.add_dflash2`) that start as an exact no-op (identity convolutions, a zero
            successor codebook): a trained DFlash drafter is the warm start. A loaded DFlash 2 drafter trains as it is.
        conv_kernel_size, conv_group_size, selector_rank, selector_top_k (`int`, defaults `2`, `16`, `256`, `16`): The
            new DFlash 2 parts' sizes (the published DFlash 2 drafters'); a loaded DFlash 2 drafter keeps its own.
        selector_loss_weight (`float`, defaults to `1.0`): Each labelled slot's loss adds this times the selector's
            teacher-forced `K`-way cross-entropy over the slot's top-`K` draft logits (its true previous token as the
            predecessor); a label outside the top `K` adds nothing.
        selector_learning_rate (`float`, *optional*): Peak learning rate of the candidate selector
            (`candidate_selector.*`), on `learning_rate`'s schedule; defaults to `learning_rate`. A warm start gives
            the new selector (its successor codebook starts at zero) a higher rate than the trained body keeps. The
            selector is optimised by the Trainer's optimizer, and by AdamW under `muon` (its codebooks are embedding
            tables).

        > Optimisation

        muon (`bool`, defaults to `False`): Optimise the drafter's 2-D weight matrices with `torch.optim.Muon`
            (learning rate matched to AdamW's update RMS) and the rest (norms, a Markov head) with AdamW. With
            `freeze_backbone` no backbone matrix trains, so the head gets the Trainer's optimizer.
        early_stopping_patience (`int`, *optional*): Stop when the evaluation metric (`metric_for_best_model`, by
            default the held-out blockwise acceptance length) has not improved for this many evaluations.

        > Runs on a lent machine

        max_train_seconds (`float`, *optional*): End the training loop within this many seconds of its start: after
            each step, stop (saving a checkpoint unless `save_strategy="no"`) when the mean step so far would end past
            the limit (`trainers/time_limit.py`). The training command then exports the drafter as after any run, so
            a machine held for a fixed time returns trained weights, and `--resume_from_checkpoint last` continues.
            Loading before and the export after are outside the limit.
        max_shard_size (`str`, *optional*): Largest weight file of the drafter in checkpoints and in the final export
            (`save_pretrained`'s `max_shard_size`, e.g. `"15MB"`): weights above it are written as
            `model-0000k-of-0000n.safetensors` shards with an index, which every loader of a drafter folder reads.
            By default `save_pretrained`'s. Optimizer states are not sharded (`save_only_model` leaves them out).

    Evaluation: with an `eval_dataset` every evaluation uses *all* valid anchors of each held-out sequence
    (deterministic) and logs `eval_acceptance_length_blockwise` (mean longest correct prefix + 1 per block, what
    greedy verification accepts) and `eval_accuracy_slot_k`. With `load_best_model_at_end=True` the best checkpoint by
    `metric_for_best_model` (default: `acceptance_length_blockwise`, higher is better) is the one kept and exported.
    """

    # The drafter's shape
    block_size: int = field(default=16, metadata={"help": "Tokens per training block (anchor + block_size - 1 slots)."})
    num_draft_layers: int = field(default=5, metadata={"help": "Decoder layers of a new drafter."})
    target_layer_ids: list[int] | None = field(
        default=None, metadata={"help": "Target layers tapped for the context feature (default: spread)."}
    )
    num_target_features: int = field(default=5, metadata={"help": "Number of taps when target_layer_ids is unset."})
    mask_token_id: int | None = field(default=None, metadata={"help": "Embedding row used for masked slots."})
    draft_vocab_size: int | None = field(
        default=None,
        metadata={
            "help": "New drafter drafts over the N most frequent response tokens of the training data (cheaper draft "
            "LM head and loss); default: the full vocabulary."
        },
    )
    init_from_target: bool = field(
        default=False, metadata={"help": "Initialise a new drafter's layers from the target's top layers."}
    )

    # Loss
    num_anchors: int = field(default=512, metadata={"help": "Maximum random anchors (blocks) per sequence."})
    loss_decay_gamma: float | None = field(
        default=None,
        metadata={"help": "Slot k loss weight exp(-(k-1)/gamma). Default by block size: 16->7, 10->5, 8->4."},
    )
    loss_weighting: str = field(
        default="exp_decay",
        metadata={
            "help": "How block slots are weighted in the loss: exp_decay (exp(-(k-1)/gamma)) or dpace (each slot's "
            "effect on the block's expected accepted length under the drafter's current probabilities, D-PACE).",
            "choices": list(LOSS_WEIGHTINGS),
        },
    )
    distill_weight: float = field(
        default=0.0,
        metadata={"help": "Distillation weight w: (1-w) * CE(label) + w * CE(target's next-token distribution)."},
    )
    tv_weight: float = field(
        default=0.0,
        metadata={
            "help": "Total-variation weight t (DSpark's loss; DeepSpec mixes 0.1 CE + 0.9 TV): "
            "(1-w-t) * CE(label) + w * CE(target) + t * TV(drafter, target)."
        },
    )
    hard_labels: str = field(
        default="data",
        metadata={
            "help": "'data' (the dataset's next token) or 'target' (the target's argmax: for teacher-forced data).",
            "choices": list(HARD_LABELS),
        },
    )

    # Data and features
    features: str = field(
        default="online",
        metadata={
            "help": "'online' (target forward each step) or 'offline' (cached features).",
            "choices": list(FEATURE_MODES),
        },
    )
    features_dir: str | None = field(default=None, metadata={"help": "Folder written by `dflash-hf cache-features`."})
    max_length: int = field(default=3072, metadata={"help": "Truncate sequences to this many tokens."})
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Train on the first N rows of the training data only."}
    )
    skip_train_samples: int = field(
        default=0, metadata={"help": "Leave out the first N rows (train on the rows a grown data folder added)."}
    )
    loss_chunk_size: int | None = field(
        default=None,
        metadata={
            "help": "Labelled slots scored at once (their LM-head logits and losses), each chunk recomputed in the "
            "backward pass: the loss holds chunk x vocabulary logits, not every slot's. Default: chunks of at most "
            "2**28 logits on GPU, every slot at once on CPU; 0: every slot at once."
        },
    )
    attention_backend: str = field(
        default="auto",
        metadata={
            "help": "'auto' (flex on GPU, sdpa on CPU), 'flex_attention', 'sdpa' or 'eager'.",
            "choices": list(ATTENTION_BACKENDS),
        },
    )

    # Markov head
    markov_rank: int | None = field(
        default=None,
        metadata={"help": "Give the drafter a Markov head of this rank (DSpark's; new or headless drafter)."},
    )
    markov_gated: bool = field(default=False, metadata={"help": "The new Markov head is the gated variant."})
    markov_loss_weight: float = field(
        default=1.0,
        metadata={"help": "w in (1-w) * CE(backbone logits) + w * CE(logits corrected by the Markov head)."},
    )
    freeze_backbone: bool = field(
        default=False, metadata={"help": "Train only the Markov head; the drafter's backbone stays as loaded."}
    )
    markov_learning_rate: float | None = field(
        default=None,
        metadata={"help": "Peak learning rate of the Markov head (default: learning_rate, which drives the rest)."},
    )

    # DFlash 2
    dflash2: bool = field(
        default=False,
        metadata={
            "help": "Train a DFlash 2 drafter: convolutions and a candidate selector added to a new or DFlash one."
        },
    )
    conv_kernel_size: int = field(default=2, metadata={"help": "DFlash 2: taps of the dynamic convolutions."})
    conv_group_size: int = field(default=16, metadata={"help": "DFlash 2: channels per dynamic-kernel group."})
    selector_rank: int = field(default=256, metadata={"help": "DFlash 2: rank of the selector's codebooks."})
    selector_top_k: int = field(
        default=16, metadata={"help": "DFlash 2: candidates per slot the selector chooses among."}
    )
    selector_loss_weight: float = field(
        default=1.0,
        metadata={"help": "DFlash 2: weight of the selector's K-way cross-entropy (added to the DFlash loss)."},
    )
    selector_learning_rate: float | None = field(
        default=None,
        metadata={"help": "DFlash 2: peak learning rate of the candidate selector (default: learning_rate)."},
    )

    # Optimisation
    muon: bool = field(default=False, metadata={"help": "torch.optim.Muon for 2-D weights, AdamW for the rest."})
    early_stopping_patience: int | None = field(
        default=None, metadata={"help": "Stop after this many evaluations without improvement of the best metric."}
    )

    # Runs on a lent machine
    max_train_seconds: float | None = field(
        default=None,
        metadata={"help": "Stop (and save) before the step that would end this many seconds after training began."},
    )
    max_shard_size: str | None = field(
        default=None,
        metadata={"help": "Largest weight file of checkpoints and of the final export (e.g. 15MB)."},
    )

    # Defaults of the inherited Trainer options (the paper's recipe)
    learning_rate: float = field(default=6e-4, metadata={"help": "Peak AdamW learning rate."})
    lr_scheduler_type: str = field(default="cosine", metadata={"help": "Learning-rate schedule."})
    warmup_steps: float = field(
        default=0.04, metadata={"help": "Warmup steps (an int) or a ratio of the total steps (a float < 1)."}
    )
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm."})
    num_train_epochs: float = field(default=6.0, metadata={"help": "Training epochs."})
    logging_steps: float = field(default=10, metadata={"help": "Log every X update steps."})
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Keep dataset columns (the collator needs input_ids and loss_mask)."}
    )

    def __post_init__(self):
        if int(self.block_size) < 2:
            raise ValueError(
                f"block_size must be >= 2 (an anchor plus at least one predicted slot), got {self.block_size}."
            )
        if int(self.num_anchors) < 1:
            raise ValueError(f"num_anchors must be >= 1, got {self.num_anchors}.")
        if int(self.max_length) < int(self.block_size) + 1:
            raise ValueError(
                f"max_length ({self.max_length}) must exceed block_size ({self.block_size}): a sequence needs room for "
                "at least one prompt token and one whole block."
            )
        if self.max_train_seconds is not None and not float(self.max_train_seconds) > 0:
            raise ValueError(f"max_train_seconds must be > 0 (seconds), got {self.max_train_seconds}.")
        if self.max_shard_size is not None:
            shard_size_bytes(self.max_shard_size, "max_shard_size")
        if self.features not in FEATURE_MODES:
            raise ValueError(f"features must be one of {FEATURE_MODES}, got {self.features!r}.")
        if self.features == "offline" and not self.features_dir:
            raise ValueError(
                "features='offline' needs features_dir: run `dflash-hf cache-features --target T --data D --out F` "
                "first and pass --features_dir F (or use features='online')."
            )
        if self.loss_chunk_size is not None and int(self.loss_chunk_size) < 0:
            raise ValueError(f"loss_chunk_size must be >= 0 (0: every slot at once), got {self.loss_chunk_size}.")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}.")
        if self.loss_weighting not in LOSS_WEIGHTINGS:
            raise ValueError(
                f"loss_weighting must be one of {LOSS_WEIGHTINGS}, got {self.loss_weighting!r}: exp_decay weights slot k "
                "by exp(-(k-1)/gamma), dpace by its effect on the expected accepted length."
            )
        if self.loss_decay_gamma is None:
            self.loss_decay_gamma = default_loss_decay_gamma(self.block_size)
        elif float(self.loss_decay_gamma) <= 0:
            raise ValueError(f"loss_decay_gamma must be > 0, got {self.loss_decay_gamma}.")
        if self.target_layer_ids is not None:
            self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if not 0.0 <= float(self.distill_weight) <= 1.0:
            raise ValueError(f"distill_weight must be in [0, 1], got {self.distill_weight}.")
        if not 0.0 <= float(self.tv_weight) <= 1.0 - float(self.distill_weight) + 1e-9:  # 0.8 + 0.2 is 1
            raise ValueError(
                f"tv_weight must be in [0, 1 - distill_weight] = [0, {1.0 - float(self.distill_weight)}], got "
                f"{self.tv_weight}: the hard-label weight 1 - distill_weight - tv_weight cannot be negative."
            )
        if self.hard_labels not in HARD_LABELS:
            raise ValueError(
                f"hard_labels must be one of {HARD_LABELS}, got {self.hard_labels!r}: 'data' trains on the dataset's "
                "next token, 'target' on the target's own most likely token."
            )
        self._check_drafter_heads()
        if self.max_train_samples is not None and int(self.max_train_samples) < 1:
            raise ValueError(f"max_train_samples must be >= 1, got {self.max_train_samples}.")
        if int(self.skip_train_samples) < 0:
            raise ValueError(f"skip_train_samples must be >= 0, got {self.skip_train_samples}.")
        if self.early_stopping_patience is not None and int(self.early_stopping_patience) < 1:
            raise ValueError(f"early_stopping_patience must be >= 1, got {self.early_stopping_patience}.")
        if (self.load_best_model_at_end or self.early_stopping_patience) and self.metric_for_best_model is None:
            self.metric_for_best_model = "acceptance_length_blockwise"
            self.greater_is_better = True
        super().__post_init__()

    def _check_drafter_heads(self) -> None:
        """The settings of a Markov head and of DFlash 2's selector: in range, and not both."""
        if self.markov_rank is not None and int(self.markov_rank) < 1:
            raise ValueError(
                f"markov_rank must be >= 1 (DSpark uses 256), got {self.markov_rank}; omit it for no head."
            )
        if self.markov_gated and self.markov_rank is None:
            raise ValueError("markov_gated describes a new Markov head: give its rank too (--markov_rank R).")
        if not 0.0 <= float(self.markov_loss_weight) <= 1.0:
            raise ValueError(f"markov_loss_weight must be in [0, 1], got {self.markov_loss_weight}.")
        if self.freeze_backbone and float(self.markov_loss_weight) == 0.0:
            raise ValueError(
                "freeze_backbone trains only the Markov head, which markov_loss_weight=0 leaves out of the loss: "
                "raise markov_loss_weight (1.0 trains the head on its corrected logits)."
            )
        if not float(self.selector_loss_weight) >= 0.0:
            raise ValueError(f"selector_loss_weight must be >= 0, got {self.selector_loss_weight}.")
        if self.selector_learning_rate is not None and not float(self.selector_learning_rate) > 0:
            raise ValueError(
                f"selector_learning_rate must be > 0, got {self.selector_learning_rate}; omit it for learning_rate."
            )
        if self.dflash2 and self.markov_rank is not None:
            raise ValueError("A DFlash 2 drafter has a candidate selector, not a Markov head: drop --markov_rank.")
        if self.markov_learning_rate is not None and float(self.markov_learning_rate) <= 0:
            raise ValueError(
                f"markov_learning_rate must be > 0, got {self.markov_learning_rate}; omit it for learning_rate."
            )

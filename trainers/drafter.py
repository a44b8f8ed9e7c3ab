"""The drafter `DFlashTrainer` trains: loaded from a path, or built from the target; checked against the training
config; given the Markov head or the DFlash 2 parts the config asks for; its backbone frozen when only the head
trains."""

from __future__ import annotations

import torch
from dflash_hf.modeling import DFlashConfig, DFlashDraftModel
from transformers import PreTrainedModel, set_seed
from transformers.utils import logging

from .config import DFlashTrainingConfig
from .initialisation import initialise_from_target
from .vocabulary import frequent_response_tokens

logger = logging.get_logger(__name__)


def resolve_drafter(
    model: DFlashDraftModel | str | None,
    args: DFlashTrainingConfig,
    target: PreTrainedModel,
    train_dataset,
    processing_class,
) -> tuple[DFlashDraftModel, float | None]:
    """The drafter to train: loaded from a path (fp32 master weights whatever its saved dtype), or a new one built from
    the target ([`new_drafter`]); checked against `args` and given the Markov head `args` asks for. Also returns the
    new reduced vocabulary's coverage of the training response tokens (else `None`). Every random initialisation here
    (a new drafter, a new Markov head) follows `args.seed`."""
    set_seed(args.seed)  # the Trainer seeds only once it has the model: what is initialised here must follow it too
    coverage = None
    if isinstance(model, str):
        model = DFlashDraftModel.from_pretrained(model, dtype=torch.float32)
    if model is None:
        model, coverage = new_drafter(args, target, train_dataset, processing_class)
    if not isinstance(model, DFlashDraftModel):
        raise ValueError(f"model must be a DFlashDraftModel (or a path to one), got {type(model).__name__}.")
    if int(model.config.block_size) != int(args.block_size):
        raise ValueError(
            f"The drafter was built for block_size {model.config.block_size} but the training config says "
            f"{args.block_size}: pass --block_size {model.config.block_size} (or start a new drafter)."
        )
    if args.target_layer_ids is not None and list(args.target_layer_ids) != list(model.config.target_layer_ids):
        raise ValueError(
            f"The drafter taps target layers {model.config.target_layer_ids} but the training config says "
            f"{args.target_layer_ids}: drop --target_layer_ids or start a new drafter."
        )
    give_markov_head(model, args)
    give_dflash2(model, args)
    return model, coverage


def new_drafter(
    args: DFlashTrainingConfig, target: PreTrainedModel, train_dataset, processing_class
) -> tuple[DFlashDraftModel, float | None]:
    """A new drafter for `target` in the shape `args` gives (`DFlashConfig.from_target`), optionally initialised from
    the target's top layers, with the reduced draft vocabulary of `args.draft_vocab_size` (then also its coverage of
    the training response tokens, else `None`)."""
    model = DFlashDraftModel(
        DFlashConfig.from_target(
            target.config,
            num_hidden_layers=args.num_draft_layers,
            block_size=args.block_size,
            num_target_features=args.num_target_features,
            mask_token_id=args.mask_token_id,
            target_layer_ids=args.target_layer_ids,
            tokenizer=processing_class,
            draft_vocab_size=args.draft_vocab_size,
            markov_rank=args.markov_rank or 0,
            markov_gated=args.markov_gated,
        )
    )
    if args.init_from_target:
        copied = initialise_from_target(model, target)
        logger.info(f"Drafter layers initialised from target layers {copied}.")
    if args.draft_vocab_size is None:
        return model, None
    if train_dataset is None:
        raise ValueError("draft_vocab_size needs the training data to choose the most frequent tokens.")
    vocab_size = int(target.get_input_embeddings().weight.shape[0])
    vocabulary = frequent_response_tokens(train_dataset, args.draft_vocab_size, vocab_size)
    model.set_draft_vocabulary(vocabulary.token_ids)
    logger.info(
        f"Draft vocabulary: the {args.draft_vocab_size} most frequent response tokens of {vocab_size}, "
        f"covering {vocabulary.coverage:.2%} of the training response tokens."
    )
    return model, vocabulary.coverage


def give_markov_head(model: DFlashDraftModel, args: DFlashTrainingConfig) -> None:
    """Add the Markov head `args` asks for to a drafter without one; refuse a drafter whose head differs."""
    if args.markov_rank is None:
        return
    wanted = (int(args.markov_rank), bool(args.markov_gated))
    if model.markov_head is None:
        model.add_markov_head(*wanted)
        logger.info(f"New Markov head of rank {wanted[0]} ({'gated' if wanted[1] else 'vanilla'}), starting at zero.")
    elif (int(model.config.markov_rank), bool(model.config.markov_gated)) != wanted:
        raise ValueError(
            f"The drafter has a Markov head of rank {model.config.markov_rank} (gated: {model.config.markov_gated}) but "
            f"the training config asks for rank {wanted[0]} (gated: {wanted[1]}): drop --markov_rank / --markov_gated "
            "to train the drafter's own head."
        )


def give_dflash2(model: DFlashDraftModel, args: DFlashTrainingConfig) -> None:
    """Make a DFlash drafter the DFlash 2 drafter `args.dflash2` asks for (an exact no-op at the start)."""
    if not args.dflash2 or model.config.is_dflash2:
        return
    model.add_dflash2(args.conv_kernel_size, args.conv_group_size, args.selector_rank, args.selector_top_k)
    logger.info(
        f"DFlash 2: convolutions of {args.conv_kernel_size} taps in groups of {args.conv_group_size}, a selector of rank "
        f"{args.selector_rank} over the top {args.selector_top_k}, starting as the drafter's own drafts."
    )


def freeze_backbone(model: DFlashDraftModel) -> None:
    """Leave only the Markov head trainable."""
    if model.markov_head is None:
        raise ValueError(
            "freeze_backbone trains only the Markov head, and this drafter has none: add one with --markov_rank R "
            "(DSpark uses 256)."
        )
    model.requires_grad_(False)
    model.markov_head.requires_grad_(True)

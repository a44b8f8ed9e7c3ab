"""DFlash training (installed as `dflash_hf.trainers`).

>>> from dflash_hf.trainers import DFlashTrainer, DFlashTrainingConfig
>>> args = DFlashTrainingConfig(output_dir="drafter", block_size=16, num_anchors=512)
>>> trainer = DFlashTrainer(args=args, target=target, train_dataset=dataset, processing_class=tokenizer)
>>> trainer.train()
"""

from .collator import DFlashDataCollator
from .config import DFlashTrainingConfig
from .masks import block_attention_mask, build_blocks, flex_block_mask, sample_anchors
from .metrics import (
    LOSS_WEIGHTINGS,
    accepted_drafts,
    decoding_walk,
    default_loss_decay_gamma,
    dpace_slot_weights,
    implied_acceptance_length,
    slot_loss_weights,
)
from .trainer import DFlashTrainer

__all__ = [
    "DFlashDataCollator",
    "DFlashTrainer",
    "DFlashTrainingConfig",
    "LOSS_WEIGHTINGS",
    "accepted_drafts",
    "block_attention_mask",
    "build_blocks",
    "default_loss_decay_gamma",
    "dpace_slot_weights",
    "flex_block_mask",
    "decoding_walk",
    "implied_acceptance_length",
    "sample_anchors",
    "slot_loss_weights",
]

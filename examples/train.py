"""Train a DFlash drafter: the same code path as `dflash-hf train`, ready for `accelerate launch`.

    accelerate launch --num_processes 2 examples/train.py --target smollm2-135m --data data/smollm2 \\
        --output_dir runs/smollm2 --block_size 16 --num_draft_layers 3 --num_anchors 256

All `DFlashTrainingConfig` / `TrainingArguments` flags apply; see `dflash-hf train --help`.
"""

import sys

from dflash_hf.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))

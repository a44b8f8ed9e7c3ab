"""Sub-commands of the `dflash-hf` CLI (see `dflash_hf.cli`)."""

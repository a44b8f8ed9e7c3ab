"""Validate an exported drafter folder and publish it on the Hugging Face Hub.

    >>> files = dflash_hf.validate_hub_folder("out/my-drafter")            # no network
    >>> url = dflash_hf.push_to_hub("out/my-drafter", "me/my-dflash-drafter")

Uploads go through `huggingface_hub` (`create_repo` + `upload_folder`) with the token from the usual Hugging Face
environment (`HF_TOKEN`) or login (`hf auth login`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import HfApi, get_token, is_offline_mode, metadata_load
from safetensors import SafetensorError, safe_open
from transformers.utils import logging as transformers_logging

from ..drafters import CONFIG_NAME, check_weights, read_config_dict, weight_files
from ..fileio import PICKLE_SUFFIXES
from ..modeling import DFlashDraftModel
from .layout import format_of, layout_problems
from .speculators import check_speculators_folder

# front-matter keys every exported card carries
REQUIRED_CARD_KEYS = ("base_model", "library_name", "pipeline_tag", "tags")
# the largest config.json published: an export writes a few KB, whatever the drafter's size
MAX_CONFIG_BYTES = 2**20


@dataclass(frozen=True)
class HubFile:
    """One file of a folder to upload: its path relative to the folder and its size in bytes."""

    path: str
    size: int


def _folder_files(folder: Path) -> list[HubFile]:
    """Every regular file under `folder`, hidden files and folders excluded (`upload_folder` gets exactly these);
    a `ValueError` for a link among them, whose target, anywhere, would be uploaded."""
    files, links = [], []
    for root, folders, names in os.walk(folder):
        folders[:] = [name for name in folders if not name.startswith(".")]
        for name in sorted(name for name in [*folders, *names] if not name.startswith(".")):
            path = Path(root) / name
            relative = path.relative_to(folder).as_posix()
            if path.is_symlink():
                links.append(relative)
            elif path.is_file():
                files.append(HubFile(relative, path.stat().st_size))
    if links:
        raise ValueError(
            f"{folder} holds links ({', '.join(sorted(links))}): the files they point at, wherever they are, would be "
            "uploaded. Replace them by the files themselves, or re-export the drafter with `dflash-hf export`."
        )
    return sorted(files, key=lambda file: file.path)


def validate_hub_folder(folder: str | os.PathLike) -> list[HubFile]:
    """Check that `folder` is a complete, loadable DFlash drafter, exactly as `dflash-hf export` writes it, and
    return the files to upload.

    Checks, without network: no links and no pickled weights; `config.json` is at most `MAX_CONFIG_BYTES` and a
    DFlash config (dflash-hf, official or speculators layout) whose sizes are integers; the folder holds exactly the
    files an export of that layout writes (no other file, Python or not), with exactly its `architectures`,
    `auto_map` and remote code byte-identical to this package's (whoever loads the drafter with
    `trust_remote_code=True` runs it); a weight index names only shards inside the folder; the safetensors weights
    are floating point, finite (no NaN or infinity) and match the config exactly (loaded strictly with
    [`DFlashDraftModel.from_pretrained`], or checked tensor by tensor for the speculators layout);
    `README.md` has YAML front matter with `base_model`, `library_name`, `pipeline_tag` and `tags`. Raises
    `ValueError` (or `FileNotFoundError`) naming every difference found.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder; export a drafter first with `dflash-hf export`.")
    files = _folder_files(folder)
    names = {file.path for file in files}
    pickles = sorted(name for name in names if name.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise ValueError(
            f"{folder} contains pickled weights ({', '.join(pickles)}); only safetensors are published. Remove them "
            "or re-export the drafter with `dflash-hf export`."
        )
    if CONFIG_NAME not in names:
        raise ValueError(f"{folder} has no config.json; export the drafter with `dflash-hf export`.")
    _check_config_size(folder, next(file.size for file in files if file.path == CONFIG_NAME))
    for name in sorted(name for name in names if name.endswith(".safetensors")):
        try:
            with safe_open(folder / name, framework="pt"):
                pass
        except SafetensorError as err:
            message = f"{folder / name} is not a readable safetensors file ({err}); re-export the drafter."
            raise ValueError(message) from err
    config_dict = read_config_dict(folder)
    format = format_of(config_dict)
    if format is None:
        raise ValueError(
            f"{folder}/config.json is no DFlash drafter config (model_type {config_dict.get('model_type')!r}); "
            "export the drafter with `dflash-hf export`."
        )
    weights = weight_files(folder)
    problems = layout_problems(folder, format, config_dict, names, weights)
    if problems:
        raise ValueError(
            f"{folder} is not what `dflash-hf export --format {format}` writes: {'; '.join(problems)}. Whoever loads "
            "it with trust_remote_code=True runs its Python files: re-export the drafter with `dflash-hf export`."
        )
    check_weights(folder, weights)
    _check_finite(folder, weights)
    if format == "speculators":
        check_speculators_folder(folder)
    else:
        progress_bar = transformers_logging.is_progress_bar_enabled()
        transformers_logging.disable_progress_bar()
        try:
            DFlashDraftModel.from_pretrained(folder)
        finally:
            if progress_bar:
                transformers_logging.enable_progress_bar()
    _check_card(folder, names)
    return files


def _check_config_size(folder: Path, size: int) -> None:
    """Raise a `ValueError` when the `config.json` of `folder` (`size` bytes) is larger than any export writes."""
    if size > MAX_CONFIG_BYTES:
        raise ValueError(
            f"{folder}/config.json is {size:,d} bytes, more than the {MAX_CONFIG_BYTES:,d} bytes a drafter config may "
            "have (an export writes a few KB): remove what was added to it, or re-export the drafter with "
            "`dflash-hf export`."
        )


def _check_finite(folder: Path, weights: list[str]) -> None:
    """Raise a `ValueError` naming the first floating-point tensor of the safetensors files `weights` (relative to
    `folder`) that holds a NaN or an infinity: such a drafter proposes nothing a target accepts."""
    for name in weights:
        with safe_open(folder / name, framework="pt") as handle:
            for key in handle.keys():
                tensor = handle.get_tensor(key)
                if not tensor.is_floating_point():
                    continue
                # torch has no `isfinite` for every 8-bit float: check those as float32
                values = tensor.float() if tensor.element_size() == 1 else tensor
                bad = int((~torch.isfinite(values)).sum())
                if bad:
                    raise ValueError(
                        f"{folder / name}: tensor `{key}` holds {bad:,d} NaN or infinite values (training diverged, "
                        "or the file was damaged): publish a checkpoint whose weights are all finite, e.g. an earlier "
                        "one, or retrain with a lower learning rate."
                    )


def _check_card(folder: Path, names: set[str]) -> None:
    """Raise a `ValueError` unless `folder` has a `README.md` card with the required front matter."""
    if "README.md" not in names:
        raise ValueError(f"{folder} has no README.md model card; export the drafter with `dflash-hf export`.")
    card = metadata_load(folder / "README.md") or {}
    missing = [key for key in REQUIRED_CARD_KEYS if not card.get(key)]
    if missing:
        raise ValueError(
            f"{folder}/README.md lacks YAML front matter keys {', '.join(missing)}; re-export it with "
            "`dflash-hf export`."
        )


def push_to_hub(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    token: str | None = None,
    commit_message: str = "Upload DFlash drafter",
) -> str:
    """Validate `folder` and upload it to the model repo `repo_id`, creating the repo (and branch) if needed.

    Raises `ValueError` before any network call when the folder is invalid, offline mode is on (`HF_HUB_OFFLINE`)
    or no token is available. Returns the URL of the commit.
    """
    files = validate_hub_folder(folder)
    if is_offline_mode():
        raise ValueError(
            "cannot push: Hugging Face offline mode is on (HF_HUB_OFFLINE=1); unset it, or use --dry-run to check."
        )
    token = token or get_token()
    if token is None:
        raise ValueError("cannot push: not logged in to the Hugging Face Hub; run `hf auth login` or set HF_TOKEN.")
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    if revision is not None:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    commit = api.upload_folder(
        repo_id=repo_id,
        folder_path=folder,
        revision=revision,
        allow_patterns=[file.path for file in files],
        commit_message=commit_message,
    )
    return commit.commit_url


__all__ = ["HubFile", "push_to_hub", "validate_hub_folder"]

"""`dflash-hf push`: validate an exported drafter folder and upload it to the Hugging Face Hub."""

from __future__ import annotations

import argparse
import sys

from huggingface_hub.utils import validate_repo_id

from ..hub.push import push_to_hub, validate_hub_folder


def run(args: argparse.Namespace) -> int:
    """Run `push`; returns the exit code."""
    validate_repo_id(args.repo_id)
    if args.dry_run:
        files = validate_hub_folder(args.folder)
        for file in files:
            print(f"{file.size:>14,d}  {file.path}")
        total = sum(file.size for file in files)
        print(
            f"{len(files)} files, {total:,d} bytes: a valid DFlash drafter folder. "
            f"Dry run: nothing uploaded to {args.repo_id}."
        )
        return 0
    try:
        url = push_to_hub(args.folder, args.repo_id, private=args.private, revision=args.revision)
    except ValueError:
        raise
    except Exception as err:  # network, HTTP and permission failures of the Hub client: one line, not a traceback
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"error: push to {args.repo_id} failed ({type(err).__name__}): {message}", file=sys.stderr)
        return 1
    print(f"uploaded {args.folder} to {url}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `push` sub-command to `subparsers`."""
    parser = subparsers.add_parser(
        "push",
        help="upload an exported drafter folder to the Hugging Face Hub",
        description="Validate an exported drafter folder against what `dflash-hf export` writes (exactly its files, "
        "no links, its auto_map, the package's own remote code, weights that load strictly, a card with front "
        "matter) and upload it with huggingface_hub (create_repo + upload_folder). The token comes from HF_TOKEN or "
        "`hf auth login`.",
    )
    parser.add_argument("folder", help="folder written by `dflash-hf export`")
    parser.add_argument("repo_id", help="model repo to create or update, e.g. me/my-dflash-drafter")
    parser.add_argument("--private", action="store_true", help="create the repo as private")
    parser.add_argument("--revision", help="branch to upload to (created if needed)")
    parser.add_argument(
        "--dry-run", action="store_true", help="validate and list the files and sizes to upload, without network"
    )
    parser.set_defaults(func=run)

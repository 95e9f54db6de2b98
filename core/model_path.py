"""Where a model named on the command line or to ``LLM(model=...)`` lies: a local directory, or a
Hugging Face hub id (``Qwen/Qwen3-0.6B``) already in the local Hugging Face cache (HF_HUB_CACHE,
else HF_HOME/hub: ``models--Qwen--Qwen3-0.6B/snapshots/<revision>``). The engine never downloads."""

from __future__ import annotations

from pathlib import Path


def cached_snapshot(model: str) -> str | None:
    """The local cache's snapshot of hub id ``model`` (its main revision), or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return snapshot_download(model, local_files_only=True)
    except (HFValidationError, LocalEntryNotFoundError):
        return None


def missing_model(model: str) -> str:
    """Why ``model`` cannot be found, in one line a user can act on."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        return f"model directory {model} does not exist"
    return (f"{model} is not a model directory, nor a Hugging Face hub id in the local Hugging Face cache "
            f"(HF_HUB_CACHE or HF_HOME). The engine does not download models: fetch it first "
            f"(`hf download {model}`), or pass the directory it is in")


def resolve_model(model: str) -> str:
    """``model`` as a directory: itself, or its snapshot in the local Hugging Face cache; a
    FileNotFoundError saying which it is not otherwise."""
    if Path(model).expanduser().is_dir():
        return model
    snapshot = cached_snapshot(model)
    if snapshot is None:
        raise FileNotFoundError(missing_model(model))
    return snapshot


def served_name(model: str, directory: str) -> str:
    """The name clients use for a model: a hub id as given, else its directory's name."""
    return model if directory != model else Path(directory).name

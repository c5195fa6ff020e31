"""Where a model's files are: a local checkpoint directory, the bundled default, or a Hugging Face
hub id (`Qwen/Qwen3.5-9B`) fetched through huggingface_hub into its cache.

Owns: telling a directory from a hub id, the file patterns a download takes (config, tokenizer,
chat template and safetensors files: nothing else a checkpoint repository holds) and one-line
errors for what a user can fix (offline without a cached copy, no such repository, a gated one).
huggingface_hub keeps its own settings: its cache (HF_HOME, HF_HUB_CACHE), offline mode
(HF_HUB_OFFLINE) and token (HF_TOKEN) apply as they do for transformers and vLLM.
Does not read the files: nextn.config.model, nextn.models.checkpoint and loader, and nextn.tokenizer do.
"""

from __future__ import annotations

import re
from pathlib import Path

from nextn.config import DEFAULT_MODEL_DIR

# what nextn reads of a checkpoint repository: config.json, generation_config.json, tokenizer.json,
# tokenizer_config.json, model.safetensors.index.json, chat_template.jinja and the weights
ALLOW_PATTERNS = ("*.json", "*.jinja", "*.safetensors")
# owner/name, as the hub spells repository ids
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelNotFoundError(ValueError):
    """A model that is neither a local directory nor a hub repository nextn can fetch."""


def is_hub_id(model: str) -> bool:
    """Whether `model` reads as a hub repository id rather than a filesystem path."""
    return bool(_REPO_ID.match(model)) and not model.startswith((".", "~")) and ".." not in model


def resolve_model(model: str | Path | None, revision: str | None = None, download_dir: str | None = None) -> Path:
    """The local directory holding `model`'s files: `model` itself when it is a directory, the
    bundled checkpoint for None, else the snapshot of hub repository `model` (downloaded once,
    then read from the cache). revision (a branch, tag or commit) and download_dir (a cache
    directory instead of huggingface_hub's) are vLLM's and apply to a hub id only."""
    if model is None:
        return DEFAULT_MODEL_DIR
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ModelNotFoundError(f"{model}: not a directory (give the checkpoint's directory)")
    if not is_hub_id(str(model)):
        raise ModelNotFoundError(f"{model}: no such directory")
    return download(str(model), revision, download_dir)


def download(repo_id: str, revision: str | None = None, download_dir: str | None = None) -> Path:
    """The cached snapshot of `repo_id`'s config, tokenizer, template and safetensors files (at
    `revision`, in `download_dir` when given)."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    cache = download_dir or constants.HF_HUB_CACHE
    try:
        return Path(
            huggingface_hub.snapshot_download(
                repo_id, revision=revision, cache_dir=download_dir, allow_patterns=list(ALLOW_PATTERNS)
            )
        )
    except GatedRepoError:
        raise ModelNotFoundError(
            f"{repo_id}: a gated repository; accept its terms on huggingface.co and log in (hf auth login or HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"{repo_id}: no such local directory, and no such Hugging Face repository (or a private one: HF_TOKEN)"
        ) from None
    except LocalEntryNotFoundError as e:
        held = "incomplete in" if type(e).__name__ == "IncompleteSnapshotError" else "not in"
        if constants.HF_HUB_OFFLINE:
            raise ModelNotFoundError(
                f"{repo_id}: {held} the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set; "
                "download it once online (or give a local directory)"
            ) from None
        raise ModelNotFoundError(
            f"{repo_id}: cannot reach the Hugging Face Hub and it is {held} the cache ({cache}); "
            "check the network (or give a local directory)"
        ) from None
    except HfHubHTTPError as e:
        raise ModelNotFoundError(f"{repo_id}: the Hugging Face Hub answered {str(e).splitlines()[0]}") from None

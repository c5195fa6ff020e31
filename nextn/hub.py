"""Where a model's files are: a local checkpoint directory, the bundled default, a GGUF file
(llama.cpp's), a directory holding one, or a Hugging Face hub id (`Qwen/Qwen3.5-9B`; a GGUF file in a
repository as `owner/repo/FILE.gguf`, the file's path in the repository, as huggingface_hub's
`hf://owner/repo/FILE.gguf` paths and llama.cpp's `--hf-repo owner/repo --hf-file FILE.gguf` name it)
fetched through huggingface_hub into its cache.

Owns: telling a directory from a GGUF file from a hub id, the file patterns a download takes (config, tokenizer,
chat template and safetensors files: nothing else a checkpoint repository holds) and one-line
errors for what a user can fix (offline without a cached copy, no such repository, a gated one).
huggingface_hub keeps its own settings: its cache (HF_HOME, HF_HUB_CACHE), offline mode
(HF_HUB_OFFLINE) and token (HF_TOKEN) apply as they do for transformers and vLLM.
Does not read the files: nextn.config.model, nextn.models.checkpoint and loader, and nextn.tokenizer do.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

from nextn.config import DEFAULT_MODEL_DIR

# what nextn reads of a checkpoint repository: config.json, generation_config.json, tokenizer.json,
# tokenizer_config.json, model.safetensors.index.json, chat_template.jinja and the weights
ALLOW_PATTERNS = ("*.json", "*.jinja", "*.safetensors")
# owner/name, as the hub spells repository ids
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# owner/name/path/in/repo/FILE.gguf: one GGUF file of a repository
_HUB_GGUF = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)/(?P<file>(?:[\w.-]+/)*[\w.-]+\.gguf)$", re.IGNORECASE)
# llama.cpp's split files (llama-gguf-split): FILE-00001-of-00003.gguf
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)


class ModelNotFoundError(ValueError):
    """A model that is neither a local directory nor a hub repository nextn can fetch."""


def is_hub_id(model: str) -> bool:
    """Whether `model` reads as a hub repository id rather than a filesystem path."""
    return bool(_REPO_ID.match(model)) and not model.startswith((".", "~")) and ".." not in model


def resolve_model(model: str | Path | None, revision: str | None = None, download_dir: str | None = None) -> Path:
    """Where `model`'s files are: the checkpoint directory `model`, or the GGUF file `model` (or the one
    GGUF file of directory `model` without a config.json), the bundled checkpoint for None, else the
    snapshot of hub repository `model` or its GGUF file `owner/repo/FILE.gguf` (downloaded once, then
    read from the cache). revision (a branch, tag or commit) and download_dir (a cache directory
    instead of huggingface_hub's) are vLLM's and apply to a hub id only."""
    if model is None:
        return DEFAULT_MODEL_DIR
    path = Path(model).expanduser()
    if path.is_dir():
        return path if (path / "config.json").is_file() else _one_gguf(path)
    if path.exists():
        if path.suffix.lower() == ".gguf":
            return _not_split(path)
        raise ModelNotFoundError(f"{model}: not a directory (give the checkpoint's directory, or a .gguf file)")
    hub_file = _HUB_GGUF.match(str(model))
    if hub_file and not str(model).startswith((".", "/", "~")):
        return download_file(hub_file["repo"], hub_file["file"], revision, download_dir)
    if not is_hub_id(str(model)):
        what = "file" if path.suffix.lower() == ".gguf" else "directory"
        raise ModelNotFoundError(f"{model}: no such {what}")
    return download(str(model), revision, download_dir)


def _one_gguf(directory: Path) -> Path:
    """The GGUF file of a directory without a config.json; none or several is a one-line error."""
    files = sorted(directory.glob("*.gguf"), key=lambda p: p.name)
    if len(files) == 1:
        return _not_split(files[0])
    if not files:
        raise ModelNotFoundError(f"{directory}: no config.json (a checkpoint's) and no *.gguf file")
    names = ", ".join(f.name for f in files[:4]) + (", ..." if len(files) > 4 else "")
    raise ModelNotFoundError(f"{directory}: {len(files)} .gguf files ({names}); give the file itself")


def _not_split(path: Path) -> Path:
    if _SPLIT.search(path.name):
        raise ModelNotFoundError(
            f"{path}: one part of a split GGUF; nextn reads one file (join them with llama-gguf-split --merge)"
        )
    return path


def download(repo_id: str, revision: str | None = None, download_dir: str | None = None) -> Path:
    """The cached snapshot of `repo_id`'s config, tokenizer, template and safetensors files (at
    `revision`, in `download_dir` when given)."""
    import huggingface_hub

    with _hub_errors(repo_id, download_dir):
        return Path(
            huggingface_hub.snapshot_download(
                repo_id, revision=revision, cache_dir=download_dir, allow_patterns=list(ALLOW_PATTERNS)
            )
        )


@contextlib.contextmanager
def _hub_errors(repo_id: str, download_dir: str | None):
    """huggingface_hub's errors a user can act on, as one-line ModelNotFoundErrors."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
    )

    cache = download_dir or constants.HF_HUB_CACHE
    try:
        yield
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
    except RemoteEntryNotFoundError:
        raise ModelNotFoundError(f"{repo_id}: the repository has no such file") from None
    except HfHubHTTPError as e:
        raise ModelNotFoundError(f"{repo_id}: the Hugging Face Hub answered {str(e).splitlines()[0]}") from None


def download_file(repo_id: str, filename: str, revision: str | None = None, download_dir: str | None = None) -> Path:
    """The cached copy of GGUF file `filename` of repository `repo_id` (at `revision`, in
    `download_dir` when given)."""
    import huggingface_hub

    _not_split(Path(filename))
    with _hub_errors(f"{repo_id}/{filename}", download_dir):
        return Path(huggingface_hub.hf_hub_download(repo_id, filename, revision=revision, cache_dir=download_dir))

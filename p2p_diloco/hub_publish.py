"""What `p2p-diloco export --push-to-hub REPO` does after the export: the exported folder, as it is, becomes
a model repository on the Hugging Face hub (``HfApi.create_repo``, then ``HfApi.upload_folder``).

The token is huggingface_hub's usual one (``HF_TOKEN``, else the file ``hf auth login`` writes under
``HF_HOME``), read before anything is exported: without one the command stops at once, with one line.
"""

from __future__ import annotations

import os
from typing import Optional


class HubError(ValueError):
    """The hub cannot take the export as asked (no token, a bad repo id, a refused upload); the message is
    one line for the user."""


def _one_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def check_repo_id(repo_id: str) -> None:
    """HubError unless `repo_id` is a hub repository id (NAME or ORG/NAME)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise HubError(f"--push-to-hub {repo_id!r} is not a hub repository id (NAME or ORG/NAME): "
                       f"{_one_line(e)}") from None


def hub_token() -> str:
    """The Hugging Face token this user is logged in with; HubError (one line) when there is none."""
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise HubError("--push-to-hub needs a Hugging Face token with write access: log in with `hf auth login` "
                       "or set HF_TOKEN")
    return token


def push_folder(folder: str | os.PathLike, repo_id: str, private: bool, token: str,
                commit_message: Optional[str] = None) -> str:
    """Create the model repo `repo_id` (private if `private`; an existing repo keeps its visibility) and
    upload every file of `folder` to it in one commit; returns the repo's URL. HubError (one line)
    when the hub refuses or cannot be reached."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(token=token)
    try:
        url = api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        api.upload_folder(folder_path=str(folder), repo_id=url.repo_id, repo_type="model",
                          commit_message=commit_message)
    except (HfHubHTTPError, OSError, ValueError) as e:  # refused (no write access, ...), or no network
        raise HubError(f"--push-to-hub {repo_id}: the upload failed: {_one_line(e)} (the model is exported in "
                       f"{str(folder)!r}; try again with --force)") from None
    return str(url)

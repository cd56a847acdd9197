"""Start-up checks of the commands that run an engine (`onehop engine`, `onehop serve`): the
gateway's (`gateway.serving.preflight`), and the engine's errors and model folder on top."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path

from gateway.serving import preflight
from gateway.serving.preflight import StartupError


def startup_errors(host: str, port: int) -> AbstractContextManager[None]:
    """The gateway's `startup_errors`, also taking the engine's: a backend that cannot load
    the model, an engine config it cannot serve."""
    # Imported here, as the command line's other engine imports: `onehop --help` stays fast.
    from engine.backends.base import BackendError
    from engine.config import ConfigError

    return preflight.startup_errors(host, port, also=(BackendError, ConfigError))


def check_model_folder(path: str) -> None:
    """A model or tokenizer folder given on the command line exists and is a folder."""
    folder = Path(path)
    if not folder.exists():
        raise StartupError(f"the model folder {path} does not exist")
    if not folder.is_dir():
        raise StartupError(f"{path} is not a folder: --model takes a model (or tokenizer) folder")

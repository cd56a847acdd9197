"""The gateway's start-up checks, run before it loads a model or starts a worker
(`onehop.preflight` adds the engine's, for the commands that run one).

A mistake in a command or a config file should cost its user one line and a
second, not a model load, a traceback or a supervisor restarting workers that
can only fail the same way. Each check raises `StartupError` with the line to
print; `onehop` prints it on stderr and exits with `EXIT_CONFIG`.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the command line imports this module: `onehop --help` stays fast
    from gateway.config import GatewayConfig, ModelConfig

EXIT_USAGE = 2
"""A command or config that cannot start: argparse's own status for bad arguments."""
EXIT_CONFIG = 78
"""sysexits' EX_CONFIG: what a worker exits with when its configuration cannot serve, so the
supervisor stops instead of starting it again (a restart cannot fix a config)."""


class StartupError(Exception):
    """The one line `onehop` prints before exiting: a start that cannot succeed as configured."""


def check_port(host: str, port: int) -> None:
    """Bind `host:port` once and let it go: a port another program listens on is reported now,
    not after a model load. Port 0 always binds."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            # As the server binds: a port left in TIME_WAIT by an earlier run is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as exc:
        raise StartupError(port_error(host, port, exc)) from exc


def port_error(host: str, port: int, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return f"cannot listen on {host}:{port}: the port is in use by another program"
    return f"cannot listen on {host}:{port}: {exc.strerror or exc}"


@contextmanager
def startup_errors(host: str, port: int, also: tuple[type[Exception], ...] = ()) -> Iterator[None]:
    """What a gateway start raises for a model, parser or config it cannot serve, or a port it
    cannot take, as one line (anything else is a bug and keeps its traceback). `also`: more
    errors that mean the same, from what else the process starts (`onehop.preflight`: an engine)."""
    from derender.parsers.base import UnknownParser
    from gateway.edge.auth import KeyFileError
    from gateway.render.chat_template import ChatTemplateError
    from gateway.config import ConfigError
    from gateway.routing.policy import PolicyError
    from gateway.render.tokenizer_folder import TokenizerFolderError

    one_line: tuple[type[Exception], ...] = (
        UnknownParser,
        ChatTemplateError,
        ConfigError,
        TokenizerFolderError,
        PolicyError,
        KeyFileError,
        *also,
    )
    try:
        yield
    except OSError as exc:
        if exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):  # taken since check_port
            raise StartupError(port_error(host, port, exc)) from exc
        raise
    except one_line as exc:
        raise StartupError(str(exc)) from exc


def check_gateway(config: GatewayConfig) -> None:
    """What every worker would load at start, loaded once: each model's tokenizer folder, its
    chat templates and its parser settings, the policy and API key files. Engines' URLs are
    checked when the config decodes; whether engines serve this model, only a worker can tell."""
    from gateway.serving.memory import release_freed_memory

    for model in config.served_models():
        _check_model(model)
    _check_files(config)
    release_freed_memory()  # the supervisor keeps none of it: hand the heap back


def _check_files(config: GatewayConfig) -> None:
    from gateway.edge.auth import KeyFileError, keys_from_env, load_key_file
    from gateway.routing.policy import PolicyError, policy_for

    try:
        if config.policy is not None:
            policy_for(Path(config.policy), {name for model in config.served_models() for name in model.pools})
        if config.auth.api_keys_file is not None:
            load_key_file(Path(config.auth.api_keys_file))
    except (PolicyError, KeyFileError) as exc:
        raise StartupError(str(exc)) from exc
    env = config.auth.api_keys_env
    if env is not None and config.auth.api_keys_file is None and not keys_from_env(env):
        raise StartupError(f"auth.api_keys_env names {env}, which holds no key")


def _check_model(model: ModelConfig) -> None:
    from derender.parsers.detect import resolve
    from gateway.render.chat_template import ChatTemplate, ChatTemplateError
    from gateway.render.tokenizer_folder import TokenizerFolderError, load_folder

    if not Path(model.tokenizer).is_dir():
        raise StartupError(f"model {model.name}: the tokenizer folder {model.tokenizer} does not exist")
    try:
        folder = load_folder(model.tokenizer)
        for source in folder.templates.values():
            ChatTemplate(source)
        resolve(model.tokenizer, *model.parsers)
    except (TokenizerFolderError, ChatTemplateError, OSError, ValueError) as exc:
        raise StartupError(f"model {model.name}: {exc}") from exc

"""Server settings: the engine's :class:`EngineConfig` plus the HTTP server's own knobs,
read once from the command line (defaults from ``QFSERVE_*`` environment variables),
frozen, replaced wholesale in tests.

Every flag is a field here or in :class:`EngineConfig`, declared once with
:func:`~qfserve.engine.serving.config.option`: :func:`make_parser` builds the command line
and :data:`EnvDefaults` the ``QFSERVE_*`` variables from those fields, and
:mod:`qfserve.server.docgen` the documented table.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any, Literal

from pydantic import create_model
from pydantic_settings import BaseSettings, SettingsConfigDict

from qfserve.engine.serving.config import EngineConfig, option, parse_budget

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_DRAIN_TIMEOUT = 30.0
DEFAULT_WRITE_TIMEOUT = 15.0
LOG_LEVELS = ("debug", "info", "warning", "error")
DESCRIPTION = (
    "OpenAI-compatible MLX server with Q-Filters KV eviction. 'qfserve calibrate --help' for "
    "filter calibration. Every flag can also be set as an environment variable "
    "QFSERVE_<FLAG> (QFSERVE_PORT=8080); the flag wins. Where llama-server has a spelling "
    "of the same meaning, it is accepted too (-m, -c, -a, -np)."
)


@dataclass(frozen=True)
class Settings(EngineConfig):
    """Everything the app needs; defaults match the ``qfserve`` flags (see each field's
    help). ``api_key_file`` is read into ``api_key`` at construction."""

    host: str = option(DEFAULT_HOST, "--host", help="bind address (default: %(default)s)")
    port: int = option(DEFAULT_PORT, "--port", help="port (default: %(default)s)")
    api_key: str | None = option(
        None,
        "--api-key",
        help="require 'Authorization: Bearer KEY' on every route but /health "
        "(visible in ps: prefer --api-key-file or QFSERVE_API_KEY)",
    )
    api_key_file: str | None = option(
        None, "--api-key-file", help="read the API key from this file (its first line)"
    )
    admin_key: str | None = option(
        None, "--admin-key", help="key for /admin/cache (default: --api-key)"
    )
    no_admin: bool = option(False, "--no-admin", help="remove the /admin/cache endpoint")
    no_webui: bool = option(
        False, "--no-webui", help="remove the chat page at / (llama-server's spelling)"
    )
    max_body_bytes: int = option(
        DEFAULT_MAX_BODY_BYTES,
        "--max-body-bytes",
        help="larger request bodies get 413 (default: %(default)s)",
    )
    drain_timeout: float = option(
        DEFAULT_DRAIN_TIMEOUT,
        "--drain-timeout",
        help="seconds in-flight requests may finish after SIGTERM (default: %(default)s)",
    )
    write_timeout: float = option(
        DEFAULT_WRITE_TIMEOUT,
        "--write-timeout",
        help="seconds a stream may wait for its client to read before it is aborted "
        "(default: %(default)s)",
    )
    log_level: Literal["debug", "info", "warning", "error"] = option(
        "info",
        "--log-level",
        choices=LOG_LEVELS,
        help="how much the server logs (default: %(default)s)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.api_key_file:
            try:
                key = Path(self.api_key_file).read_text().splitlines()[0].strip()
            except (OSError, IndexError) as exc:
                raise ValueError(
                    f"--api-key-file {self.api_key_file!r}: cannot read a key ({exc})"
                ) from None
            object.__setattr__(self, "api_key", key)
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0, got {self.drain_timeout}")
        if not self.write_timeout > 0:
            raise ValueError(f"write_timeout must be > 0, got {self.write_timeout}")

    @property
    def admin_enabled(self) -> bool:
        return not self.no_admin


def flag_fields() -> list[tuple[dataclasses.Field[Any], Any]]:
    """The fields that are flags, with their resolved types, in ``--help`` order."""
    hints = typing.get_type_hints(Settings)
    fields = [f for f in dataclasses.fields(Settings) if f.metadata.get("flags")]
    # The model and the address first, as a user reads them; then the engine's, the server's.
    first = ("model", "alias", "host", "port")
    fields.sort(key=lambda f: first.index(f.name) if f.name in first else len(first))
    return [(f, hints[f.name]) for f in fields]


def _plain(hint: Any) -> Any:
    """``int`` for ``int | None``; the hint itself otherwise."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) and len(args) == 1:
        return args[0]
    return hint


# QFSERVE_<FIELD> for every flag; pydantic-settings reads and checks them against the
# fields' own types (a Literal lists its choices in the error).
EnvDefaults: type[BaseSettings] = create_model(  # type: ignore[call-overload]
    "EnvDefaults",
    __base__=BaseSettings,
    __config__=None,
    **{f.name: (hint, f.default) for f, hint in flag_fields()},
)
EnvDefaults.model_config = SettingsConfigDict(env_prefix="QFSERVE_", extra="ignore")
EnvDefaults.model_rebuild(force=True)


def make_parser(env: BaseSettings | None = None) -> argparse.ArgumentParser:
    """The ``qfserve`` command line, defaults from ``env`` (the ``QFSERVE_*`` variables)."""
    env = env or EnvDefaults()
    p = argparse.ArgumentParser(prog="qfserve", description=DESCRIPTION)
    p.add_argument("--version", action="version", version=f"qfserve {version('qfserve')}")
    for f, hint in flag_fields():
        meta, default = f.metadata, getattr(env, f.name, f.default)
        kind = _plain(hint)
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": meta["help"]}
        if kind is bool:
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = parse_budget if f.name == "budget" else _converter(kind)
            if "choices" in meta:
                kwargs["choices"] = meta["choices"]
        p.add_argument(*meta["flags"], **kwargs)
        if "negation" in meta:
            flag, value = meta["negation"]
            p.add_argument(
                flag,
                dest=f.name,
                action="store_const",
                const=value,
                help=f"the same as {meta['flags'][0]} {value}",
            )
    return p


def _converter(kind: Any) -> Any:
    """What argparse converts a flag's text with: ``int``, ``float``, else ``str``."""
    return kind if kind in (int, float) else str


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The settings a parsed command line asks for (``ValueError``: an invalid value)."""
    names = {f.name for f in dataclasses.fields(Settings)}
    return Settings(**{k: v for k, v in vars(args).items() if k in names})

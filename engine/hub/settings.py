"""Where models come from and go to: the hub endpoint, the caches, offline mode, the token.

Read from the environment at call time, with the same variables as `huggingface_hub`,
and passed to it explicitly: its own constants are frozen when it is imported.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from engine.hub.errors import OFFLINE_HELP

DEFAULT_ENDPOINT = "https://huggingface.co"
HOME_ENV = "NMT_INCREMENTAL_HOME"
_TRUE = {"1", "on", "yes", "true"}


@dataclass(frozen=True)
class HubSettings:
    """Where to download from and cache to, and whether the network may be used."""

    endpoint: str
    hub_cache: Path
    models_root: Path
    offline: bool
    token: str | None = (
        None  # HF_TOKEN or the saved login ($HF_HOME/token); None: the library's lookup
    )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> HubSettings:
        """Read the same variables as huggingface_hub, but now rather than at its import."""
        env = os.environ if env is None else env
        xdg = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
        hf_home = Path(os.path.expandvars(env.get("HF_HOME") or xdg / "huggingface")).expanduser()
        hub_cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
        offline = env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE") or ""
        token = env.get("HF_TOKEN") or env.get("HUGGING_FACE_HUB_TOKEN")
        if not token:
            token_file = Path(env.get("HF_TOKEN_PATH") or hf_home / "token").expanduser()
            with contextlib.suppress(OSError, UnicodeDecodeError):
                token = token_file.read_text(encoding="utf-8").strip()
        return cls(
            endpoint=(env.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/"),
            hub_cache=Path(hub_cache).expanduser() if hub_cache else hf_home / "hub",
            models_root=Path(env.get(HOME_ENV) or xdg / "nmt-incremental").expanduser() / "models",
            offline=offline.strip().lower() in _TRUE,
            token=token or None,
        )

    def offline_help(self, name: str = "NAME") -> str:
        """How to get `name` (what `models pull` takes) here without the hub. A repo the
        catalog does not know needs its model directory copied as well: only that records
        the layout its file listing gave, and listing needs the hub."""
        if "/" not in name:
            what, places, paths = "Hugging Face cache", "place", f"{self.hub_cache}"
        else:
            what = "Hugging Face cache and the model directory it prints"
            places, paths = "places", f"{self.hub_cache}, {self.models_root}{os.sep}..."
        return OFFLINE_HELP.format(name=name, what=what, places=places, paths=paths)

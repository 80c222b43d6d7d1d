"""The reference weight sync: the update's weights to a directory, every engine reloads it.

``WeightPublisher.publish(trainer)``:

1. ``trainer.export_weights(weights_root)`` writes ``weights_root/v{version:06d}/``
   (atomically: the engines never read half a directory);
2. every engine the ``engines`` callable names at that moment (name -> URL: the router's
   instance table, say) reloads from it concurrently: ``POST /collective_rpc
   {"method": "load_published_weights", "kwargs": {"weights_path", "weight_version"}}``
   (``pearl.engines.vllm_weights`` in vLLM); tokens generated after the reload carry the
   new version. An engine that sleeps (``GET /is_sleeping``: a sleep step is under way;
   its weights are off the GPU) is skipped: it loads the latest as it wakes. Each engine
   that reloaded resets its prefix cache (``POST /reset_prefix_cache``) and is reported
   to ``loaded`` (the router's table: the version its tokens carry where the engine does
   not report one itself, as vLLM does not);
3. the version directories but the newest ``keep_versions`` are removed (every engine
   that reloaded has read its files by then).

An engine that fails (an error answer, no answer, the timeout) is reported in the result
with its name, URL and error; the others still reload, and nothing raises. What is
measured: the export's time, the reloads' time (from the first request to the last
answer), the whole.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pearl.engines.client import EngineClient, EngineError
from pearl.trainer.checkpoint import remove_staging
from pearl.trainer.protocol import Trainer

log = logging.getLogger(__name__)

_VERSION_DIR = re.compile(r"^v(\d{6})$")
ASLEEP = "asleep"  # an engine skipped: it sleeps, and reloads the latest as it wakes


@dataclass(frozen=True)
class EngineFailure:
    name: str
    url: str
    error: str


@dataclass(frozen=True)
class PublishResult:
    version: int
    weights_dir: Path
    export_s: float
    reload_s: float
    duration_s: float  # export, reloads and pruning
    reloaded: tuple[str, ...]  # the engines' names
    failed: tuple[EngineFailure, ...]


def prune_versions(root: Path, keep: int) -> list[Path]:
    """Remove all but the newest ``keep`` ``vNNNNNN`` directories (and staging leftovers)."""
    found = sorted(
        (int(m.group(1)), p)
        for p in root.iterdir()
        if p.is_dir() and (m := _VERSION_DIR.match(p.name)) is not None
    )
    old = [p for _, p in found[: max(len(found) - keep, 0)]]
    for p in old:
        shutil.rmtree(p, ignore_errors=True)
    return old + remove_staging(root)


class WeightPublisher:
    def __init__(
        self,
        weights_root: Path,
        engines: Callable[[], Mapping[str, str]],
        *,
        keep_versions: int = 2,
        timeout_s: float = 120.0,
        loaded: Callable[[str, int], None] | None = None,
    ) -> None:
        if keep_versions < 1:
            raise ValueError(f"keep_versions: at least 1, not {keep_versions}")
        self.weights_root = weights_root
        self.engines = engines
        self.loaded = loaded  # told of each engine that reloaded: name, version
        self.keep_versions = keep_versions
        self.timeout_s = timeout_s

    async def publish(self, trainer: Trainer) -> PublishResult:
        started = time.perf_counter()
        version = trainer.version
        weights_dir = await asyncio.to_thread(trainer.export_weights, self.weights_root)
        exported = time.perf_counter()
        targets = dict(self.engines())
        errors = await asyncio.gather(
            *(self._reload(url, weights_dir, version) for url in targets.values())
        )
        reloaded = time.perf_counter()
        failed = tuple(
            EngineFailure(name, url, err)
            for (name, url), err in zip(targets.items(), errors, strict=True)
            if err is not None and err != ASLEEP
        )
        for f in failed:
            log.warning(
                "engine %s (%s) did not reload version %d: %s", f.name, f.url, version, f.error
            )
        if self.loaded is not None:
            for name, err in zip(targets, errors, strict=True):
                if err is None:
                    self.loaded(name, version)
        prune_versions(self.weights_root, self.keep_versions)
        return PublishResult(
            version=version,
            weights_dir=weights_dir,
            export_s=exported - started,
            reload_s=reloaded - exported,
            duration_s=time.perf_counter() - started,
            reloaded=tuple(n for n, e in zip(targets, errors, strict=True) if e is None),
            failed=failed,
        )

    async def _reload(self, url: str, weights_dir: Path, version: int) -> str | None:
        """None when the engine reloaded ``version``; ``ASLEEP`` when it sleeps (its
        weights are off the GPU: a sleep step is under way; it loads the latest as it
        wakes); else the error."""
        try:
            async with EngineClient(url, timeout_s=self.timeout_s) as c:
                if await c.is_sleeping():
                    return ASLEEP
                out = await c.reload_weights(weights_path=str(weights_dir), weight_version=version)
            results = out.get("results")
            got = results[0].get("weight_version") if isinstance(results, list) else None
        except EngineError as err:
            return str(err)
        except Exception as err:  # one engine's failure never stops the others' reloads
            return f"{type(err).__name__}: {err}"
        if got is not None and got != version:
            return f"reloaded as version {got}, not {version}"
        await reset_prefix_cache(url, self.timeout_s)
        return None


async def reset_prefix_cache(url: str, timeout_s: float) -> None:
    """``POST /reset_prefix_cache`` after a reload: the cached prefixes hold the old
    weights' keys and values (pearl's reference engine resets its own at a reload, vLLM's
    does not). A refusal (vLLM's, while requests run) is logged: the cache then ages out."""
    try:
        async with EngineClient(url, timeout_s=timeout_s) as c:
            await c.reset_prefix_cache()
    except Exception as err:  # the reload stands
        log.warning("%s: POST /reset_prefix_cache after a reload failed: %s", url, err)

"""The clear module: CLEAR_SCOPE removes every chunk of a scope from every tier, what an engine's
reset of its cache asks once its weights changed (vLLM's ``reset_prefix_cache`` with the
connector's reset): the KV it stored is stale, and a request after the reset must miss.

A scope is named by its fields, as LOOKUP_SCOPE names it, and every rank's is cleared; the
admin route (`POST /v1/cache/clear`, through `clear_model`) clears every scope a model's
instances registered since start, or of them the chunks of one salt, one adapter, or both.
Each clear is one WARNING line (who asked, the scope, what each tier removed) and counted in
/metrics. The answer comes once every tier is cleared: it
runs on a NORMAL worker, never on the loop, since it waits for the disk and Redis.

The tiers file each chunk under its filing scope (`dataplane.storage.keys.filing_scope`): its
scope's first bytes, then parts of its salt and adapter namespace. So a reset removes every
chunk of the model's layout, under every salt and namespace, and an admin clear of a salt or an
adapter those alone (`dataplane.storage.keys.ScopeMatch`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dataplane.liveness.registry import LivenessRegistry
from dataplane.metrics import DataPlaneMetrics
from dataplane.modules.base import Handler, RequestContext
from dataplane.modules.lookup import scopes_named
from dataplane.storage.keys import ScopeMatch
from dataplane.storage.l1 import L1Store, ScopeCleared
from dataplane.wire.context import salt_bytes
from dataplane.wire.messages import ClearScope, MsgType
from dataplane.wire.replies import Cleared

logger = logging.getLogger(__name__)

TIERS = ("l1", "fs", "remote")


@dataclass(frozen=True, slots=True)
class ModelCleared:
    """What a clear of a model removed (`ClearModule.clear_model`), summed over its scopes."""

    scopes: int  # the scopes cleared (0: no instance of the model registered since start)
    l1: int
    fs: int
    remote: int
    pinned: int
    failed: tuple[str, ...]

    @property
    def removed(self) -> int:
        return self.l1 + self.fs + self.remote

    @property
    def complete(self) -> bool:
        return not self.failed and not self.pinned


class ClearModule:
    name = "clear"

    def __init__(
        self,
        l1: L1Store,
        metrics: DataPlaneMetrics,
        registries: Sequence[LivenessRegistry],  # type: ignore[type-arg]
    ) -> None:
        self.l1 = l1
        self.metrics = metrics
        self.registries = list(registries)

    def handlers(self) -> dict[MsgType, Handler]:
        return {MsgType.CLEAR_SCOPE: Handler(self._clear_scope)}

    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None

    def close(self) -> None:
        return None

    def _clear_scope(self, rctx: RequestContext, p: ClearScope) -> Cleared:
        whole = [ScopeMatch.whole(s) for s in scopes_named(p, p.kv_codec)]
        got = self._clear(whole, "engine", f"connection {rctx.conn_fd}", p.model_name)
        return Cleared(got.l1, got.fs, got.remote, got.pinned, got.failed, got.complete)

    def clear_model(
        self, model: str, who: str, salt: str | None = None, adapter: str | None = None
    ) -> ModelCleared:
        """Clear every scope of ``model``'s instances registered since start (the admin route:
        ``who`` names the caller in the log), or, of them, the chunks of salt ``salt``, of the
        LoRA adapter named ``adapter`` (its namespace as this server learnt it from the
        engines' stores: LookupError when it never saw one), or both."""
        namespace = None
        if adapter is not None:
            namespace = self.l1.names.namespace(adapter)
            if namespace is None:
                raise LookupError(
                    f"adapter {adapter!r}: no chunk stored under it since this server started: its "
                    "namespace is not known"
                )
        raw = None if salt is None else salt_bytes(salt)
        scopes: set[bytes] = set()
        for r in self.registries:
            scopes |= {s for _, _, s in r.scopes_of(model)}
        matches = [
            ScopeMatch.whole(s)
            if raw is None and namespace is None
            else ScopeMatch.context(s, raw, namespace)
            for s in sorted(scopes)
        ]
        # (the log names the salt's presence, never the salt)
        what = repr(model) + (", one salt" if salt else "") + (f", adapter {adapter!r}" if adapter else "")
        return self._clear(matches, "admin", who, what)

    def _clear(self, scopes: Iterable[ScopeMatch], origin: str, who: str, model: str) -> ModelCleared:
        done = [self.l1.clear_scope(s) for s in scopes]
        got = _sum(done)
        outcome = "complete" if got.complete else "incomplete"
        self.metrics.clears.labels(origin=origin, outcome=outcome).inc()
        for tier, n in zip(TIERS, (got.l1, got.fs, got.remote), strict=True):
            self.metrics.cleared_chunks.labels(tier=tier).inc(n)
        logger.warning(
            "clear: %s %s: model %s, %d scope(s): removed %d from L1, %d files, %d from the remote tier%s%s",
            origin,
            who,
            model,
            got.scopes,
            got.l1,
            got.fs,
            got.remote,
            f"; {got.pinned} still held by a reader" if got.pinned else "",
            f"; not cleared: {', '.join(got.failed)}" if got.failed else "",
        )
        return got


def _sum(done: Sequence[ScopeCleared]) -> ModelCleared:
    failed = sorted({t for d in done for t in d.failed})
    return ModelCleared(
        len(done),
        sum(d.l1 for d in done),
        sum(d.fs or 0 for d in done),
        sum(d.remote or 0 for d in done),
        sum(d.pinned for d in done),
        tuple(failed),
    )

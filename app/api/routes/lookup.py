"""`POST /v1/lookup`: a router asks instead of listening to the KV events."""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter, HTTPException, status

from app.api.deps import DataPlaneDep
from app.lookup_models import (
    MAX_LOOKUP_TOKENS,
    HashesItem,
    LookupAnswer,
    LookupBatch,
    LookupResult,
    TokensItem,
)
from app.models import Detail
from dataplane.server.facade import TierHits

router = APIRouter(prefix="/v1", tags=["routing"])


@router.post(
    "/lookup",
    response_model=LookupAnswer,
    name="lookup",
    summary="Prefix tokens each tier holds, for a batch of prompts",
    description="For KV-aware routers: how many prefix tokens of each prompt L1, the file tier and "
    "the remote tier hold for the model (under the salt and the adapter given), touching nothing. "
    "A prompt is named by its token ids, or by the engine's block hashes (vLLM's integer hashes, "
    f"from its KV events) and block size. At most {MAX_LOOKUP_TOKENS} tokens (or hashes) a batch.",
    responses={413: {"model": Detail, "description": "the batch holds too many tokens"}},
)
def lookup(dp: DataPlaneDep, batch: LookupBatch) -> LookupAnswer:
    total = sum(len(r.token_ids if isinstance(r, TokensItem) else r.block_hashes) for r in batch.requests)
    if total > MAX_LOOKUP_TOKENS:
        raise HTTPException(
            status.HTTP_413_REQUEST_ENTITY_TOO_LARGE,
            f"the batch holds {total} tokens, over the limit of {MAX_LOOKUP_TOKENS}",
        )
    results = []
    for r in batch.requests:  # (every id checked by the model: within [0, 2^31))
        if isinstance(r, HashesItem):
            results.append(_result(dp.lookup_hashes(r.model, r.block_hashes, r.block_size)))
        else:
            ids = np.asarray(r.token_ids, dtype=np.int32)
            results.append(_result(dp.lookup_tiers(r.model, ids, r.salt, r.adapter)))
    return LookupAnswer(results=results)


def _result(h: TierHits) -> LookupResult:
    return LookupResult(
        tokens=h.tokens,
        chunk_size=h.chunk_size,
        cpu_tokens=h.cpu,
        disk_tokens=h.disk,
        external_tokens=h.external,
        total_tokens=h.total,
        model_known=h.known,
    )

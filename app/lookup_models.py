"""Models of `POST /v1/lookup`, a KV-aware router's question: which tiers hold how much of these
prompts (docs: interfaces.md, README "Routing")."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

MAX_LOOKUP_REQUESTS = 64
MAX_LOOKUP_TOKENS = 1 << 20  # in one batch, all its prompts together
TOKEN_ID_LIMIT = 1 << 31


class LookupItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=256, description="the model name its workers register")
    token_ids: list[int] = Field(min_length=1, description="the prompt's token ids")
    salt: str | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="the tenant's cache_salt; a salted prefix is only found with it",
    )
    adapter: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="the LoRA adapter's name, as the engine's events give it",
    )


class LookupBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    requests: list[LookupItem] = Field(min_length=1, max_length=MAX_LOOKUP_REQUESTS)


class LookupResult(BaseModel):
    """Prefix tokens held, each tier's from the prompt's first token."""

    tokens: int = Field(description="tokens asked about")
    chunk_size: int = Field(description="the server's tokens per chunk: every count is a multiple of it")
    cpu_tokens: int = Field(description="in L1 (local CPU memory)")
    disk_tokens: int = Field(description="in the file tier")
    external_tokens: int = Field(description="in the shared remote tier")
    total_tokens: int = Field(
        description="what a RETRIEVE would bring: L1's prefix, continued by the file tier, then the remote"
    )
    model_known: bool = Field(
        description="instances of the model have registered since the server started (else every count is 0)"
    )


class LookupAnswer(BaseModel):
    results: list[LookupResult] = Field(description="one per request, in order")

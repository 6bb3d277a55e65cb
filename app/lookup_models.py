"""Models of `POST /v1/lookup`, a KV-aware router's question: which tiers hold how much of these
prompts (docs: interfaces.md, README "Routing")."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

MAX_LOOKUP_REQUESTS = 64
MAX_LOOKUP_TOKENS = 1 << 20  # in one batch, all its prompts together
TOKEN_ID_LIMIT = 1 << 31
TokenId = Annotated[int, Field(ge=0, lt=TOKEN_ID_LIMIT)]
BlockHashInt = Annotated[int, Field(ge=0)]  # (one past 2^64 names nothing held: a miss)


MAX_SALT_CHARS = 4096  # a cache_salt, wherever a route takes one
MAX_ADAPTER_CHARS = 256  # a LoRA adapter's name, likewise


class TokensItem(BaseModel):
    """A prompt named by its token ids, with its tenant's salt and LoRA adapter."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=256, description="the model name its workers register")
    token_ids: list[TokenId] = Field(min_length=1, max_length=MAX_LOOKUP_TOKENS, description="the prompt")
    salt: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_SALT_CHARS,
        description="the tenant's cache_salt; a salted prefix is only found with it",
    )
    adapter: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_ADAPTER_CHARS,
        description="the LoRA adapter's name, as the engine's events give it",
    )


class HashesItem(BaseModel):
    """A prompt named by the engine's block hashes (vLLM's integer hashes, as its KV events give
    them), which hold its salt and adapter."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=256, description="the model name its workers register")
    block_hashes: list[BlockHashInt] = Field(
        min_length=1, max_length=1 << 17, description="the engine's hash of each full block, from the first"
    )
    block_size: int = Field(ge=1, le=1 << 16, description="the engine's tokens per block")


class LookupBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    requests: list[TokensItem | HashesItem] = Field(min_length=1, max_length=MAX_LOOKUP_REQUESTS)


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

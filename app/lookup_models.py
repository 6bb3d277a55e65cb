"""Models of `POST /v1/lookup`, a KV-aware router's question: which tiers hold how much of these
prompts (docs: interfaces.md, README "Routing")."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_LOOKUP_REQUESTS = 64
MAX_LOOKUP_TOKENS = 1 << 20  # in one batch, all its prompts together
TOKEN_ID_LIMIT = 1 << 31


class LookupItem(BaseModel):
    """A prompt named by its token ids (with its salt and adapter), or by the engine's block
    hashes (which hold them: vLLM's integer hashes, as its KV events give them) and block size."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=256, description="the model name its workers register")
    token_ids: list[int] | None = Field(None, min_length=1, description="the prompt's token ids")
    block_hashes: list[int] | None = Field(
        None,
        min_length=1,
        max_length=1 << 17,
        description="the engine's hash of each full block of the prompt, from the first (not with token_ids)",
    )
    block_size: int | None = Field(
        None, ge=1, le=1 << 16, description="the engine's tokens per block; with block_hashes only"
    )
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

    @model_validator(mode="after")
    def _one_name(self) -> LookupItem:
        if (self.token_ids is None) == (self.block_hashes is None):
            raise ValueError("give token_ids or block_hashes, one of them")
        if (self.block_hashes is None) != (self.block_size is None):
            raise ValueError("block_size goes with block_hashes, and only with them")
        if self.block_hashes is not None and (self.salt is not None or self.adapter is not None):
            raise ValueError("salt and adapter go with token_ids: block hashes hold them already")
        if self.block_hashes is not None and not all(0 <= h < 1 << 64 for h in self.block_hashes):
            raise ValueError("block_hashes: every hash must be a u64")
        return self


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

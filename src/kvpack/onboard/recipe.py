"""Qualification recipes: what a new node must prove before it is written healthy (pure).

A recipe is declared per model identity (seed 003 §30.8): always exactly three ordered
Handoff V2 exchanges at a 2,048-position prompt and 256 output tokens between the new node
and its peer. Per identity it says how strict exactness is (``tokens``: the greedy tokens
must equal a local uninterrupted run; ``exact``: the full logits rows too) and the payload
rate floor that the *median* of the three exchanges must reach, measured at the receiver
(its receipt's payload bytes over its wire time, never the sender's clock).

An identity declares its recipe in its identity file (``"qualification": {...}``); a few
known engines have a built-in recipe keyed by model name. An identity with neither is refused
at enrollment: a node that cannot be qualified is never trusted.

This module never touches sockets, files or clocks; the driver (:mod:`.qualify`) feeds it
results and receipts and asks for a verdict.
"""

from __future__ import annotations

import hashlib
import math
import statistics
import struct
from dataclasses import dataclass
from typing import Any

from ..errors import OnboardError

RECIPE_NAME = "handoff-v2-3x2048x256"
EXCHANGES = 3
PROMPT_POSITIONS = 2048
OUTPUT_TOKENS = 256
EXACTNESS = ("tokens", "exact")
DEFAULT_SEED = "kvpack-qualification-v1"

#: Recipes of engines kvpack ships, keyed by the identity's ``model_revision`` (model name).
#: The floor is a CPU-reference value: SmolLM2's producer streams each tile as its prefill
#: chunk completes, so on two cores the receiver's wire time is mostly the producer's compute
#: (0.014-0.027 Gbps per exchange measured on a heavily loaded two-core box).
#: Deployments declare their own floor in the identity file (the seed's lane used 3.0 Gbps).
BUILTIN: dict[str, dict[str, Any]] = {
    "SmolLM2-135M-Instruct": {"recipe": RECIPE_NAME, "logits": "exact", "min_payload_gbps": 0.002},
}


@dataclass(frozen=True)
class Recipe:
    """A parsed recipe; the shape is fixed, exactness and floor are per identity."""

    logits: str  # "tokens" or "exact"
    min_payload_gbps: float
    seed: str = DEFAULT_SEED
    source: str = "declared"  # "declared" (identity file) or "builtin"

    exchanges: int = EXCHANGES
    prompt_positions: int = PROMPT_POSITIONS
    output_tokens: int = OUTPUT_TOKENS

    @property
    def floor_bps(self) -> float:
        return self.min_payload_gbps * 1e9

    def to_json(self) -> dict[str, Any]:
        return {
            "recipe": RECIPE_NAME,
            "exchanges": self.exchanges,
            "prompt_positions": self.prompt_positions,
            "output_tokens": self.output_tokens,
            "logits": self.logits,
            "min_payload_gbps": self.min_payload_gbps,
            "seed": self.seed,
            "source": self.source,
        }

    def with_floor(self, gbps: float) -> "Recipe":
        _check_floor(gbps, "floor override")
        return Recipe(self.logits, float(gbps), self.seed, f"{self.source}+floor-override")


def _check_floor(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise OnboardError("recipe", f"{where}: min_payload_gbps must be a finite number >= 0, got {value!r}")
    return float(value)


def parse_recipe(obj: Any, where: str, *, source: str = "declared") -> Recipe:
    """A declared recipe object: ``{"recipe": "handoff-v2-3x2048x256", "logits": "tokens" |
    "exact", "min_payload_gbps": float, "seed": str (optional)}``; anything else is refused."""
    if not isinstance(obj, dict):
        raise OnboardError("recipe", f"{where} must be an object")
    unknown = set(obj) - {"recipe", "logits", "min_payload_gbps", "seed"}
    if unknown:
        raise OnboardError("recipe", f"{where}: unknown field(s) {sorted(unknown)}")
    if obj.get("recipe") != RECIPE_NAME:
        raise OnboardError(
            "recipe", f"{where}.recipe must be {RECIPE_NAME!r} (three exchanges at 2,048 positions and 256 output tokens), got {obj.get('recipe')!r}"
        )
    if obj.get("logits") not in EXACTNESS:
        raise OnboardError("recipe", f"{where}.logits must be one of {EXACTNESS}, got {obj.get('logits')!r}")
    floor = _check_floor(obj.get("min_payload_gbps"), where)
    seed = obj.get("seed", DEFAULT_SEED)
    if not isinstance(seed, str) or not 1 <= len(seed) <= 128:
        raise OnboardError("recipe", f"{where}.seed must be a string of 1..128 characters")
    return Recipe(obj["logits"], floor, seed, source)


def recipe_for(identity_file: dict[str, Any]) -> Recipe:
    """The recipe of an identity (declared, else built-in), or ``OnboardError('recipe')``."""
    declared = identity_file.get("qualification")
    if declared is not None:
        return parse_recipe(declared, "identity.qualification")
    model = identity_file.get("identity", {}).get("model_revision")
    builtin = BUILTIN.get(model) if isinstance(model, str) else None
    if builtin is None:
        raise OnboardError(
            "recipe",
            f"identity {model!r} declares no qualification recipe and none is built in: add "
            f'"qualification": {{"recipe": "{RECIPE_NAME}", "logits": "exact", "min_payload_gbps": ...}} to its identity file',
        )
    return parse_recipe(builtin, f"builtin recipe of {model}", source="builtin")


# -- prompts ----------------------------------------------------------------------------------------


def prompts(recipe: Recipe, vocab_size: int) -> list[list[int]]:
    """The recipe's three prompts: deterministic token ids from the seed (SHA-256 counter
    stream), away from the low ids where tokenizers keep their special tokens. Each prompt's
    first token differs, so no two share a 256-aligned prefix and every exchange is a full
    handoff (a shared prefix would let the receiver reuse it and ship a delta instead)."""
    if vocab_size < 8:
        raise OnboardError("recipe", f"vocabulary of {vocab_size} ids is too small for qualification prompts")
    low = min(256, vocab_size // 4)
    span = vocab_size - low
    out = []
    for index in range(recipe.exchanges):
        stream = b"".join(hashlib.sha256(f"{recipe.seed}/prompt/{index}/{block}".encode()).digest() for block in range(recipe.prompt_positions // 8 + 1))
        words = struct.unpack_from(f"<{recipe.prompt_positions}I", stream)
        tokens = [low + w % span for w in words]
        tokens[0] = low + index  # distinct first tokens: no shared prefix between exchanges
        out.append(tokens)
    return out


def prompts_digest(all_prompts: list[list[int]]) -> str:
    h = hashlib.sha256(b"kvpack/onboard/prompts/v1\0")
    for p in all_prompts:
        h.update(struct.pack(f"<I{len(p)}I", len(p), *p))
    return h.hexdigest()


# -- verdict ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reference:
    """A local uninterrupted run of one prompt: greedy tokens and the SHA-256 of its logits."""

    tokens: tuple[int, ...]
    logits_sha256: str


@dataclass(frozen=True)
class Exchange:
    """What the receiver reported for one exchange (its reply and its receipt)."""

    tokens: tuple[int, ...]
    logits_sha256: str
    action: str
    prefix_cut: int
    payload_bytes: int
    wire_s: float

    @property
    def rate_bps(self) -> float:
        return self.payload_bytes * 8 / self.wire_s if self.wire_s > 0 else 0.0


def check_exchange(recipe: Recipe, index: int, ref: Reference, got: Exchange) -> str | None:
    """None when exchange ``index`` (0-based) is exact and was a real full handoff; else why."""
    n = index + 1
    if got.action != "full_transfer" or got.prefix_cut != 0:
        return f"exchange {n} was not a full handoff (plan {got.action}, prefix_cut {got.prefix_cut})"
    if got.payload_bytes <= 0 or not got.wire_s > 0:
        return f"exchange {n}: the receiver's receipt records no payload or wire time"
    if len(got.tokens) != recipe.output_tokens:
        return f"exchange {n}: {len(got.tokens)} output tokens, the recipe needs {recipe.output_tokens}"
    if got.tokens != ref.tokens:
        first = next(i for i, (a, b) in enumerate(zip(got.tokens, ref.tokens)) if a != b)
        return f"exchange {n}: tokens differ from the local uninterrupted run at output token {first}"
    if recipe.logits == "exact" and got.logits_sha256 != ref.logits_sha256:
        return f"exchange {n}: tokens exact but full logits differ from the local uninterrupted run"
    return None


def rate_floor_lost(recipe: Recipe, rates_bps: list[float]) -> bool:
    """True once the median can no longer reach the floor (a majority of the three rates is
    below it): the driver stops there instead of running exchanges that cannot change the verdict."""
    below = sum(1 for r in rates_bps if r < recipe.floor_bps)
    return below > recipe.exchanges // 2


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str | None
    rates_bps: tuple[float, ...]
    median_bps: float | None

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "reason": self.reason,
            "rates_bps": [round(r, 1) for r in self.rates_bps],
            "median_bps": None if self.median_bps is None else round(self.median_bps, 1),
            "median_gbps": None if self.median_bps is None else round(self.median_bps / 1e9, 6),
        }


def verdict(recipe: Recipe, refs: list[Reference], got: list[Exchange]) -> Verdict:
    """The qualification verdict over the exchanges run so far (all three for a pass)."""
    rates = tuple(g.rate_bps for g in got)
    for i, (ref, g) in enumerate(zip(refs, got)):
        why = check_exchange(recipe, i, ref, g)
        if why is not None:
            return Verdict(False, why, rates, None)
    if len(got) < recipe.exchanges:
        if rate_floor_lost(recipe, list(rates)):
            return Verdict(False, _floor_reason(recipe, rates, statistics.median(rates)), rates, statistics.median(rates))
        return Verdict(False, f"only {len(got)} of {recipe.exchanges} exchanges ran", rates, None)
    median = statistics.median(rates)
    if median < recipe.floor_bps:
        return Verdict(False, _floor_reason(recipe, rates, median), rates, median)
    return Verdict(True, None, rates, median)


def _floor_reason(recipe: Recipe, rates: tuple[float, ...], median: float) -> str:
    shown = ", ".join(f"{r / 1e9:.4f}" for r in rates)
    return f"median payload rate {median / 1e9:.4f} Gbps (exchanges: {shown}) is below the floor of {recipe.min_payload_gbps:g} Gbps"

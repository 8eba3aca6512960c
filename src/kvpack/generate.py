"""Generation with the pack store: reuse the deepest stored prefix, prefill only the rest,
decode greedily, save the new cut and its 256-token checkpoints.

Used by ``kvpack generate``, ``kvpack store save``, the demo and the TTFT benchmark. The
same prompt gives the same tokens (and bit-identical logits) whether or not a prefix was
reused, because restore is byte-exact and prefill chunk boundaries are absolute multiples of
the engine's chunk size in both cases.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from .vocab import is_token_aligned
from .store import PackStore


@dataclass
class GenerateResult:
    text: str
    tokens: list[int]
    prompt_tokens: int
    reused_tokens: int
    prefilled_tokens: int
    reused_bytes: int
    restore_s: float
    prefill_s: float
    ttft_s: float
    decode_s: float
    save_s: float
    saved_cuts: list[int] = field(default_factory=list)
    manifest_id: str | None = None
    #: receipts of stored cuts that failed verification: quarantined, treated as a miss and
    #: recomputed (then republished by this run's save)
    quarantined: list[dict] = field(default_factory=list)
    #: stored index entries the lookup passed over because the storage failed to read them
    #: (``kvpack: io`` messages, one per entry): a miss, recomputed, never quarantined
    unreadable: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def chat_tokens(engine, prompt: str, *, chat: bool = True) -> list[int]:
    """Token ids of a user prompt, through the model's chat template when it has one."""
    tok = getattr(engine, "tokenizer", None)
    if tok is None and not hasattr(engine, "encode"):  # the arrays engine takes token ids only
        from .errors import EngineError

        raise EngineError("model", f"{getattr(engine, 'name', type(engine).__name__)} has no tokenizer")
    if tok is not None and chat and getattr(tok, "chat_template", None):
        out = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return [int(t) for t in ids]
    return engine.encode(prompt)


def prefill_with_checkpoints(session, tokens: list[int], checkpoints: dict[int, bytes], store: PackStore | None = None) -> None:
    """Prefill ``tokens`` in the engine's aligned chunks, capturing the logits row at every
    256-token boundary so those cuts can be saved. A model with windowed layers must save
    them right there (``store``), while the window ending at the boundary is still held."""

    from .progress import bar

    start = session.position
    with bar("prefill", len(tokens)) as advance:
        done = [start]

        def capture(s) -> None:
            advance(s.position - done[0])
            done[0] = s.position
            if is_token_aligned(s.position):
                if store is not None:
                    store.save(s)
                else:
                    checkpoints[s.position] = bytes(s.export_logits())

        session.prefill(tokens, on_chunk=capture)


#: tokens per decode_greedy call while a progress bar is shown (each call forwards every token)
DECODE_STEP = 4


def decode_with_progress(session, max_new_tokens: int, stop_token_ids: list[int]) -> list[int]:
    """Greedy decode, with a token-count bar on a terminal. Off a terminal it is one
    ``decode_greedy`` call; on one, calls of DECODE_STEP tokens, which decode the same tokens
    (each call forwards every token it emits and continues from the logits it left)."""
    from .progress import bar, interactive

    if not interactive():
        return session.decode_greedy(max_new_tokens, stop_token_ids=stop_token_ids)[0]
    stops = set(stop_token_ids)
    tokens: list[int] = []
    with bar("decode", max_new_tokens) as advance:
        while len(tokens) < max_new_tokens:
            step, _rows = session.decode_greedy(min(DECODE_STEP, max_new_tokens - len(tokens)), stop_token_ids=stop_token_ids)
            tokens += step
            advance(len(step))
            if not step or step[-1] in stops:
                break
    return tokens


def check_context(engine, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse (``usage``) a request whose prompt plus ``max_new_tokens`` exceeds the engine's
    context, before any work: it would otherwise fail mid-decode after its prefill (and hold
    a decode slot until then). Like vLLM and OpenAI-style servers, the bound is strict even
    though an end-of-sequence token might have stopped the decode earlier."""
    limit = int(getattr(engine, "max_context", 0) or 0)
    if limit and prompt_tokens + max_new_tokens > limit:
        from .errors import UsageError

        raise UsageError("usage", f"a prompt of {prompt_tokens} tokens plus max_new_tokens {max_new_tokens} exceeds the engine's context of {limit} tokens")


def generate(engine, store: PackStore | None, prompt_tokens: list[int], *, max_new_tokens: int = 32, save: bool = True) -> GenerateResult:
    from .progress import status

    check_context(engine, len(prompt_tokens), max_new_tokens)

    t0 = time.perf_counter()
    session = engine.new_session()
    reused = reused_bytes = 0
    restore_s = 0.0
    quarantined: list[dict] = []
    unreadable: list[str] = []
    if store is not None:
        # a stored cut that fails verification is a miss (quarantined, recomputed below)
        with status("looking up and restoring the deepest stored prefix (verified) ..."):
            found = store.lookup_restore(prompt_tokens, session, layout=engine.layout, ids=engine.identity.ids())
        quarantined = found.quarantined
        unreadable = [u.error.message for u in found.unreadable]
        if found.hit is not None and found.report is not None:
            reused, reused_bytes, restore_s = found.hit.cut, found.report.bytes_verified, found.report.seconds
    checkpoints: dict[int, bytes] = {}
    t_prefill = time.perf_counter()
    rest = prompt_tokens[session.position :]
    if rest:
        save_now = store if (store is not None and save and session.layout.windowed_layers()) else None
        prefill_with_checkpoints(session, rest, checkpoints, save_now)
    prefill_s = time.perf_counter() - t_prefill
    prompt_cut = session.position
    checkpoints[prompt_cut] = bytes(session.export_logits())
    ttft_s = time.perf_counter() - t0  # the first token is the argmax of the logits we now hold
    saving_store = store if save else None  # the store this run saves into, if any
    windowed = bool(session.layout.windowed_layers())
    save_s = 0.0
    if saving_store is not None and windowed:
        # windowed layers hold the prompt cut's window only now, before decoding moves it
        t_save = time.perf_counter()
        saving_store.save(session)
        save_s += time.perf_counter() - t_save
    eos = getattr(engine.tokenizer, "eos_token_id", None) if engine.tokenizer is not None else None
    t_decode = time.perf_counter()
    new_tokens = decode_with_progress(session, max_new_tokens, [eos] if eos is not None else [])
    decode_s = time.perf_counter() - t_decode
    saved: list[int] = []
    manifest_id = None
    if saving_store is not None:
        t_save = time.perf_counter()
        if not windowed:
            # full-span layers keep every row: save the aligned checkpoints and the prompt's
            # exact cut from the final session, off the TTFT path
            for cut in sorted(checkpoints):
                saving_store.save(session, cut=cut, logits=checkpoints[cut])
        saved = sorted(c for c in checkpoints if is_token_aligned(c) or c == prompt_cut)
        # The decoded continuation is not saved: a cut reached by decode steps is exact for
        # its own continuation but is not what a chunked prefill of the same tokens computes,
        # and "same prompt, same text, reused or not" must hold (docs/store.md).
        hit = saving_store.find_deepest(prompt_tokens, engine.layout, engine.identity.ids())
        manifest_id = hit.manifest_id.hex() if hit is not None and hit.cut == prompt_cut else None
        save_s += time.perf_counter() - t_save
    text = engine.decode(new_tokens) if engine.tokenizer is not None else ""
    return GenerateResult(
        text=text,
        tokens=new_tokens,
        prompt_tokens=len(prompt_tokens),
        reused_tokens=reused,
        prefilled_tokens=len(rest),
        reused_bytes=reused_bytes,
        restore_s=restore_s,
        prefill_s=prefill_s,
        ttft_s=ttft_s,
        decode_s=decode_s,
        save_s=save_s,
        saved_cuts=saved,
        manifest_id=manifest_id,
        quarantined=quarantined,
        unreadable=unreadable,
    )

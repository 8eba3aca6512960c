"""Receiver admission expectations (``identity.rs::BeginExpectationsV2``, C.4, errata M5/M8).

``validate_begin`` proves a begin is well formed; admission proves it is the transfer this
receiver asked for: the exact model identity, the request's prompt minus the held-back
boundary token, the configured target cache identity, DFlash exactly as configured, no
vision components. Refusals are category ``identity`` (``manifest`` for generation zero).

It must never admit a begin it cannot match to an outstanding request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import ProtocolError
from .manifest import BeginManifestV2, ExactIdentityV1, MultimodalIdentityV1


def transfer_id_matches(request_id: str, transfer_id: str) -> bool:
    """Errata M8's recommended rule (accepts every genuine producer): the producer's id is
    ``<request_id>-<generation>``, and ids outside the ``muser-`` namespace (the producer's
    random default) are not bound to a request."""
    return transfer_id.startswith(request_id + "-") or not transfer_id.startswith("muser-")


@dataclass(frozen=True)
class AdmissionExpectations:
    """What the receiving node expects of the next begin.

    ``request_id`` / ``request_prompt`` are set when the transfer was requested over the
    control plane; ``request_prompt`` is the full prompt including the boundary token.
    """

    identity: ExactIdentityV1
    target_cache_identity_sha256: str
    max_context: int
    request_prompt: Optional[tuple[int, ...]] = None
    request_id: Optional[str] = None
    multimodal: Optional[MultimodalIdentityV1] = None
    dflash_identity_sha256: Optional[str] = None


def check_transfer_id(exp: Optional[AdmissionExpectations], manifest: BeginManifestV2) -> None:
    """C.8 step 1: a begin naming another request is refused before anything else."""
    if exp is not None and exp.request_id is not None and not transfer_id_matches(exp.request_id, manifest.transfer_id):
        raise ProtocolError("identity", f"transfer id {manifest.transfer_id!r} is not for request {exp.request_id!r}")


def check_admission(manifest: BeginManifestV2, exp: AdmissionExpectations) -> None:
    if manifest.generation == 0:
        raise ProtocolError("manifest", "generation 0 is never valid")
    if manifest.identity != exp.identity:
        raise ProtocolError("identity", "model identity differs from the configured identity")
    if exp.request_prompt is not None:
        if len(exp.request_prompt) < 2:
            raise ProtocolError("identity", "request prompt needs at least 2 tokens", remote=False)
        if manifest.prompt_token_ids != tuple(exp.request_prompt[:-1]):
            raise ProtocolError("identity", "prompt is not the request prompt minus its boundary token")
    if manifest.position > exp.max_context:
        raise ProtocolError("identity", f"prompt of {manifest.position} tokens exceeds max_context {exp.max_context}")
    if manifest.multimodal != exp.multimodal:
        raise ProtocolError("identity", "multimodal identity differs from the armed value")
    targets = [c for c in manifest.components if c.kind == "target_kv"]
    if len(targets) != 1 or not targets[0].required:
        raise ProtocolError("identity", "expected exactly one required target_kv component")
    if targets[0].identity_sha256 != exp.target_cache_identity_sha256:
        raise ProtocolError("identity", "target cache identity differs from the configured one")
    dflash = [c for c in manifest.components if c.kind == "dflash_context"]
    if exp.dflash_identity_sha256 is None:
        if dflash:
            raise ProtocolError("identity", "dflash component but none configured")
    elif len(dflash) != 1 or not dflash[0].required or dflash[0].identity_sha256 != exp.dflash_identity_sha256:
        raise ProtocolError("identity", "expected exactly one required dflash_context with the configured digest")
    if any(c.kind == "vision_context" for c in manifest.components):
        raise ProtocolError("identity", "vision_context components are not accepted")

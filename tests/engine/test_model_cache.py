"""The conversion cache is a plain Hugging Face checkpoint: tied weights are stored under the
input embedding's name, and a cache in the old layout (format 1: only ``lm_head.weight``) or
with other tensor names than its manifest lists is discarded before anything loads it."""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from kvpack.engine import models  # noqa: E402
from kvpack.errors import EngineError  # noqa: E402


def _tiny_llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def test_tied_weights_are_stored_under_the_embedding_name_and_reload_identically(tmp_path):
    from transformers import AutoModelForCausalLM

    model = _tiny_llama(tied=True)
    tensors = models.checkpoint_tensors(model)
    assert "model.embed_tokens.weight" in tensors and "lm_head.weight" not in tensors
    model.config.save_pretrained(tmp_path)
    safetensors_torch.save_file(tensors, os.path.join(tmp_path, "model.safetensors"), metadata={"format": "pt"})
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype="float32")
    assert models.state_dict_digest(reloaded) == models.state_dict_digest(model)
    assert models.checkpoint_tensor_names(str(tmp_path)) == sorted(tensors)


def test_untied_heads_are_stored_as_they_are():
    tensors = models.checkpoint_tensors(_tiny_llama(tied=False))
    assert "model.embed_tokens.weight" in tensors and "lm_head.weight" in tensors


def test_a_config_that_ties_different_weights_is_refused():
    model = _tiny_llama(tied=True)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() + 1.0)
    with pytest.raises(EngineError) as exc:
        models.checkpoint_tensors(model)
    assert exc.value.category == "model"


def _fake_cache(tmp_path, *, fmt: int, stored: dict, listed: list[str]) -> str:
    target = tmp_path / "smollm2-fake"
    target.mkdir()
    safetensors_torch.save_file(stored, str(target / "model.safetensors"))
    manifest = {"format": fmt, "gguf_sha256": "ab" * 32, "versions": models._versions(), "checkpoint_tensors": listed}
    (target / "manifest.json").write_text(json.dumps(manifest))
    return str(target)


def test_format_1_caches_are_refused_before_loading(tmp_path, monkeypatch):
    names = ["lm_head.weight"]
    target = _fake_cache(tmp_path, fmt=1, stored={"lm_head.weight": torch.zeros(2, 2)}, listed=names)
    loads = []
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: loads.append(a))
    assert models._load_cached_smollm2(target, "ab" * 32) is None
    assert loads == []


def test_a_checkpoint_whose_tensor_names_differ_from_the_manifest_is_refused_before_loading(tmp_path, monkeypatch):
    # the old layout under the new format number: the file holds only the tied head
    target = _fake_cache(tmp_path, fmt=models._CACHE_FORMAT, stored={"lm_head.weight": torch.zeros(2, 2)}, listed=["model.embed_tokens.weight"])
    loads = []
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: loads.append(a))
    assert models._load_cached_smollm2(target, "ab" * 32) is None
    assert loads == []
    os.remove(os.path.join(target, "model.safetensors"))  # a missing file likewise
    assert models._load_cached_smollm2(target, "ab" * 32) is None
    assert loads == []


@pytest.mark.slow
def test_the_smollm2_cache_stores_the_embedding_table(smollm2_engine):
    names = models.checkpoint_tensor_names(smollm2_engine.loaded.source["cache_dir"])
    assert names is not None and "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert smollm2_engine.config.tie_word_embeddings

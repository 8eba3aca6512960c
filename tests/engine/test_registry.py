"""The engine contract as Protocols, the one engine registry, and ``kvpack identity``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvpack.cli import main
from kvpack.engine.arrays import ArrayEngine, array_layout
from kvpack.engine.contract import DeviceVerification, Engine, Install, PlaneStaging, Session, SpanExport, TextEngine
from kvpack.engine.registry import default_threads, load_engine, parse_spec
from kvpack.errors import EngineError
from kvpack.node.wire import identity_file_json


@pytest.mark.parametrize(
    "spec, text, arrays",
    [
        ("arrays", "arrays:4:2:8", (4, 2, 8, "f32")),
        ("arrays:8:4:64", "arrays:8:4:64", (8, 4, 64, "f32")),
        ("arrays:3", "arrays:3:2:8", (3, 2, 8, "f32")),
        ("arrays:2:2:16:f16", "arrays:2:2:16:f16", (2, 2, 16, "f16")),
        ("arrays:2:2:16:f32", "arrays:2:2:16", (2, 2, 16, "f32")),
    ],
)
def test_arrays_specs_parse_to_one_canonical_form(spec, text, arrays):
    parsed = parse_spec(spec)
    assert (parsed.name, parsed.text, parsed.arrays) == ("arrays", text, arrays)


@pytest.mark.parametrize("spec", ["", "llama", "arrays:x", "arrays:0:2:8", "arrays:2:2:8:f64", "arrays:1:2:3:f16:9", "smollm2:2"])
def test_unknown_or_malformed_specs_are_refused(spec):
    with pytest.raises(EngineError) as err:
        parse_spec(spec)
    assert err.value.category == "unsupported"


def test_default_threads_per_spec():
    assert default_threads("smollm2") == 2 and default_threads("muse-tiny") == 1 and default_threads("arrays:2:2:8") == 1


def test_arrays_engine_from_the_registry_keeps_dtype_and_name():
    engine = load_engine("arrays:3:2:16:f16")
    assert engine.layout.num_layers == 3 and {s.dtype for s in engine.layout.layers} == {"f16"}
    assert engine.identity.model_name == "arrays-3x2x16-f16"
    # the same spec builds the same identity; another dtype is another identity
    assert load_engine("arrays:3:2:16:f16").ids() == engine.ids() != load_engine("arrays:3:2:16").ids()


def test_adapters_satisfy_the_protocols_and_capabilities_are_typed():
    engine = ArrayEngine(array_layout(layers=2, kv_heads=2, head_dim=8))
    session = engine.new_session()
    session.prefill([1, 2, 3])
    install = session.begin_install(3, [1, 2, 3], engine.identity)
    assert isinstance(engine, Engine) and isinstance(session, Session) and isinstance(install, Install)
    # the NumPy adapter offers none of the optional capabilities, and says so by type
    assert not isinstance(session, SpanExport)
    assert not isinstance(install, PlaneStaging) and not isinstance(install, DeviceVerification)
    assert not isinstance(engine, TextEngine)
    assert not isinstance(object(), Engine)


def _fill(install, source):
    for layer, role in source.layout.states():
        lo, hi = install.required_range(layer)
        install.write_rows(layer, role, lo, source.export_rows(layer, role, lo, hi))


def test_install_context_manager_aborts_on_error_and_on_leaving_open():
    engine = ArrayEngine(array_layout(layers=2, kv_heads=2, head_dim=8, windowed={1: 4}))
    source, live = engine.new_session(), engine.new_session()
    source.prefill(list(range(1, 11)))
    live.prefill([5, 6])
    before = (list(live.tokens), live.cache_digest())
    with pytest.raises(RuntimeError):
        with live.begin_install(10, source.tokens, engine.identity) as install:
            _fill(install, source)
            raise RuntimeError("the fill failed half way")
    assert install.state == "aborted" and (list(live.tokens), live.cache_digest()) == before
    with live.begin_install(10, source.tokens, engine.identity) as install:
        _fill(install, source)  # left without commit: aborted too
    assert install.state == "aborted" and (list(live.tokens), live.cache_digest()) == before
    with live.begin_install(10, source.tokens, engine.identity) as install:
        _fill(install, source)
        install.write_logits(source.export_logits())
        install.commit()
    assert install.state == "committed" and live.cache_digest() == source.cache_digest()


def test_arrays_decode_greedy_is_the_first_maximum_of_each_row():
    engine = load_engine("arrays:2:2:8")
    s = engine.new_session()
    s.prefill([3, 4, 5])
    first = np.asarray(s.last_logits).copy()
    tokens, rows = s.decode_greedy(4)
    assert tokens[0] == int(np.argmax(first)) and np.array_equal(rows[0], first) and len(rows) == 4
    assert s.tokens[3:] == tokens


def test_identity_command_writes_the_file_enroll_takes(tmp_path, capsys):
    out = tmp_path / "identity.json"
    assert main(["identity", "--engine", "arrays:4:2:8", "--out", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    on_disk = json.loads(out.read_text())
    assert on_disk == identity_file_json(load_engine("arrays:4:2:8"))
    assert printed["target_cache_identity_sha256"] == on_disk["target_cache_identity_sha256"]
    assert printed["layout"]["layers"] == 4 and printed["layout"]["windowed_layers"] == [] and printed["threads"] == 1
    assert (out.stat().st_mode & 0o777) == 0o644
    # without --out the identity object itself is printed
    assert main(["identity", "--engine", "arrays:4:2:8"]) == 0
    assert json.loads(capsys.readouterr().out) == on_disk
    # an enrollment takes the file as is
    from kvpack.security.enroll import Cluster

    cluster = Cluster.init(str(tmp_path / "cluster"), identity=on_disk)
    assert cluster is not None


def test_identity_command_refuses_an_unknown_engine(capsys):
    assert main(["identity", "--engine", "gpt-5"]) == 2  # a usage error, before anything loads
    err = capsys.readouterr().err
    assert "unknown engine 'gpt-5'" in err and "muse-tiny" in err

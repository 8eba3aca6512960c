"""``pip install kvpack`` without extras: every command either works or names the extra to
install (exit 3, ``kvpack: missing_extra: ... pip install 'kvpack[...]'``), never a traceback.

A fresh virtual environment (no system site-packages) gets a wheel of this checkout with
``--no-deps`` plus only the base dependencies (cryptography, numpy) from the package index;
then every command of the CLI runs there once, on inputs made in that environment.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from kvpack.cli import build_parser, leaf_parsers

REPO = Path(__file__).resolve().parents[2]

# Each command, with inputs made below; {w} is the work directory. EXPECT: 0 = works on a
# base install, 3 = needs an extra; other codes are stated where the inputs make them.
COMMANDS: dict[tuple[str, ...], tuple[list[str], int]] = {
    ("schedule",): (["--position", "1000"], 0),
    ("fixture",): (["{w}/fx"], 0),
    ("inspect",): (["{w}/fx/fixture/raw/plain/plain/pack"], 0),
    ("verify",): (["{w}/fx/fixture/raw/plain/plain/pack", "--root-key-file", "{w}/root.key"], 1),  # the vectors' root is not this key
    ("transcode",): (["manifest", "{w}/fx/fixture/raw/plain/plain/manifest", "--hex"], 0),
    ("verdict",): (
        ["pack", "{w}/fx/fixture/raw/plain/plain/pack", "--root-key-file", "{w}/root.key", "--context", '{{"tenant": "' + "01" * 32 + '", "epoch": 7}}'],
        1,
    ),
    ("probe-volume",): (["{w}", "--max-tail-ms", "100000"], 0),
    ("enroll", "init"): (["{w}/cluster"], 0),
    ("enroll", "node"): (["{w}/cluster", "prefill-a", "--role", "producer", "--control-listen", "127.0.0.1:29591"], 0),
    ("enroll", "show"): (["{w}/cluster"], 0),
    ("storage-node", "pin"): (["{w}/cluster", "st-a", "--address", "127.0.0.1:22", "--user", "u", "--host-key-file", "{w}/host.pub", "--lane-dir", "/l"], 1),
    ("identity",): (["--engine", "arrays:4:2:8"], 0),
    ("store", "init"): (["{w}/store"], 0),
    ("store", "ls"): (["{w}/store"], 0),
    ("store", "verify"): (["{w}/store"], 0),
    ("store", "gc"): (["{w}/store"], 0),
    ("store", "repair"): (["{w}/store"], 0),
    ("store", "show"): (["{w}/store", "deadbeef"], 1),
    ("store", "forget"): (["{w}/store", "deadbeef"], 1),
    ("store", "save"): (["{w}/store", "--prompt", "hello"], 3),
    ("generate",): (["--store", "{w}/store", "--prompt", "hello"], 3),
    ("ledger", "show"): (["--ledger", "{w}/ledger.json"], 0),
    ("ledger", "reset"): (["--ledger", "{w}/ledger.json", "--min-generation", "2", "--key", "k:1"], 0),
    ("demo",): ([], 3),
    ("receiver",): (["--config", "{w}/host.pub"], 3),
    ("producer",): (["--config", "{w}/host.pub"], 3),
    ("receive",): (["--once", "--config", "{w}/host.pub"], 3),
    ("request",): (["--socket", "{w}/r.sock", "--prompt", "hi"], 3),
    ("decode-node-api",): (["--config", "{w}/host.pub"], 3),
    ("migrate",): (["s1", "--to", "local", "--mode", "copy", "--config", "{w}/host.pub"], 3),
    ("transfer", "status"): (["t1", "--config", "{w}/host.pub"], 3),
    ("transfer", "reconcile"): (["t1", "--config", "{w}/host.pub"], 3),
    ("session", "list"): (["--config", "{w}/host.pub"], 3),
    ("session", "create"): (["--config", "{w}/host.pub", "--tokens-file", "{w}/host.pub"], 3),
    ("session", "show"): (["s1", "--config", "{w}/host.pub"], 3),
    # onboarding: the cluster above has no identity, so node add is refused at preflight
    # before any SSH; the node-local steps that read stdin are given a --dir that is a file
    # (refused at parse time, so nothing waits on the runner's stdin)
    ("node", "add"): (["u@127.0.0.1", "--cluster", "{w}/cluster", "--role", "producer", "--name", "n1", "--known-hosts", "{w}/host.pub"], 1),
    ("node", "list"): (["--cluster", "{w}/cluster"], 0),
    ("node", "show"): (["n1", "--cluster", "{w}/cluster"], 0),
    ("node", "remove"): (["n1", "--cluster", "{w}/cluster"], 0),
    ("node-local", "preflight"): (["--dir", "{w}/nl"], 0),
    ("node-local", "keygen"): (["--dir", "{w}/nl", "--name", "n1", "--version", "1"], 0),
    ("node-local", "install"): (["--dir", "{w}/host.pub", "--version", "1"], 2),
    ("node-local", "put-secret"): (["--dir", "{w}/host.pub", "--key-id", "p-to-r"], 2),
    ("node-local", "remove-secret"): (["--dir", "{w}/nl", "--key-id", "p-to-r"], 0),
    ("node-local", "put-config"): (["--dir", "{w}/host.pub", "--name", "producer.json"], 2),
    ("node-local", "remove-config"): (["--dir", "{w}/nl", "--name", "producer.json"], 0),
    ("node-local", "receipt"): (["--dir", "{w}/nl", "--path", "{w}/host.pub"], 2),
    ("node-local", "status"): (["--dir", "{w}/nl"], 0),
    ("node-local", "daemon"): (["status", "--dir", "{w}/nl", "--unit", "producer"], 0),
}


def test_every_command_is_in_the_base_install_list():
    missing = [" ".join(w) for w, _ in leaf_parsers(build_parser()) if w not in COMMANDS]
    assert not missing, f"add {missing} to COMMANDS (what does it do on a base install?)"


def _pip(python: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args], capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def base_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("base")
    src = root / "src-copy"  # build from a copy: the build writes build/ and egg-info next to the sources
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    wheels = root / "wheels"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    env_dir = root / "venv"
    venv.create(env_dir, with_pip=True, system_site_packages=False)
    python = env_dir / "bin" / "python"
    wheel = next(wheels.glob("kvpack-*.whl"))
    r = _pip(python, "--no-deps", str(wheel))
    assert r.returncode == 0, r.stderr[-2000:]
    r = _pip(python, "cryptography>=42", "numpy>=1.26")  # the base dependencies, nothing else
    if r.returncode != 0:
        pytest.skip(f"cannot install the base dependencies from the package index: {r.stderr.strip()[-300:]}")
    return env_dir


@pytest.mark.slow
def test_base_install_every_command_works_or_names_its_extra(base_env, tmp_path):
    kvpack = base_env / "bin" / "kvpack"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    probe = subprocess.run(
        [
            str(base_env / "bin" / "python"),
            "-c",
            "import importlib.util as u; print([m for m in ('torch','transformers','prometheus_client','httpx','rich','fastapi','boto3') if u.find_spec(m)])",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert probe.stdout.strip() == "[]", f"the venv is not a base install: {probe.stdout}"
    w = tmp_path
    fd = os.open(w / "root.key", os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, os.urandom(32).hex().encode() + b"\n")
    os.close(fd)
    (w / "host.pub").write_text("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl test\n")
    failures = []
    for words, (args, expected) in COMMANDS.items():  # dict order: inputs are made before use
        argv = [str(kvpack), *words, *(a.format(w=w) for a in args)]
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=w, timeout=300)
        line = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
        ok = proc.returncode == expected and "Traceback" not in proc.stderr
        if expected == 3:
            ok = ok and line.startswith("kvpack: missing_extra: ") and "pip install 'kvpack[" in line
        elif expected:
            ok = ok and line.startswith("kvpack: ") and not line.startswith("kvpack: missing_extra")
        if not ok:
            failures.append(f"{' '.join(words)}: exit {proc.returncode} (expected {expected}): {proc.stderr[-600:]}")
    assert not failures, "\n".join(failures)
    assert subprocess.run([str(kvpack), "demo"], capture_output=True, text=True, env=env).stderr.strip() == (
        "kvpack: missing_extra: kvpack demo needs the 'engine' and 'node' extras: pip install 'kvpack[engine,node]'"
    )

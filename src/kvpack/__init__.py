"""kvpack: persist, move and migrate LLM KV caches exactly and provably.

Subpackages: ``format`` (production-v1 durable objects, pure), ``handoff`` (Handoff V2,
pure), ``security`` (TLS, secret files, replay ledger, enrollment), ``store`` (filesystem pack
store), ``engine`` (engine adapters), ``node`` (daemons), ``migrate`` (session migration).
"""

__version__ = "0.1.0"

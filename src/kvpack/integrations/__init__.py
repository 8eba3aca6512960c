"""Integrations of kvpack into serving engines (vLLM today); each lives in its own package
and imports its engine lazily, so kvpack never requires one."""

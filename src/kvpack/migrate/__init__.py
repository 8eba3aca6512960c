"""Session migration: sealed session bundles, durable transfer journals, the two-phase state
machine, the decode tier (HTTPS) and the storage tier (OpenSSH). See docs/migration.md."""

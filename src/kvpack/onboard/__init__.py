"""One-button node onboarding over real SSH (``kvpack node add``).

The admin machine drives a remote node through fixed, quoted ``kvpack node-local``
commands over OpenSSH with a pinned host key. The node generates its own TLS key inside a
versioned 0700 staging directory and hands back only a CSR; the admin checks and signs it,
installs the certificate, CA and HMAC keys, writes configs on both sides, starts the node's
daemon, runs the identity's qualification recipe (three Handoff V2 exchanges) and only then
writes ``state=healthy``.

Modules, one job each:

* :mod:`.recipe`   qualification recipes and their verdict (pure);
* :mod:`.state`    the admin-side onboarding state record: stages, transitions, durable file;
* :mod:`.ssh`      the OpenSSH client leg: pinned host key, BatchMode, bounded output;
* :mod:`.hosts`    one interface for "run a kvpack command on that node" (SSH or local);
* :mod:`.nodeside` what ``kvpack node-local`` does on the node (keygen, install, configs, ...);
* :mod:`.units`    managed daemon processes on a node (start, stop, status);
* :mod:`.qualify`  the qualification driver (reference runs, exchanges, receipts);
* :mod:`.wizard`   the stage pipeline, resume and revocation.
"""

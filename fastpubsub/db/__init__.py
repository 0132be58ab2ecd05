"""Data access: the only package that talks to PostgreSQL.

* `urls` — the URL forms fastpubsub accepts and the ones each client needs;
* `errors` — driver errors as fastpubsub errors (API, CLI and report share it);
* `pool` — connections kept checked out between statements;
* `queries` — `Database`: one method per named query of sql/queries.sql;
* `listener` — one LISTEN connection per process (api/wakeups.py wakes consumers with it).
"""

from fastpubsub.db.listener import NotificationListener
from fastpubsub.db.queries import Database

__all__ = ["Database", "NotificationListener"]

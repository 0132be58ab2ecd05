"""The scope vocabulary: what a client may be allowed, and the limits on a client's list.

Kept apart from fastpubsub.auth (which signs tokens and hashes secrets) so that
the API's models, which the client SDK imports too, can state the rules
without pulling in the server's dependencies.
"""

from __future__ import annotations

import re

ADMIN_SCOPE = "*"
# Every scope the API knows, by resource; object-specific forms append ":<id>".
SCOPES = {
    "topics": ("create", "read", "update", "delete", "publish", "subscribe"),
    "subscriptions": ("create", "read", "update", "delete", "consume", "peek"),
    "clients": ("create", "update", "read", "delete"),
    "metrics": ("read",),
}
SCOPE_DESCRIPTIONS = {
    "*": "Everything (admin)",
    **{
        f"{resource}:{action}": f"{action.capitalize()} {resource}"
        for resource, actions in SCOPES.items()
        for action in actions
    },
    "topics:subscribe": "Create subscriptions on topics (with subscriptions:create)",
    "topics:update": "Change topics (retention)",
    "subscriptions:peek": "Look at waiting messages without leasing them (read-only)",
    "metrics:read": "Read /metrics",
}
# The object id a scope may name ("topics:publish:orders").
_OBJECT_ID = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
OBJECT_ID = re.compile(_OBJECT_ID)
# A space-separated scope list as a regular expression (the OpenAPI document states it).
_ONE_SCOPE = (
    r"(?:\*|(?:"
    + "|".join(f"{resource}:(?:{'|'.join(actions)})" for resource, actions in SCOPES.items())
    + rf")(?::{_OBJECT_ID})?)"
)
SCOPES_PATTERN = rf"^\s*{_ONE_SCOPE}(?:\s+{_ONE_SCOPE})*\s*$"
# Limits on one client's scopes (they are all carried by each of its tokens).
MAX_SCOPES = 128
MAX_SCOPES_LENGTH = 4096


def scopes_problem(text: str) -> str | None:
    """What is wrong with a space-separated scope list, naming the scope at fault; None if nothing.

    The rules SCOPES_PATTERN states, and the limits on a client's list.
    """
    if len(text) > MAX_SCOPES_LENGTH:
        return f"scopes must be at most {MAX_SCOPES_LENGTH} characters"
    scopes = dict.fromkeys(text.split())  # ordered, without duplicates, in linear time
    if len(scopes) > MAX_SCOPES:
        return f"a client may hold at most {MAX_SCOPES} scopes"
    for scope in scopes:
        if scope != ADMIN_SCOPE:
            parts = scope.split(":")
            if len(parts) not in (2, 3) or parts[0] not in SCOPES or parts[1] not in SCOPES[parts[0]]:
                return f'unknown scope "{scope}"'
            if len(parts) == 3 and not OBJECT_ID.fullmatch(parts[2]):
                return f'scope "{scope}" names an invalid object id'
    if not scopes:
        return "scopes must not be empty"
    return None

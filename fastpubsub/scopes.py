"""The scope vocabulary: what a client may be allowed, and the limits on a client's list.

Kept apart from fastpubsub.auth (which signs tokens and hashes secrets) so that
the API's models, which the client SDK imports too, can state the rules
without pulling in the server's dependencies.
"""

from __future__ import annotations

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
# A space-separated scope list as a regular expression (the OpenAPI document states it).
_ONE_SCOPE = (
    r"(?:\*|(?:"
    + "|".join(f"{resource}:(?:{'|'.join(actions)})" for resource, actions in SCOPES.items())
    + r")(?::[A-Za-z0-9][A-Za-z0-9._-]{0,127})?)"
)
SCOPES_PATTERN = rf"^\s*{_ONE_SCOPE}(?:\s+{_ONE_SCOPE})*\s*$"
# Limits on one client's scopes (they are all carried by each of its tokens).
MAX_SCOPES = 128
MAX_SCOPES_LENGTH = 4096

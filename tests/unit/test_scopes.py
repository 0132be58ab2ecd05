"""Scope parsing, granting and the rule that clients only hand out what they hold."""

from __future__ import annotations

import pytest

from fastpubsub import auth
from fastpubsub.exceptions import InvalidInputError, PermissionDeniedError
from fastpubsub.scopes import MAX_SCOPES, MAX_SCOPES_LENGTH


def test_parse_scopes_keeps_order_and_drops_duplicates() -> None:
    assert auth.parse_scopes(" topics:read  topics:publish:orders topics:read ") == (
        "topics:read",
        "topics:publish:orders",
    )
    assert auth.parse_scopes("*") == ("*",)


@pytest.mark.parametrize(
    "text", ["", "  ", "topics", "topics:fly", "queues:read", "topics:read:bad id", "a:b:c:d"]
)
def test_parse_scopes_refuses_unknown_scopes(text: str) -> None:
    with pytest.raises(InvalidInputError):
        auth.parse_scopes(text)


@pytest.mark.parametrize(
    ("held", "scope", "obj", "granted"),
    [
        ({"*"}, "topics:delete", "x", True),
        ({"topics:publish"}, "topics:publish", "orders", True),
        ({"topics:publish:orders"}, "topics:publish", "orders", True),
        ({"topics:publish:orders"}, "topics:publish", "payments", False),
        ({"topics:publish:orders"}, "topics:publish", None, False),
        ({"topics:read"}, "topics:publish", "orders", False),
    ],
)
def test_grants(held: set[str], scope: str, obj: str | None, granted: bool) -> None:
    assert auth.grants(frozenset(held), scope, obj) is granted


def test_require_covered() -> None:
    auth.require_covered(frozenset({"*"}), ("*", "topics:read"))
    auth.require_covered(frozenset({"topics:publish"}), ("topics:publish:orders",))
    with pytest.raises(PermissionDeniedError):
        auth.require_covered(frozenset({"topics:publish:orders"}), ("topics:publish",))
    with pytest.raises(PermissionDeniedError):
        auth.require_covered(frozenset({"topics:read", "clients:create"}), ("*",))


def test_secrets_hash_and_verify() -> None:
    secret = auth.generate_secret()
    assert len(secret) >= 43
    hashed = auth.hash_secret(secret)
    assert hashed.startswith("$argon2id$")
    assert secret not in hashed
    assert auth.verify_secret(secret, hashed)
    assert not auth.verify_secret(secret + "x", hashed)
    assert not auth.verify_secret(secret, None)
    assert not auth.verify_secret(secret, "not a hash")


def test_parse_scopes_limits_how_many_and_how_long() -> None:
    most = " ".join(f"topics:publish:t{i}" for i in range(MAX_SCOPES))
    assert len(auth.parse_scopes(most + " topics:publish:t0")) == MAX_SCOPES  # duplicates are free
    with pytest.raises(InvalidInputError, match="at most"):
        auth.parse_scopes(most + " topics:publish:one-more")
    with pytest.raises(InvalidInputError, match="at most"):
        auth.parse_scopes(" ".join(f"topics:read:t{i}" for i in range(40_000)))
    with pytest.raises(InvalidInputError, match="characters"):
        auth.parse_scopes("topics:read " * (MAX_SCOPES_LENGTH // 12 + 1))


def test_secrets_hashed_by_earlier_releases_still_verify() -> None:
    """Client rows keep the PHC strings earlier releases wrote (then with passlib); they still work."""
    stored = (
        "$argon2id$v=19$m=19456,t=2,p=1$2dtbq3XOGcNYa20NYawVwg$hUDHnNMMJhAZv303EAgSGHjdrrlnFC3SynJsLhwXB1M"
    )
    assert auth.verify_secret("kept-from-an-earlier-release", stored)
    assert not auth.verify_secret("another-secret", stored)
    assert not auth.verify_secret("kept-from-an-earlier-release", "not a hash")
